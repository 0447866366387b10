"""Smoke test of benchmarks/memory_plan.py: `--quick` (gpt-tiny, budgets 1.0 and 0.5, eager
lowering) runs end to end, and its tables show what the quick run must guarantee: the plan's
prediction and the measured peak within each budget, the mxfp8 peak at or under torch's at
each matched budget (torch's fraction converted to the bytes its step used), and cells
consistent with each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "memory_plan.py"
ROWS = ("none", "1.00", "0.50")


def _columns(table: str) -> list[str]:
    module = load_script(SCRIPT, "memory_plan_benchmark")
    return [name for name, _ in getattr(module, table)]


def _rows(lines: list[str], table: str, count: int) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The ``count`` rows of a table whose header is ``lines[0]``, by label (column name ->
    cell), and the lines after them."""
    names = _columns(table)
    assert lines[0].split() == " ".join(names).split(), lines[0]
    rows = {}
    for line in lines[1:1 + count]:
        cells = line.split()
        assert len(cells) == len(names), (names, line)
        rows[cells[0]] = dict(zip(names, cells))
    return lines[1 + count:], rows


def _table(out: str, model: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The rows of ``model``'s table by label (column name -> cell), and the lines after it."""
    lines = out.splitlines()
    return _rows(lines[lines.index(f"== {model} ==") + 1:], "COLUMNS", len(ROWS))


def _number(cell: str) -> float | None:
    """A numeric cell's value; None for "-" (not applicable), "yes"/"NO" flags are not numbers."""
    if cell == "-":
        return None
    try:
        return float(cell)
    except ValueError:
        return None


@pytest.fixture(scope="module")
def quick_output() -> str:
    """stdout of one `--quick` run, shared by the tests below."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--jobs", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _matched(out: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    after, _ = _table(out, "gpt-tiny")
    assert after[2].startswith("matched budgets"), after[2]
    return _rows(after[3:], "MATCHED_COLUMNS", len(ROWS) - 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_memory_plan_benchmark_quick(quick_output: str) -> None:
    out = quick_output
    after, rows = _table(out, "gpt-tiny")
    assert sorted(rows) == sorted(ROWS), rows
    cell = {label: {name: _number(value) for name, value in row.items() if name != "budget"}
            for label, row in rows.items()}
    for label, row in cell.items():
        for column in ("mx MiB", "torch MiB"):  # tensor-storage peaks: the flags' inputs
            assert row[column] > 0, (label, column, rows[label])
    for label in ("1.00", "0.50"):
        row = cell[label]
        for column in ("budget MiB", "pred MiB", "solve s", "plan s"):
            assert row[column] > 0, (label, column, rows[label])
        # The plan's prediction is within its budget, and under eager lowering the measured
        # tensor peak plus the parameters and inputs is too (issue 18 part 2: a budget is a limit).
        assert row["pred MiB"] <= row["budget MiB"], rows[label]
        assert rows[label]["in bud"] == "yes" and row["mx+p/bud"] <= 1.0, rows[label]
        # Overheads are this row's step time minus the no-budget row's (cells rounded to 1 ms).
        assert abs(row["mx +ms"] - (row["mx ms"] - cell["none"]["mx ms"])) <= 1, rows
        assert abs(row["torch +ms"] - (row["torch ms"] - cell["none"]["torch ms"])) <= 1, rows
    # 1.0 is the keep-everything peak: nothing needs recomputing, so no recompute time.
    assert cell["1.00"]["rc est ms"] == 0, rows["1.00"]
    assert cell["0.50"]["rc est ms"] >= 0, rows["0.50"]
    # A smaller budget is a smaller budget, and the mxfp8 tensor peak does not rise with it.
    assert cell["0.50"]["budget MiB"] < cell["1.00"]["budget MiB"]
    assert after[0].startswith("monotone peak as the budget falls"), after[0]
    assert "mxfp8 tensors yes," in after[0], after[0]
    assert "torch tensors " in after[0], after[0]
    assert after[2].startswith("matched budgets"), after[2]
    after_matched, matched = _matched(out)
    assert sorted(matched) == ["0.50", "1.00"], matched
    for label, row in matched.items():
        budget, torch_peak, mx_peak = (int(row[c]) for c in ("budget B", "torch+p B", "mx+p B"))
        # torch's fraction converted to bytes: what its step used (peak + parameters and inputs).
        assert budget == torch_peak, row
        assert mx_peak > 0 and float(row["mx ms"]) > 0 and float(row["torch ms"]) > 0, row
    assert not any(line.startswith("error:") for line in after_matched), out
    assert "planner alone" in out and "24 layers" in out
    assert "total " in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mxfp8_at_or_under_torch_at_every_matched_budget(quick_output: str) -> None:
    """At each torch fraction converted to bytes (1.0 and 0.5) the mxfp8 step stays within that
    byte budget, so at or under torch's peak (issue 18 part 2). At 0.5 this was 1.0% over
    (2801684 B against 2773012 B) until the memory model counted a saved split piece's whole
    storage (README, Memory budget)."""
    _, matched = _matched(quick_output)
    for label, row in matched.items():
        budget, mx_peak = int(row["budget B"]), int(row["mx+p B"])
        assert 0 < mx_peak <= budget and row["in bud"] == "yes", (label, row)
