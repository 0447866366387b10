"""Measure the real memory peak of one training step, in a fresh process.

Why a subprocess: a TorchDispatchMode cannot see inside compiled graphs, and the process's
resident-set high-water mark (VmHWM) covers everything, but only once per process unless
reset. So the step runs in a child process that

1. starts with ``MALLOC_MMAP_THRESHOLD_`` set, so glibc serves large buffers with mmap and
   returns them to the OS on free (otherwise freed memory stays resident and VmHWM never
   falls back);
2. builds the step, runs it ``warmup_steps`` times (compilation, lazy allocations);
3. on CPU writes ``5`` to ``/proc/self/clear_refs`` (resets VmHWM to the current RSS), reads
   VmRSS, runs the step once and reads VmHWM from ``/proc/self/status``; then runs one more
   step under ``torch.profiler`` with ``profile_memory=True``, whose allocator events give the
   peak of live tensor storage the step allocated (what the planner models; the RSS also holds
   allocator slack and fragmentation, which at small sizes is a large part). On CUDA it resets
   and reads ``torch.cuda.max_memory_allocated`` (tensor storage already).

The step comes from a factory named ``"package.module:function"``: called in the child with
``factory_kwargs`` (JSON values), it returns a zero-argument callable that runs one step.
Let the step set gradients to None before its backward if the grads should count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

MMAP_THRESHOLD_BYTES = 65536  # glibc: allocations at least this large use mmap (freed to the OS)
DEFAULT_TIMEOUT_S = 600.0
KIB = 1024
CLEAR_REFS_RESET_HWM = "5"  # /proc/<pid>/clear_refs: "5" resets the peak RSS (VmHWM)
RESULT_MARKER = "MXCOMPILE_PEAK_RESULT "


@dataclass(frozen=True)
class PeakMeasurement:
    """One measured step.

    Attributes:
        device: "cpu" or "cuda".
        peak_bytes: the process's peak during the step (CPU: VmHWM; CUDA: max allocated).
        before_bytes: resident (CPU) or allocated (CUDA) bytes just before the step.
        step_peak_bytes: ``peak_bytes - before_bytes``: what the step added at its peak.
        tensor_peak_bytes: peak bytes of tensor storage allocated by the step and live at
            once (CPU: profiler allocator events; CUDA: same as ``step_peak_bytes``).
    """

    device: str
    peak_bytes: int
    before_bytes: int
    tensor_peak_bytes: int

    @property
    def step_peak_bytes(self) -> int:
        return self.peak_bytes - self.before_bytes


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise RuntimeError(f"/proc/self/status has no {field} line; peak measurement needs Linux procfs")


def tensor_peak_bytes(step: Callable[[], None]) -> int:
    """Peak bytes of CPU tensor storage that ``step()`` holds at once above the lowest level
    it starts from (torch.profiler's allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    from ..profiling import memory_timeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory(prefix="mxcompile-peak-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        totals = [0] + [allocated for _, allocated in memory_timeline(trace)]
    # Counted from the level before the step. The step may first free blocks it did not
    # allocate (the previous gradients; reported only if allocated under a profiler): the
    # peak is measured from the lowest level reached before it, as the planner's model
    # starts a step with the gradients already dropped.
    peak_at = max(range(len(totals)), key=totals.__getitem__)
    return totals[peak_at] - min(totals[: peak_at + 1])


def _child(spec: Mapping[str, Any]) -> dict[str, Any]:
    import importlib

    import torch

    module_name, _, function_name = spec["factory"].partition(":")
    step = getattr(importlib.import_module(module_name), function_name)(**spec["kwargs"])
    for _ in range(spec["warmup_steps"]):
        step()
    if spec["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"device": "cuda", "peak_bytes": peak, "before_bytes": before, "tensor_peak_bytes": peak - before}
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write(CLEAR_REFS_RESET_HWM)
    before = _status_bytes("VmRSS")
    step()
    peak = _status_bytes("VmHWM")
    return {"device": "cpu", "peak_bytes": peak, "before_bytes": before, "tensor_peak_bytes": tensor_peak_bytes(step)}


def measure_step_peak(
    factory: str,
    *,
    factory_kwargs: Mapping[str, Any] | None = None,
    device: str = "cpu",
    warmup_steps: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PeakMeasurement:
    """Run one step from ``factory`` in a fresh Python process and return its memory peak.

    Raises:
        ValueError: bad arguments, naming the argument.
        RuntimeError: the child failed; the message carries its stderr tail.
    """
    if ":" not in factory:
        raise ValueError(f"factory={factory!r}: give 'package.module:function'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not accepted; accepted: ['cpu', 'cuda']")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps!r}: give an int >= 1 (the first step compiles)")
    spec = {"factory": factory, "kwargs": dict(factory_kwargs or {}), "device": device, "warmup_steps": warmup_steps}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES))
    code = (
        "import json, sys; from mxcompile.cost.measure import _child, RESULT_MARKER; "
        "print(RESULT_MARKER + json.dumps(_child(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"measuring {factory} failed (exit {done.returncode}); child stderr tail:\n{done.stderr[-4000:]}"
        )
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    return PeakMeasurement(result["device"], int(result["peak_bytes"]), int(result["before_bytes"]),
                           int(result["tensor_peak_bytes"]))


def gpt_train_step(size: str = "tiny", memory_budget: float | int | None = None, batch_size: int = 8,
                   backend: str = "inductor") -> Any:
    """A step factory for :func:`measure_step_peak`: one forward+backward of an example GPT
    and its loss, compiled together with the mxfp8 backend (``backend="eager"`` skips
    Inductor), grads set to None first so that they count in the step's peak."""
    import functools

    import torch

    from ..backend import compile_graph
    from ..config import MXConfig
    from ..examples.gpt import LanguageModelLoss, gpt_factory
    from ..lowering import eager_compiler, inductor_compiler

    model, (idx,) = gpt_factory(size, batch_size=batch_size)
    lower = eager_compiler if backend == "eager" else inductor_compiler
    compiled = torch.compile(LanguageModelLoss(model), backend=functools.partial(
        compile_graph, config=MXConfig(memory_budget=memory_budget), lower=lower))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(idx).backward()

    return step
