"""Smoke test of benchmarks/memory_plan.py: `--quick` (gpt-tiny, budgets 1.0 and 0.5, eager
lowering) runs end to end and prints its side-by-side table with positive numbers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "memory_plan.py"
ROWS = ("none", "1.00", "0.50")


def _columns() -> list[str]:
    spec = importlib.util.spec_from_file_location("memory_plan_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return [name for name, _ in module.COLUMNS]


def _table(out: str, model: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The rows of ``model``'s table by label (column name -> cell), and the lines after it."""
    names = _columns()
    lines = out.splitlines()
    start = lines.index(f"== {model} ==") + 1
    assert lines[start].split() == " ".join(names).split(), lines[start]
    rows = {}
    for line in lines[start + 1:start + 1 + len(ROWS)]:
        cells = line.split()
        assert len(cells) == len(names), (names, line)
        rows[cells[0]] = dict(zip(names, cells))
    return lines[start + 1 + len(ROWS):], rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_plan_benchmark_quick() -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--jobs", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    after, rows = _table(out, "gpt-tiny")
    assert sorted(rows) == sorted(ROWS), rows
    for label, row in rows.items():
        for column in ("mx MiB", "mx RSS", "torch MiB", "torch RSS", "mx ms", "torch ms"):
            assert float(row[column]) > 0, (label, column, row)
        assert row["<=torch"] in ("yes", "NO"), row
    for label in ("1.00", "0.50"):
        row = rows[label]
        for column in ("budget MiB", "pred MiB", "mx/torch", "mx+p/bud", "solve s", "plan s"):
            assert float(row[column]) > 0, (label, column, row)
        assert float(row["rc est ms"]) >= 0, row
        assert row["in bud"] in ("yes", "NO"), row
        float(row["mx +ms"]), float(row["torch +ms"])  # signed overheads
    # A smaller budget is a smaller budget, and the plan's prediction stays within it.
    assert float(rows["0.50"]["budget MiB"]) < float(rows["1.00"]["budget MiB"])
    assert after[0].startswith("monotone peak as the budget falls"), after[0]
    assert "mxfp8 " in after[0] and "torch " in after[0]
    assert not any(line.startswith("error:") for line in after), out
    assert "planner alone" in out and "24 layers" in out
    assert "total " in out

