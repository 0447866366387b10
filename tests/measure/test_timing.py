"""mxcompile.measure.timing: step counts, medians and progress reports."""

from __future__ import annotations

import pytest

from mxcompile.measure.timing import machine_load, time_step


def test_time_step_counts_and_medians() -> None:
    calls = []
    timing = time_step(lambda: calls.append(1), warmup_steps=2, time_steps=3)
    assert len(calls) == 5
    assert len(timing["times_s"]) == 3 and timing["median_s"] >= 0 and timing["first_s"] >= 0
    assert timing["warmup_s"] >= timing["first_s"]


def test_time_step_reports_every_step() -> None:
    reports = []
    time_step(lambda: None, warmup_steps=2, time_steps=3, on_step=lambda *r: reports.append(r))
    assert reports == [("warmup", 1, 2), ("warmup", 2, 2), ("steps", 1, 3), ("steps", 2, 3), ("steps", 3, 3)]


def test_time_step_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        time_step(lambda: None, warmup_steps=0)
    with pytest.raises(ValueError, match="time_steps"):
        time_step(lambda: None, time_steps=0)


def test_machine_load_counts_cpus() -> None:
    _, cpus = machine_load()
    assert cpus is not None and cpus >= 1
