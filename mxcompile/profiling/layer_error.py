"""The numerical error of every MX-converted linear layer, and block statistics of its operands.

    errors = linear_errors(model, inputs, config, report)  # in-process, eager, fp64 reference

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
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..config import MXConfig
from ..numerics import E8M0_BIAS, E8M0_NAN, ElemFormat, dequantize_along, elem_format, quantize_along, scale_mode_named
from ..numerics.scales import scale_fp32_from_bytes
from ..report import CONVERTED, Report
from .cotangents import DEFAULT_COTANGENT_SEED, differentiable_outputs, make_cotangents

GEMM_KINDS = ("output", "input_grad", "weight_grad")
# measured: SQNR computed; exact: no error at all; zero_reference: the reference GEMM is zero;
# kept: the backend keeps this GEMM in high precision; absent: the compiled graphs have no such
# GEMM; not_captured: no gradient reached the layer; not_divisible: an axis is not a multiple
# of the block size.
GEMM_STATUSES = ("measured", "exact", "zero_reference", "kept", "absent", "not_captured", "not_divisible")


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


def mx_roundtrip(x: Tensor, axis: int, fmt: ElemFormat, scale_mode: str, block_size: int) -> tuple[Tensor, Tensor]:
    """(dequantized values as float64, uint8 scale bytes) of x quantized along `axis`."""
    data, scales = quantize_along(x.float(), axis, fmt, scale_mode_named(scale_mode), block_size)
    return dequantize_along(data, scales, axis, block_size, torch.float64), scales


def block_stats(
    x: Tensor, axis: int, fmt: ElemFormat, scale_mode: str, block_size: int, *, role: str, axis_name: str
) -> BlockStats:
    """Saturation, flush-to-zero and scale range of x quantized along `axis`."""
    x32 = x.float()
    dequantized, scales = mx_roundtrip(x32, axis, fmt, scale_mode, block_size)
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

