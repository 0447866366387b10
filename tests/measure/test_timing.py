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


def test_time_interleaved_rotates_the_order_and_times_each_step() -> None:
    """Round r starts at step r (mod n); each step's time is what the clock advanced while it ran."""
    order: list[int] = []
    costs = {0: 1, 1: 2, 2: 5}  # clock ticks each step advances beyond the one read at its start
    now = [0]

    def clock() -> float:
        return float(now[0])

    def make(index: int):
        def step() -> None:
            order.append(index)
            now[0] += costs[index]
        return step

    times = timing.time_interleaved([make(0), make(1), make(2)], 4, clock=clock)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert times == [[1.0] * 4, [2.0] * 4, [5.0] * 4]


def test_time_interleaved_rejects_no_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        timing.time_interleaved([lambda: None], 0)
