"""benchmarks/gpu_kernels.py --tiny: the benchmark script's CPU smoke run (interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.slow
def test_benchmark_tiny_runs(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself before importing triton
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(tmp_path / "kernels.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    # 4 quantize scale modes, the GEMM's three main loops and dot_scaled with TMA descriptors
    # for two B layouts, the attention forward and backward.
    assert "FAIL" not in out and out.count("[ok]") == 11
    for header in ("quantize (bf16 in", "GEMM TFLOP/s", "attention TFLOP/s"):
        assert header in out
    # The JSON holds every part's figures (a GPU session reads them from there).
    results = json.loads((tmp_path / "kernels.json").read_text())
    assert results["checks_passed"] is True
    assert set(results["gemm"][0]["tflops"]) >= {"mx expand_bf16", "mx dot_scaled", "mm bf16"}
    assert {"forward_mx_over_sdpa", "forward_backward_mx_over_sdpa"} <= set(results["attention"]["rows"][0])
    assert {"copy_gbs", "both_over_copy"} <= set(results["quantize"][0])

