"""The memory of one step, measured in this process: the peak resident set (VmHWM) and the
peak of live tensor storage (torch.profiler's allocator events).

Peak resident set. ``/proc/self/status`` keeps VmHWM, the process's resident high-water mark;
writing ``5`` to ``/proc/self/clear_refs`` resets it to the current resident set. So
:func:`rss_peak` resets it, reads VmRSS, runs the step and reads VmHWM. That is the step's own
peak only if freed memory goes back to the OS: glibc keeps small freed blocks in its heap, so
large buffers must come from mmap, either from the start (``MALLOC_MMAP_THRESHOLD_`` in the
environment of a fresh process, as :mod:`mxcompile.measure.fresh_process` does) or from now on
(:func:`release_memory_on_free`, mallopt, as :func:`in_process_rss_peak` does).

Tensor storage. :func:`profile_step` runs a step under ``torch.profiler`` with
``profile_memory=True``; :func:`memory_timeline` turns the exported trace's CPU allocation
events into (ms, bytes allocated) points, and :func:`tensor_peak_bytes` takes their peak. This
is what the memory planner models; the resident set also holds allocator slack and
fragmentation, which at small sizes is a large part.
"""

from __future__ import annotations

import ctypes
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# Buffers of this size or more are mmap-ed, so a free returns them to the OS and the peak
# resident set of one step is not hidden by an earlier step's heap.
MALLOC_MMAP_THRESHOLD_BYTES = 65536
MALLOPT_TRIM_THRESHOLD = -1  # glibc's M_TRIM_THRESHOLD
MALLOPT_MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD

# /proc interface: writing this value to clear_refs resets the peak resident set (VmHWM).
CLEAR_REFS_RESET_PEAK_RSS = "5"
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
KIB = 1024

PROFILER_CPU_DEVICE_TYPE = 0  # "Device Type" of a CPU allocation in torch.profiler's trace
US_PER_MS = 1000.0

Step = Callable[[], None]


class PeakRssUnavailable(RuntimeError):
    """The peak resident set cannot be measured here; the message says why."""


@dataclass(frozen=True)
class RssPeak:
    """The resident set around one step: VmRSS just before it and VmHWM over it."""

    peak_bytes: int
    before_bytes: int

    @property
    def step_increase_bytes(self) -> int:
        return self.peak_bytes - self.before_bytes


def proc_status_bytes(key: str) -> int | None:
    """The ``key`` line of /proc/self/status (e.g. "VmHWM") in bytes; None where there is none."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set; False where the kernel does not allow it."""
    try:
        PROC_CLEAR_REFS.write_text(CLEAR_REFS_RESET_PEAK_RSS)
    except OSError:
        return False
    return True


def release_memory_on_free() -> bool:
    """Make glibc malloc mmap buffers of `MALLOC_MMAP_THRESHOLD_BYTES` or more and give freed
    heap memory back to the OS now; False where this is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    settled = all(mallopt(option, MALLOC_MMAP_THRESHOLD_BYTES) == 1
                  for option in (MALLOPT_MMAP_THRESHOLD, MALLOPT_TRIM_THRESHOLD))
    malloc_trim(0)
    return settled


def rss_peak(step: Step) -> RssPeak:
    """Reset VmHWM, read VmRSS, run ``step()`` once and read VmHWM.

    Meaningful only where freed buffers go back to the OS (see the module docstring).

    Raises:
        PeakRssUnavailable: /proc/self/clear_refs cannot be written, or /proc/self/status has
            no VmRSS or VmHWM line (not Linux procfs).
    """
    if not reset_peak_rss():
        raise PeakRssUnavailable(f"{PROC_CLEAR_REFS} cannot be written here")
    before = proc_status_bytes("VmRSS")
    step()
    peak = proc_status_bytes("VmHWM")
    if before is None or peak is None:
        raise PeakRssUnavailable(f"{PROC_STATUS} has no VmRSS or VmHWM line (peak measurement needs Linux procfs)")
    return RssPeak(peak, before)


def in_process_rss_peak(step: Step) -> RssPeak:
    """The peak resident set of one ``step()`` in this process, which need not have started
    with ``MALLOC_MMAP_THRESHOLD_``: switches malloc to mmap large buffers (for the rest of
    the process), runs the step once so that none of its buffers is left in the heap, releases
    the freed heap, then measures one more step with :func:`rss_peak`. Runs ``step`` twice.

    Raises:
        PeakRssUnavailable: malloc is not glibc's, or as :func:`rss_peak`.
    """
    if not release_memory_on_free():
        raise PeakRssUnavailable("malloc is not glibc's (no mallopt)")
    step()
    release_memory_on_free()
    return rss_peak(step)


def memory_timeline(trace_path: Path) -> list[tuple[float, int]]:
    """(ms since the first traced event, bytes allocated since profiling began) of CPU allocations."""
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    starts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    if not starts:
        return []
    origin = min(starts)
    memory = sorted(
        (e for e in events
         if e.get("name") == "[memory]"
         and e.get("args", {}).get("Device Type") == PROFILER_CPU_DEVICE_TYPE
         and "Total Allocated" in e.get("args", {})),
        key=lambda e: e["ts"],
    )
    if not memory:
        return []
    # "Total Allocated" is a running total kept across profiling sessions of the process:
    # count from the level just before the first event of this one.
    first = memory[0]["args"]
    level = int(first["Total Allocated"]) - int(first.get("Bytes", 0))
    return [((e["ts"] - origin) / US_PER_MS, int(e["args"]["Total Allocated"]) - level) for e in memory]


def profile_step(step: Step) -> tuple[Any, list[tuple[float, int]]]:
    """Run ``step()`` once under torch.profiler (CPU, memory events): (the finished profiler,
    for its operator table; the step's :func:`memory_timeline`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory(prefix="mxcompile-trace-") as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        timeline = memory_timeline(trace_path)
    return prof, timeline


def tensor_peak_bytes(step: Step) -> int:
    """Peak bytes of CPU tensor storage that ``step()`` holds at once above the lowest level
    it starts from (torch.profiler's allocator events)."""
    _, timeline = profile_step(step)
    totals = [0] + [allocated for _, allocated in timeline]
    # Counted from the level before the step. The step may first free blocks it did not
    # allocate (the previous gradients; reported only if allocated under a profiler): the
    # peak is measured from the lowest level reached before it, as the planner's model
    # starts a step with the gradients already dropped.
    peak_at = max(range(len(totals)), key=totals.__getitem__)
    return totals[peak_at] - min(totals[: peak_at + 1])
