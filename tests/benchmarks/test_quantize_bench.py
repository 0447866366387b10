"""Smoke test of benchmarks/quantize.py: `--quick` runs end to end and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quantize_benchmark_quick() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "quantize.py"), "--quick", "--repeats", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "bf16 256x256" in out
    for case in (
        "quantize last axis",
        "quantize first axis",
        "quantize both axes",
        "x.clone()",
        "copy_ into preallocated",
        "torchao to_mx eager",
        "torchao to_mx compiled",
    ):
        assert case in out, f"missing row {case!r} in:\n{out}"
    # Every quantize row has a time, a GB/s figure, a ratio to clone and a target verdict.
    for line in out.splitlines():
        if line.strip().startswith("quantize "):
            fields = line.split()
            assert "target" in line and ("met" in line or "MISSED" in line), line
            float(fields[3]), float(fields[4]), float(fields[5])  # time ms, GB/s, x clone
