"""Smoke test of benchmarks/native_ab.py: the committed kernels against the working tree's, one
tiny shape, the same bits from both builds, and no build left in the package's directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_native_ab_compares_two_builds_side_by_side() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "native_ab.py"), "--base", "HEAD", "--shapes", "64x64",
         "--repeats", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.strip().endswith(("True", "False"))]
    assert len(rows) == 7 and all(row.strip().endswith("True") for row in rows), result.stdout
    assert not list((REPO / "mxcompile" / "ops" / "native").glob("*.so")), "a build written into the package"


def test_a_shape_the_cases_cannot_quantize_is_named_before_anything_is_built() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "native_ab.py"), "--base", "HEAD", "--shapes", "4096x4112"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'4096x4112': rows and columns must be positive multiples of the block size 32" in result.stderr
    assert "Traceback" not in result.stderr
