"""Measurements behind `mxcompile profile`: step time and memory of a compiled training step,
per-operator CPU time, and the numerical error of every MX-converted linear layer.

Nothing here renders anything; the CLI turns these records into tables, plots and HTML.

    errors = linear_errors(model, inputs, config, report)        # in-process, eager, fp64 reference
    step = profile_training_step(model, inputs, backend="mxfp8")  # run it in a fresh process

Per-layer error. Each `nn.Linear` is run eagerly in the model's own precision; its input X,
weight W and output gradient dY are captured, and each of its three GEMMs is recomputed twice
in float64: once from the captured operands (the reference), once from the operands after
MX quantization and dequantization along the axes the backend quantizes them along:

    output       Y  = X Wᵀ  X along K, W along K      (forward_elem, forward_elem)
    input_grad   dX = dY W  dY along N, W along N     (grad_elem,    forward_elem)
    weight_grad  dW = dYᵀ X dY along M, X along M     (grad_elem,    forward_elem)

SQNR = 10·log10(‖ref‖² / ‖ref − mx‖²) dB. The difference is the quantization error alone
(fp64 accumulation on both sides). dY is the gradient of `sum(output · cotangent)` for a seeded
Gaussian cotangent scaled by 1/numel (the scale of a mean loss), the same in every run.

Step memory. `profile_training_step` times its steps with the default allocator settings, then
switches glibc malloc to mmap every buffer of `MALLOC_MMAP_THRESHOLD_BYTES` or more (mallopt;
as MALLOC_MMAP_THRESHOLD_ does at start-up, but without slowing the timed steps down by page
faults), so that freed buffers go back to the OS, releases the freed heap (malloc_trim), resets
the peak resident set (VmHWM, through /proc/self/clear_refs) and runs one more step: VmHWM is
then the peak of that step. Call it in a fresh process, so that nothing else ran there before.
The tensor-memory timeline comes from torch.profiler's allocation events.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .config import MXConfig
from .numerics import E8M0_BIAS, E8M0_NAN, ElemFormat, dequantize_along, elem_format, quantize_along, scale_mode
from .numerics.scales import scale_fp32_from_bytes
from .report import CONVERTED, Report

PROFILE_SCHEMA_VERSION = 1

# For the peak-memory step: buffers of this size or more are mmap-ed, so a free returns them to
# the OS and the peak resident set of one step is not hidden by an earlier step's heap.
MALLOC_MMAP_THRESHOLD_BYTES = 65536
MALLOPT_TRIM_THRESHOLD = -1  # glibc's M_TRIM_THRESHOLD
MALLOPT_MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD

# /proc interface: writing this value to clear_refs resets the peak resident set (VmHWM).
CLEAR_REFS_RESET_PEAK_RSS = "5"
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
KIB = 1024

DEFAULT_COTANGENT_SEED = 0
DEFAULT_TOP_OPERATORS = 15
PROFILER_CPU_DEVICE_TYPE = 0  # "Device Type" of a CPU allocation in torch.profiler's trace
US_PER_MS = 1000.0
# Timed steps spread wider than this (slowest / fastest) suggest a busy machine.
NOISY_STEP_SPREAD = 3.0
# A load average above the CPU count by more than this (the measuring process itself counts for
# about one) means other processes competed for the CPUs.
BUSY_LOAD_MARGIN = 0.5

GEMM_KINDS = ("output", "input_grad", "weight_grad")
# measured: SQNR computed; exact: no error at all; zero_reference: the reference GEMM is zero;
# kept: the backend keeps this GEMM in high precision; absent: the compiled graphs have no such
# GEMM; not_captured: no gradient reached the layer; not_divisible: an axis is not a multiple
# of the block size.
GEMM_STATUSES = ("measured", "exact", "zero_reference", "kept", "absent", "not_captured", "not_divisible")

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


# --------------------------------------------------------------------------------------------
# Block statistics and SQNR
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockStats:
    """How one operand fares under MX quantization along one axis."""

    role: str  # "X", "W" or "dY"
    axis_name: str  # "K", "N" or "M"
    elem: str
    blocks: int
    saturated_block_fraction: float  # blocks with max|x| / scale above the element's max
    flushed_fraction: float  # nonzero elements that quantize to zero
    min_scale_exponent: int | None  # unbiased E8M0 exponents over finite, nonzero blocks
    max_scale_exponent: int | None


def sqnr_db(reference: Tensor, approximation: Tensor) -> float | None:
    """10·log10(‖reference‖² / ‖reference − approximation‖²) in dB; inf when they are equal,
    None when the reference is zero (no signal to compare against)."""
    ref = reference.double()
    signal = float(ref.pow(2).sum())
    noise = float((ref - approximation.double()).pow(2).sum())
    if signal == 0.0:
        return None
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def _block_view(x: Tensor, axis: int, block_size: int) -> Tensor:
    """x with `axis` moved last and split into (..., blocks, block_size)."""
    moved = x.movedim(axis, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)


def mx_roundtrip(x: Tensor, axis: int, fmt: ElemFormat, mode: str, block_size: int) -> tuple[Tensor, Tensor]:
    """(dequantized values as float64, uint8 scale bytes) of x quantized along `axis`."""
    data, scales = quantize_along(x.float(), axis, fmt, scale_mode(mode), block_size)
    return dequantize_along(data, scales, axis, block_size, torch.float64), scales


def block_stats(
    x: Tensor, axis: int, fmt: ElemFormat, mode: str, block_size: int, *, role: str, axis_name: str
) -> BlockStats:
    """Saturation, flush-to-zero and scale range of x quantized along `axis`."""
    x32 = x.float()
    dequantized, scales = mx_roundtrip(x32, axis, fmt, mode, block_size)
    blocks = _block_view(x32, axis, block_size)
    scale_bytes = scales.movedim(axis, -1)
    finite = scale_bytes != E8M0_NAN
    amax = blocks.abs().amax(dim=-1).double()
    scaled_max = amax / scale_fp32_from_bytes(scale_bytes).double()
    saturated = (scaled_max > fmt.max_normal) & finite
    nonzero = x32 != 0
    flushed = nonzero & (dequantized == 0)
    scaled_blocks = finite & (amax > 0)  # an all-zero block's scale carries no information
    exponents = scale_bytes[scaled_blocks].to(torch.int32) - E8M0_BIAS
    n_blocks = scale_bytes.numel()
    n_nonzero = int(nonzero.sum())
    return BlockStats(
        role=role,
        axis_name=axis_name,
        elem=fmt.name,
        blocks=n_blocks,
        saturated_block_fraction=float(saturated.sum()) / n_blocks if n_blocks else 0.0,
        flushed_fraction=float(flushed.sum()) / n_nonzero if n_nonzero else 0.0,
        min_scale_exponent=int(exponents.min()) if exponents.numel() else None,
        max_scale_exponent=int(exponents.max()) if exponents.numel() else None,
    )


# --------------------------------------------------------------------------------------------
# Per-layer GEMM error
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmError:
    """The error of one GEMM of one linear layer under MX quantization."""

    kind: str  # "output", "input_grad" or "weight_grad"
    status: str  # one of GEMM_STATUSES
    sqnr_db: float | None  # set when status is "measured" (inf when "exact")
    note: str
    operands: tuple[BlockStats, ...] = ()


@dataclass(frozen=True)
class LayerError:
    """Per-GEMM errors of one nn.Linear: M tokens, K in_features, N out_features."""

    module: str
    m: int
    k: int
    n: int
    calls: int  # forward calls seen; the first call's operands are used
    gemms: tuple[GemmError, ...]

    def sqnr(self, kind: str) -> float | None:
        return next((g.sqnr_db for g in self.gemms if g.kind == kind), None)


@dataclass
class _Captured:
    x: Tensor
    w: Tensor
    dy: Tensor | None = None
    calls: int = 1


@dataclass(frozen=True)
class _GemmSpec:
    """How to recompute one GEMM of a linear from (X (M,K), W (N,K), dY (M,N))."""

    kind: str
    operands: tuple[tuple[str, str, int, str], ...]  # (role, axis name, axis, "forward"|"grad")
    compute: Callable[[dict[str, Tensor]], Tensor]


_GEMM_SPECS: tuple[_GemmSpec, ...] = (
    _GemmSpec("output", (("X", "K", 1, "forward"), ("W", "K", 1, "forward")),
              lambda t: t["X"] @ t["W"].T),
    _GemmSpec("input_grad", (("dY", "N", 1, "grad"), ("W", "N", 0, "forward")),
              lambda t: t["dY"] @ t["W"]),
    _GemmSpec("weight_grad", (("dY", "M", 0, "grad"), ("X", "M", 0, "forward")),
              lambda t: t["dY"].T @ t["X"]),
)


def make_cotangents(outputs: Sequence[Tensor], seed: int = DEFAULT_COTANGENT_SEED) -> list[Tensor]:
    """One seeded Gaussian cotangent per output, scaled by 1/numel like the gradient of a mean."""
    generator = torch.Generator().manual_seed(seed)
    cotangents = []
    for out in outputs:
        noise = torch.randn(out.shape, generator=generator, dtype=torch.float32)
        cotangents.append((noise / max(out.numel(), 1)).to(device=out.device, dtype=out.dtype))
    return cotangents


def differentiable_outputs(output: Any) -> list[Tensor]:
    """The floating-point tensors of a model's output (any pytree) that carry a gradient."""
    return [
        t for t in pytree.tree_leaves(output)
        if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad
    ]


def _capture_linears(model: nn.Module) -> tuple[dict[str, _Captured], list[Any]]:
    captured: dict[str, _Captured] = {}
    handles = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Linear, args: tuple[Any, ...], output: Tensor) -> None:
            if name in captured:
                captured[name].calls += 1
                return
            record = _Captured(args[0].detach(), module.weight.detach())
            captured[name] = record
            if output.requires_grad:
                output.register_hook(lambda grad: setattr(record, "dy", grad.detach()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(hook_for(name)))
    return captured, handles


@contextlib.contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore buffers and the global RNG after running `model` for measurement."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])


def _run_eager_backward(model: nn.Module, inputs: Sequence[Any], seed: int) -> None:
    """Forward and backward through `model` without touching any parameter's .grad."""
    with torch.enable_grad():
        outputs = differentiable_outputs(model(*inputs))
        params = [p for p in model.parameters() if p.requires_grad]
        if outputs and params:
            torch.autograd.grad(outputs, params, make_cotangents(outputs, seed), allow_unused=True)


def _decision_index(report: Report | None) -> dict[tuple[str, str], Any] | None:
    if report is None:
        return None
    return {(d.module, d.kind): d for d in report.decisions}


def _gemm_error(
    spec: _GemmSpec, tensors: dict[str, Tensor], config: MXConfig, decisions: dict | None, module: str
) -> GemmError:
    if decisions is not None:
        decision = decisions.get((module, spec.kind))
        if decision is None:
            return GemmError(spec.kind, "absent", None, "no such GEMM in the compiled graphs (gradient not needed)")
        if decision.decision != CONVERTED:
            return GemmError(spec.kind, "kept", None, f"kept in high precision: {decision.reason}")
    missing = [role for role, *_ in spec.operands if role not in tensors]
    if missing:
        return GemmError(spec.kind, "not_captured", None,
                         f"operand {missing[0]} was not captured (no gradient reached it)")
    for role, axis_name, axis, _ in spec.operands:
        length = tensors[role].shape[axis]
        if length % config.block_size:
            return GemmError(spec.kind, "not_divisible", None,
                             f"{axis_name}={length} is not a multiple of block_size={config.block_size}")
    quantized: dict[str, Tensor] = {}
    stats = []
    for role, axis_name, axis, family in spec.operands:
        fmt = elem_format(config.grad_elem if family == "grad" else config.forward_elem)
        quantized[role], _ = mx_roundtrip(tensors[role], axis, fmt, config.scale_mode, config.block_size)
        stats.append(block_stats(tensors[role], axis, fmt, config.scale_mode, config.block_size,
                                 role=role, axis_name=axis_name))
    reference = spec.compute({k: v.double() for k, v in tensors.items()})
    value = sqnr_db(reference, spec.compute(quantized))
    if value is None:
        status, note = "zero_reference", "the float64 reference is zero: no signal to compare against"
    elif math.isinf(value):
        status, note = "exact", "the MX emulation equals the float64 reference"
    else:
        status, note = "measured", "MX emulation against float64"
    return GemmError(spec.kind, status, value, note, tuple(stats))


def linear_errors(
    model: nn.Module,
    inputs: Sequence[Any],
    config: MXConfig | None = None,
    report: Report | None = None,
    *,
    seed: int = DEFAULT_COTANGENT_SEED,
) -> list[LayerError]:
    """SQNR and block statistics of the three GEMMs of every nn.Linear in `model` (module order).

    With `report` (from `mxcompile.explain` on the same model and inputs), a GEMM the backend
    kept in high precision, or never built, is listed with the reason instead of an SQNR.
    Parameters' .grad, buffers and the global random state are left as they were.
    """
    config = config if config is not None else MXConfig()
    captured, handles = _capture_linears(model)
    try:
        with _preserved_state(model):
            _run_eager_backward(model, inputs, seed)
    finally:
        for handle in handles:
            handle.remove()
    decisions = _decision_index(report)
    layers = []
    for module, record in captured.items():
        x = record.x.reshape(-1, record.x.shape[-1])
        tensors = {"X": x, "W": record.w}
        if record.dy is not None:
            tensors["dY"] = record.dy.reshape(-1, record.dy.shape[-1])
        gemms = tuple(_gemm_error(spec, tensors, config, decisions, module) for spec in _GEMM_SPECS)
        layers.append(LayerError(module, x.shape[0], x.shape[1], record.w.shape[0], record.calls, gemms))
    return layers


# --------------------------------------------------------------------------------------------
# Step time, memory and operators of a compiled training step
# --------------------------------------------------------------------------------------------


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


def _proc_status_bytes(key: str) -> int | None:
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def _machine_load() -> tuple[float | None, int | None]:
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


def _measure_peak_rss(step: Callable[[], None]) -> tuple[int | None, int | None, str | None]:
    """(VmHWM over one step, VmRSS before it, why not measured). Changes malloc's settings."""
    if not release_memory_on_free():
        return None, None, "peak resident memory not measured: malloc is not glibc's (no mallopt)"
    step()  # the step's large buffers now come from mmap; run it once so that nothing is left over
    release_memory_on_free()
    if not reset_peak_rss():
        return None, None, "peak resident memory not measured: /proc/self/clear_refs cannot be written here"
    rss_before = _proc_status_bytes("VmRSS")
    step()
    return _proc_status_bytes("VmHWM"), rss_before, None


def compile_for_backend(model: nn.Module, backend: str, config: MXConfig | None = None) -> Callable[..., Any]:
    """torch.compile(model) with Inductor ("inductor") or the mxfp8 backend ("mxfp8", `config`)."""
    if backend == "mxfp8":
        from .backend import compile as mx_compile

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


def _profile_operators(
    step: Callable[[], None], top: int
) -> tuple[list[OperatorTime], dict[str, float], list[tuple[float, int]]]:
    """One step under torch.profiler: (top operators, self time per class, memory timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory(prefix="mxcompile-trace-") as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        timeline = memory_timeline(trace_path)
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
    on_step: Callable[[str, int, int], None] | None = None,
) -> StepProfile:
    """Compile `model` with `backend` and measure its training step (forward, backward with a
    seeded cotangent, no optimizer): compile time, `steps` timed steps, the peak resident set
    of one step, and one profiled step. `on_step(phase, done, total)` reports progress.

    The peak is only meaningful in a fresh process; it changes malloc's settings (see above)."""
    if steps <= 0 or warmup <= 0:
        raise ValueError(f"steps={steps} and warmup={warmup} must both be positive")
    notify = on_step or (lambda phase, done, total: None)
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # Inductor's C++ kernels by name in the profile
    step = _make_step(model, compile_for_backend(model, backend, config), inputs, autocast_bf16, seed)
    start = time.perf_counter()
    step()  # compiles
    compile_s = time.perf_counter() - start
    notify("warmup", 1, warmup)
    for done in range(2, warmup + 1):
        step()
        notify("warmup", done, warmup)
    times = []
    for done in range(1, steps + 1):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
        notify("steps", done, steps)
    load_average, cpu_count = _machine_load()
    operators, classes, timeline = _profile_operators(step, top_operators)
    notify("profile", 1, 1)
    peak, rss_before, problem = _measure_peak_rss(step)  # last: it changes malloc's settings
    notes = [problem] if problem else []
    notify("memory", 1, 1)
    return StepProfile(backend, autocast_bf16, compile_s, times, peak, rss_before, timeline,
                       operators, classes, notes, load_average, cpu_count)



# --------------------------------------------------------------------------------------------
# The profile document (report.json of `mxcompile profile`)
# --------------------------------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare_steps(reference: StepProfile, candidate: StepProfile) -> dict[str, float | None]:
    """candidate / reference for step time and the memory measures (None where unmeasured)."""
    return {
        "median_step_ratio": _ratio(candidate.median_step_s, reference.median_step_s),
        "min_step_ratio": _ratio(candidate.min_step_s, reference.min_step_s),
        "peak_rss_ratio": _ratio(candidate.peak_rss_bytes, reference.peak_rss_bytes),
        "peak_step_increase_ratio": _ratio(candidate.peak_step_increase_bytes, reference.peak_step_increase_bytes),
        "peak_tensor_ratio": _ratio(candidate.peak_tensor_bytes, reference.peak_tensor_bytes),
    }


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (strict JSON has no inf or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def profile_document(
    *,
    target: str,
    steps: int,
    warmup: int,
    autocast_bf16: bool,
    config: MXConfig,
    report: Report,
    layers: Sequence[LayerError],
    profiles: dict[str, StepProfile],
    reference: str,
    candidate: str,
    plots: dict[str, str],
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The JSON document of a profile run (schema: mxcompile/cli/SCHEMA.md, version
    `PROFILE_SCHEMA_VERSION`)."""
    rewrite = report.to_dict()
    rewrite.pop("graphs")
    return json_safe({
        "schema_version": PROFILE_SCHEMA_VERSION,
        "target": target,
        "steps": steps,
        "warmup": warmup,
        "autocast_bf16": autocast_bf16,
        "torch_version": torch.__version__,
        "config": config.to_dict(),
        "variants": {name: profile.to_dict() for name, profile in profiles.items()},
        "comparison": {"reference": reference, "candidate": candidate,
                       **compare_steps(profiles[reference], profiles[candidate])},
        "layers": [asdict(layer) for layer in layers],
        "rewrite": rewrite,
        "plots": dict(plots),
        "notes": list(notes),
    })
