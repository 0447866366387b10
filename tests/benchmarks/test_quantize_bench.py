"""Smoke test of benchmarks/quantize.py: `--quick` runs end to end and prints its table, whose
target verdicts agree with the ratios they judge."""

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
        "fake quantize last axis",
        "dequantize last axis",
        "compiled graph",
        "x.clone()",
        "copy_ into preallocated",
        "torchao to_mx eager",
        "torchao to_mx compiled",
    ):
        assert case in out, f"missing row {case!r} in:\n{out}"
    # Every quantize row has a time, a GB/s figure, a ratio to clone and the target verdict that
    # ratio earns (the targets themselves are not met on this CPU: information, not asserted).
    quantize_rows = 0
    for line in out.splitlines():
        if line.strip().startswith("quantize "):
            fields = line.split()
            float(fields[3]), float(fields[4])  # time ms, GB/s
            ratio = float(fields[5])  # x clone
            assert fields[6:8] == ["target", "<="] and fields[8].endswith("x:"), line
            target = float(fields[8][:-2])
            if ratio != target:  # the verdict uses the unrounded ratio
                assert fields[9] == ("met" if ratio < target else "MISSED"), line
            quantize_rows += 1
        elif line.strip().startswith("x.clone()"):
            assert float(line.split()[3]) == 1.0, line  # the column is relative to this row
    assert quantize_rows == 3 * out.count("bf16 "), out
