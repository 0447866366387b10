"""Smoke test of benchmarks/huge_pages.py: its interleaved comparison restores the threshold it
toggles and prints one row per op and size."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxcompile.ops import native
from mxcompile.ops.native import huge_pages

from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]


def _benchmark():
    return load_script(REPO / "benchmarks" / "huge_pages.py", "huge_pages_bench")


def test_compare_times_both_settings_and_restores_the_threshold() -> None:
    bench = _benchmark()
    threshold = huge_pages.ADVISED_MIN_BYTES
    seen = []
    on, off = bench.compare(lambda: seen.append(huge_pages.ADVISED_MIN_BYTES), repeats=3)
    assert sorted(seen) == sorted([threshold] * 3 + [bench.ADVICE_OFF] * 3)
    assert on >= 0 and off >= 0
    assert huge_pages.ADVISED_MIN_BYTES == threshold


def test_the_table_has_a_row_per_op_and_size(capsys) -> None:
    if not native.available():
        pytest.skip("native kernels not built")
    assert _benchmark().main(["--sizes", "64", "--repeats", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("64 ")]
    assert [row[1] for row in rows] == ["quantize", "fake_quantize", "dequantize"]
    assert all(row[-1].endswith("x") for row in rows)
