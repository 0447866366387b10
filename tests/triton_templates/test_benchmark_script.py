"""benchmarks/gpu_kernels.py --tiny: the benchmark script's CPU smoke run (interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.slow
def test_benchmark_tiny_runs() -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself before importing triton
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    # 4 quantize scale modes, the GEMM's dot_scaled and hopper paths and dot_scaled with TMA
    # descriptors for two B layouts, the attention forward and backward.
    assert "FAIL" not in out and out.count("[ok]") == 10
    headers = ("quantize (bf16 in", "GEMM TFLOP/s", "attention forward TFLOP/s",
               "attention forward+backward TFLOP/s")  # fmt: skip
    for header in headers:
        assert header in out
