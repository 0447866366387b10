"""mxcompile.measure.timing: step counts, medians and progress reports."""

from __future__ import annotations

import pytest

from mxcompile.measure import timing
from mxcompile.measure.timing import machine_load, time_step


def test_time_step_counts_and_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that only moves inside the step, by a known amount per call: the first (compile)
    # step, one more warm-up step, then three timed ones whose median is not their mean.
    durations = iter([5.0, 0.5, 0.3, 0.1, 0.8])
    clock = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def step() -> None:
        clock[0] += next(durations)

    result = time_step(step, warmup_steps=2, time_steps=3)
    assert result["first_s"] == pytest.approx(5.0)
    assert result["warmup_s"] == pytest.approx(5.5)
    assert result["times_s"] == pytest.approx([0.3, 0.1, 0.8])
    assert result["median_s"] == pytest.approx(0.3)
    assert next(durations, None) is None  # exactly five steps ran


def test_time_step_reports_every_step() -> None:
    reports = []
    time_step(lambda: None, warmup_steps=2, time_steps=3, on_step=lambda *r: reports.append(r))
    assert reports == [("warmup", 1, 2), ("warmup", 2, 2), ("steps", 1, 3), ("steps", 2, 3), ("steps", 3, 3)]


def test_time_step_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        time_step(lambda: None, warmup_steps=0)
    with pytest.raises(ValueError, match="time_steps"):
        time_step(lambda: None, time_steps=0)


def test_machine_load_reads_the_load_and_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.5, 1.0, 0.5))
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: {0, 1, 5})
    assert machine_load() == (1.5, 3)  # the 1-minute load; the CPUs this process may use

    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average")

    monkeypatch.setattr(timing.os, "getloadavg", unavailable)
    assert machine_load() == (None, 3)
