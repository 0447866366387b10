"""Measure the real memory peak of one training step, in a fresh process.

Why a subprocess: a TorchDispatchMode cannot see inside compiled graphs, and the process's
resident-set high-water mark (VmHWM) covers everything, but only once per process unless
reset. So the step runs in a child process that

1. starts with ``MALLOC_MMAP_THRESHOLD_`` set, so glibc serves large buffers with mmap and
   returns them to the OS on free (otherwise freed memory stays resident and VmHWM never
   falls back);
2. builds the step, runs it ``warmup_steps`` times (compilation, lazy allocations);
3. on CPU measures the peak resident set of one step (:func:`mxcompile.measure.memory.rss_peak`:
   VmHWM reset through ``/proc/self/clear_refs``), then runs one more step under
   ``torch.profiler`` for the peak of live tensor storage the step allocated
   (:func:`mxcompile.measure.memory.tensor_peak_bytes`: what the planner models; the RSS also
   holds allocator slack and fragmentation, which at small sizes is a large part). On CUDA it
   resets and reads ``torch.cuda.max_memory_allocated`` (tensor storage already).

The step comes from a factory named ``"package.module:function"``: called in the child with
``factory_kwargs`` (JSON values), it returns a zero-argument callable that runs one step.
Let the step set gradients to None before its backward if the grads should count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .memory import MALLOC_MMAP_THRESHOLD_BYTES, rss_peak, tensor_peak_bytes

DEFAULT_TIMEOUT_S = 600.0
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


def factory_parts(factory: str) -> tuple[str, str]:
    """(module, function) of a factory named ``"package.module:function"``.

    Raises:
        ValueError: ``factory`` is not a string of that form.
    """
    if not isinstance(factory, str) or ":" not in factory:
        raise ValueError(f"factory={factory!r}: give 'package.module:function'")
    module_name, _, function_name = factory.partition(":")
    return module_name, function_name


def resolve_factory(factory: str) -> Callable[..., Callable[[], None]]:
    """The step factory named ``"package.module:function"`` (imported)."""
    import importlib

    module_name, function_name = factory_parts(factory)
    return getattr(importlib.import_module(module_name), function_name)


def _child(spec: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    step = resolve_factory(spec["factory"])(**spec["kwargs"])
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
    peak = rss_peak(step)
    return {"device": "cpu", "peak_bytes": peak.peak_bytes, "before_bytes": peak.before_bytes,
            "tensor_peak_bytes": tensor_peak_bytes(step)}


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
    factory_parts(factory)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not accepted; accepted: ['cpu', 'cuda']")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps!r}: give an int >= 1 (the first step compiles)")
    spec = {"factory": factory, "kwargs": dict(factory_kwargs or {}), "device": device, "warmup_steps": warmup_steps}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MALLOC_MMAP_THRESHOLD_BYTES))
    code = (
        f"import json, sys; from {__name__} import _child, RESULT_MARKER; "
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

