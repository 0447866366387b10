"""A shortened run of benchmarks/convergence.py: MXFP8 (with MX attention) tracks bf16."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# 40 steps of the tiny GPT measured a gap of +0.06%; the full benchmark's target is 2% after
# 300 steps. Early in training the curves are steep, so the short run gets a looser bound.
SHORT_RUN_GAP_PERCENT = 5.0


@pytest.mark.slow
def test_short_convergence_run_stays_close_to_bf16(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "40", "--size", "tiny", "--batch-size", "8",
                           "--texts", "4", "--tail", "10", "--out", str(tmp_path)])
    first = results["bf16"]["losses"][0]
    assert results["bf16"]["final"] < first - 1.0  # it trained
    for name in ("mxfp8", "mx-noattn"):
        assert abs(results[name]["gap_percent"]) < SHORT_RUN_GAP_PERCENT, (name, results[name])
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
