"""A compiled training step under the profiler: step times, peak memory (resident set and
tensor-storage timeline), and the operators that took the time, grouped into classes.

    step = profile_training_step(model, inputs, backend="mxfp8", steps=10)  # in a fresh process

Nothing here renders anything; the CLI turns these records into tables, plots and HTML.

Step memory. `profile_training_step` times its steps with the default allocator settings, then
measures the peak resident set of one more step with `mxcompile.measure.memory.in_process_rss_peak`:
it switches glibc malloc to mmap every buffer of `MALLOC_MMAP_THRESHOLD_BYTES` or more (mallopt;
as MALLOC_MMAP_THRESHOLD_ does at start-up, but without slowing the timed steps down by page
faults), so that freed buffers go back to the OS, releases the freed heap (malloc_trim), resets
the peak resident set (VmHWM, through /proc/self/clear_refs) and runs one more step: VmHWM is
then the peak of that step. Call it in a fresh process, so that nothing else ran there before.
The tensor-memory timeline comes from torch.profiler's allocation events. Inductor names its C++
kernels in the profile only with `cpp.enable_kernel_profile`; that option is patched for the
duration of the call and restored afterwards.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..config import MXConfig
from ..measure.memory import PeakRssUnavailable, in_process_rss_peak, profile_step
from ..measure.timing import ProgressCallback, machine_load, time_step
from .cotangents import DEFAULT_COTANGENT_SEED, differentiable_outputs, make_cotangents

DEFAULT_TOP_OPERATORS = 15
# Timed steps spread wider than this (slowest / fastest) suggest a busy machine.
NOISY_STEP_SPREAD = 3.0
# A load average above the CPU count by more than this (the measuring process itself counts for
# about one) means other processes competed for the CPUs.
BUSY_LOAD_MARGIN = 0.5

# Operator classes, first match wins (names as torch.profiler reports them, Inductor's CPU
# kernels included when `cpp.enable_kernel_profile` is on).
OPERATOR_CLASSES: tuple[tuple[str, str], ...] = (
    ("GEMM", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$|^mkldnn|mx_mm"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|^aten::_softmax"),
    ("mxcompile custom ops (not fused)", r"^mxcompile::"),
    ("Inductor fused kernels", r"cpp_fused|^triton_|^kernel_cpp"),
    ("copies and casts", r"^aten::(_to_copy|to|copy_|clone|contiguous|empty|empty_strided|zeros|zero_|fill_|resize_)$"),
    ("compiled-graph and autograd overhead",
     r"^## Call CompiledFxGraph|Torch-Compiled Region|CompiledFunction|TorchDynamo|AOTDispatcher"
     r"|^autograd::|Optimizer"),
)
OTHER_OPERATOR_CLASS = "other aten ops"


@dataclass(frozen=True)
class OperatorTime:
    name: str
    op_class: str
    self_cpu_us: float
    calls: int


@dataclass
class StepProfile:
    """One backend's compiled training step (forward + backward, no optimizer)."""

    backend: str
    autocast_bf16: bool
    compile_s: float  # the first call: compilation plus one step
    step_times_s: list[float]
    peak_rss_bytes: int | None  # VmHWM during one step (None where /proc cannot reset it)
    rss_before_step_bytes: int | None
    memory_timeline: list[tuple[float, int]]  # (ms since the profiled step began, bytes allocated)
    operators: list[OperatorTime]
    operator_classes: dict[str, float]  # class -> self CPU µs over the profiled step
    notes: list[str] = field(default_factory=list)
    load_average: float | None = None  # 1-minute system load average after the timed steps
    cpu_count: int | None = None  # CPUs this process may run on
    # mxfp8: the first training step after compiling, measured at run time (StepCoverage.to_dict: its MX share of
    # all GEMM FLOPs, eager GEMMs outside the compiled graphs included); None for other backends
    step_coverage: dict[str, Any] | None = None

    @property
    def machine_busy(self) -> bool:
        """Whether other processes competed for the CPUs while the steps were timed."""
        if self.load_average is None or not self.cpu_count:
            return False
        return self.load_average > self.cpu_count + BUSY_LOAD_MARGIN

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def min_step_s(self) -> float:
        return min(self.step_times_s)

    @property
    def noisy(self) -> bool:
        """Whether the slowest timed step took over NOISY_STEP_SPREAD times the fastest."""
        return max(self.step_times_s) > NOISY_STEP_SPREAD * self.min_step_s

    @property
    def peak_step_increase_bytes(self) -> int | None:
        if self.peak_rss_bytes is None or self.rss_before_step_bytes is None:
            return None
        return self.peak_rss_bytes - self.rss_before_step_bytes

    @property
    def peak_tensor_bytes(self) -> int:
        return max((b for _, b in self.memory_timeline), default=0)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["median_step_s"] = self.median_step_s
        data["min_step_s"] = self.min_step_s
        data["peak_step_increase_bytes"] = self.peak_step_increase_bytes
        data["peak_tensor_bytes"] = self.peak_tensor_bytes
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepProfile":
        fields_ = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields_["memory_timeline"] = [tuple(p) for p in fields_["memory_timeline"]]
        fields_["operators"] = [OperatorTime(**o) for o in fields_["operators"]]
        return cls(**fields_)


def classify_operator(name: str) -> str:
    """The class of a profiler event name (see `OPERATOR_CLASSES`)."""
    for op_class, pattern in OPERATOR_CLASSES:
        if re.search(pattern, name):
            return op_class
    return OTHER_OPERATOR_CLASS



def _measure_peak_rss(step: Callable[[], None]) -> tuple[int | None, int | None, str | None]:
    """(VmHWM over one step, VmRSS before it, why not measured). Changes malloc's settings."""
    try:
        peak = in_process_rss_peak(step)
    except PeakRssUnavailable as err:
        return None, None, f"peak resident memory not measured: {err}"
    return peak.peak_bytes, peak.before_bytes, None


def _step_coverage(model: nn.Module) -> Any:
    from ..backend import step_coverage_of

    return step_coverage_of(model)


def compile_for_backend(model: nn.Module, backend: str, config: MXConfig | None = None) -> Callable[..., Any]:
    """torch.compile(model) with Inductor ("inductor") or the mxfp8 backend ("mxfp8", `config`)."""
    if backend == "mxfp8":
        from ..backend import compile as mx_compile

        return mx_compile(model, config=config)
    if backend == "inductor":
        return torch.compile(model)
    raise ValueError(f"backend={backend!r} is not accepted; accepted: ['inductor', 'mxfp8']")


def _autocast(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def _make_step(
    model: nn.Module, forward: Callable[..., Any], inputs: Sequence[Any], autocast_bf16: bool, seed: int
) -> Callable[[], None]:
    cotangents: list[Tensor] = []

    def step() -> None:
        with _autocast(autocast_bf16):
            outputs = differentiable_outputs(forward(*inputs))
        if not outputs:
            raise ValueError("the model's output has no floating-point tensor that requires grad; "
                             "a training step needs one")
        if not cotangents:
            cotangents.extend(make_cotangents(outputs, seed))
        torch.autograd.backward(outputs, cotangents)
        model.zero_grad(set_to_none=True)

    return step


def _profile_operators(
    step: Callable[[], None], top: int
) -> tuple[list[OperatorTime], dict[str, float], list[tuple[float, int]]]:
    """One step under torch.profiler: (top operators, self time per class, memory timeline)."""
    prof, timeline = profile_step(step)
    rows = [
        OperatorTime(e.key, classify_operator(e.key), float(e.self_cpu_time_total), int(e.count))
        for e in prof.key_averages()
    ]
    classes: dict[str, float] = {}
    for row in rows:
        classes[row.op_class] = classes.get(row.op_class, 0.0) + row.self_cpu_us
    rows.sort(key=lambda r: r.self_cpu_us, reverse=True)
    return rows[:top], classes, timeline


def profile_training_step(
    model: nn.Module,
    inputs: Sequence[Any],
    *,
    backend: str,
    steps: int,
    warmup: int = 1,
    config: MXConfig | None = None,
    autocast_bf16: bool = True,
    seed: int = DEFAULT_COTANGENT_SEED,
    top_operators: int = DEFAULT_TOP_OPERATORS,
    on_step: ProgressCallback | None = None,
) -> StepProfile:
    """Compile `model` with `backend` and measure its training step (forward, backward with a
    seeded cotangent, no optimizer): compile time, `steps` timed steps, the peak resident set
    of one step, and one profiled step. `on_step(phase, done, total)` reports progress.

    The peak is only meaningful in a fresh process; it changes malloc's settings (see above).
    Inductor's `cpp.enable_kernel_profile` is on during the call only."""
    if steps <= 0 or warmup <= 0:
        raise ValueError(f"steps={steps} and warmup={warmup} must both be positive")
    notify = on_step or (lambda phase, done, total: None)
    import torch._inductor.config as inductor_config

    # mxfp8 measures its first step after compiling (`measure_first_step`) under torch.profiler:
    # one more warmup step, so that no timed step carries that profiler.
    measured = backend == "mxfp8" and (config or MXConfig()).measure_first_step
    # Inductor's C++ kernels by name in the profile; compiled (first step) and run under it.
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        step = _make_step(model, compile_for_backend(model, backend, config), inputs, autocast_bf16, seed)
        timing = time_step(step, warmup_steps=warmup + int(measured), time_steps=steps, on_step=notify)
        coverage = _step_coverage(model) if backend == "mxfp8" else None
        load_average, cpu_count = machine_load()
        operators, classes, timeline = _profile_operators(step, top_operators)
        notify("profile", 1, 1)
        peak, rss_before, problem = _measure_peak_rss(step)  # last: it changes malloc's settings
    notes = [problem] if problem else []
    notify("memory", 1, 1)
    return StepProfile(backend, autocast_bf16, timing["first_s"], timing["times_s"], peak, rss_before, timeline,
                       operators, classes, notes, load_average, cpu_count,
                       coverage.to_dict() if coverage is not None else None)
