"""Step timing in this process, and how busy the machine was while it ran."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Sequence

from ..examples._common import check_positive_int
from .memory import Step

# on_step(phase, done, total): phase "warmup" (the first of these steps compiles) or "steps".
ProgressCallback = Callable[[str, int, int], None]


def time_step(step: Step, *, warmup_steps: int = 1, time_steps: int = 5,
              on_step: ProgressCallback | None = None) -> dict[str, Any]:
    """Run ``step`` ``warmup_steps`` times (the first compiles), then ``time_steps`` times;
    returns ``{"first_s", "warmup_s", "median_s", "times_s"}`` (wall seconds; ``warmup_s``
    covers all warm-up steps, the first included). ``on_step(phase, done, total)`` is called
    after every step, outside the timed span."""
    check_positive_int("warmup_steps", warmup_steps)
    check_positive_int("time_steps", time_steps)
    notify = on_step or (lambda phase, done, total: None)
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    notify("warmup", 1, warmup_steps)
    for done in range(2, warmup_steps + 1):
        step()
        notify("warmup", done, warmup_steps)
    warm = time.perf_counter() - started
    times = []
    for done in range(1, time_steps + 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        notify("steps", done, time_steps)
    return {"first_s": first, "warmup_s": warm, "median_s": statistics.median(times), "times_s": times}


def time_interleaved(steps: Sequence[Step], rounds: int,
                     clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
    """Times of each of ``steps`` over ``rounds`` rounds, one list per step in round order.
    Every round runs each step once, the order rotated by one per round, so that a slow spell
    of a shared machine hits every step alike and cancels in same-round differences, and no
    step always runs after the same one."""
    check_positive_int("rounds", rounds)
    times: list[list[float]] = [[] for _ in steps]
    for round_index in range(rounds):
        for k in range(len(steps)):
            index = (k + round_index) % len(steps)
            started = clock()
            steps[index]()
            times[index].append(clock() - started)
    return times


def machine_load() -> tuple[float | None, int | None]:
    """(1-minute load average, CPUs available to this process); None where unknown."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:
        cpus: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return load, cpus
