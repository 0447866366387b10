"""An eager MX emulation of a whole training step, independent of mxcompile's passes: the oracle
that compiled-MX gradients are compared with (issue 35).

`MXOracle` is a `TorchDispatchMode`. Every GEMM that eager autograd dispatches (forward and
backward: `mm`, `addmm`, `bmm`, `baddbmm`, `_grouped_mm`) runs on operands rounded to MX along
that GEMM's own contraction axis, with the numerics core (`mxcompile.numerics`). Nothing here
looks at an FX graph, so a pass that converts the wrong GEMM, quantizes along the wrong axis, or
a lowering step that feeds a GEMM the wrong tensor, gives gradients that differ from these.

The rules are the recipe's and the backend's documented ones (README "Numerics", passes/mx_gemm.py):
- each operand quantized along its contraction axis, blocks of `block_size`, E4M3, `rceil`;
- a contraction length that is not a multiple of the block is zero-padded (the last partial
  block quantized on its own) and the product taken over the padded length, as an MX GEMM
  takes whole blocks, except where padding at least doubles the work (K <= 16 for blocks of
  32): those GEMMs stay in high precision;
- operands dequantized exactly to fp32 for fp32 outputs, to bf16 for lower-precision outputs
  (on this CPU, which has native bf16 GEMMs), then multiplied with fp32 accumulation and cast
  to the output dtype;
- addmm / baddbmm: the product first, then `beta * bias` added in fp32 (MX GEMMs take no bias);
- GEMMs of integer or fp8 operands stay as they are.

Non-GEMM ops run as eager torch runs them, or, given `decompositions` (torch's own table, e.g.
`torch._inductor.decomposition.select_decomp_table()`, the one AOTAutograd applies for the
backend), through those decompositions: then both sides compute the same fp32 operations, and a
compiled graph run op by op must give the oracle's gradients bit for bit. Without them, an fp32
difference of one unit in the last place now and then moves a GEMM operand element across an FP8
rounding boundary (a softmax backward's dS element at a round-half-even tie, seen here), which
changes the gradients it feeds by up to a few percent.

`scaled_dot_product_attention` is one fused op below autograd (or, for strided inputs, a
composite whose GEMMs only the dispatch level sees), so the oracle takes it above autograd,
with a `TorchFunctionMode`, in one of two forms (`SdpaForm`): kept in high precision as a whole,
forward and backward (what `attention="off"` promises), or written out as the eager form
`softmax(Q Kᵀ · scale + mask) V` in fp32, whose two GEMMs (and their four backward GEMMs) the
dispatch mode then runs in MX.
"""

from __future__ import annotations

import contextlib
import enum
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mxcompile.numerics import E4M3, ScaleMode, fake_quantize_along

aten = torch.ops.aten

BLOCK = 32
MX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Padding K to a multiple of the block that at least doubles the work keeps the GEMM (K <= 16).
KEEP_PADDING_FACTOR = 2


def _padded_length(length: int, block: int) -> int:
    return -(-length // block) * block


def mx_round(x: torch.Tensor, axis: int, dtype: torch.dtype, block: int = BLOCK,
             keep_padding: bool = False) -> torch.Tensor:
    """x rounded to MX along `axis` (zero-padded to whole blocks), as `dtype`; the padding is
    cut back off unless `keep_padding`."""
    axis %= x.ndim
    length = x.shape[axis]
    pad = _padded_length(length, block) - length
    if pad:
        widths = [0, 0] * (x.ndim - 1 - axis) + [0, pad]
        x = torch.nn.functional.pad(x, widths)
    rounded = fake_quantize_along(x.float(), axis, E4M3, ScaleMode.RCEIL, block)
    return (rounded if keep_padding else rounded.narrow(axis, 0, length)).to(dtype)


def _operand_dtype(out_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if out_dtype == torch.float32 else torch.bfloat16


def _converts(lhs: torch.Tensor, rhs: torch.Tensor, block: int) -> bool:
    if lhs.dtype not in MX_DTYPES or rhs.dtype not in MX_DTYPES:
        return False
    length = lhs.shape[-1]
    return _padded_length(length, block) < KEEP_PADDING_FACTOR * length


class SdpaForm(enum.Enum):
    """How the oracle runs scaled_dot_product_attention."""

    HIGH_PRECISION = "high_precision"  # as attention="off": every attention GEMM in high precision
    EAGER_MX = "eager_mx"  # the eager softmax form, its GEMMs in MX


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention written out: (Q Kᵀ) · scale, the mask, softmax in fp32, · V."""
    if dropout_p:
        raise ValueError("the oracle's eager attention takes dropout_p=0 only")
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * scale
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1).to(q.dtype) @ v


class _HighPrecisionAttention(torch.autograd.Function):
    """SDPA with the oracle paused in its forward and in its backward (recomputed)."""

    @staticmethod
    def _run(oracle: "MXOracle", kwargs: dict, tensors) -> tuple[list[torch.Tensor], torch.Tensor]:
        """SDPA on inputs that require gradients, as in training: SDPA picks its kernel by that
        (under no_grad, CPU strided inputs take the flash kernel instead of the math path)."""
        inputs = [t.detach().requires_grad_(True) for t in tensors]
        with oracle.paused(), torch.enable_grad():
            return inputs, F.scaled_dot_product_attention(*inputs, **kwargs)

    @staticmethod
    def forward(ctx, oracle: "MXOracle", kwargs: dict, q, k, v):
        ctx.oracle, ctx.kwargs = oracle, kwargs
        ctx.save_for_backward(q, k, v)
        return _HighPrecisionAttention._run(oracle, kwargs, (q, k, v))[1].detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = _HighPrecisionAttention._run(ctx.oracle, ctx.kwargs, ctx.saved_tensors)
        with ctx.oracle.paused():
            return (None, None, *torch.autograd.grad(out, inputs, grad))


class _AttentionForm(TorchFunctionMode):
    def __init__(self, oracle: "MXOracle"):
        super().__init__()
        self.oracle = oracle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.oracle.is_paused:
            return func(*args, **kwargs)
        if self.oracle.sdpa is SdpaForm.EAGER_MX:
            return eager_attention(*args, **kwargs)
        q, k, v, *rest = args
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        return _HighPrecisionAttention.apply(self.oracle, {**dict(zip(names, rest)), **kwargs}, q, k, v)


class MXOracle(TorchDispatchMode):
    """Runs every eligible GEMM of the code under it in MX (see the module docstring), and
    scaled_dot_product_attention in the form `sdpa` says.

    `converted` and `kept` count the GEMMs of each kind, so that a test can check that the
    oracle saw the GEMMs it was meant to."""

    def __init__(self, block: int = BLOCK, sdpa: SdpaForm = SdpaForm.HIGH_PRECISION,
                 decompositions: dict | None = None):
        super().__init__()
        self.block, self.sdpa = block, sdpa
        self.decompositions = decompositions or {}
        self.converted = 0
        self.kept = 0
        self.is_paused = False
        self._attention = _AttentionForm(self)

    def __enter__(self):
        self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """GEMMs under it run as dispatched (high precision)."""
        before, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = before

    def _product(self, lhs: torch.Tensor, rhs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The MX GEMM over whole blocks: the operands' zero padding along K stays in the product.
        The exact sum is the same either way, but an fp32 GEMM kernel's order of summation can
        depend on K: oneMKL's AVX2 sgemm (the one it runs on AMD CPUs) gives other bits for K=260
        than for the same operands padded to K=288 (docs/correctness.md)."""
        dtype = _operand_dtype(out_dtype)
        lhs = mx_round(lhs, -1, dtype, self.block, keep_padding=True)
        rhs = mx_round(rhs, -2, dtype, self.block, keep_padding=True)
        return torch.matmul(lhs, rhs).to(out_dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.is_paused:
            return self._high_precision(func, args, kwargs)
        if func in (aten.mm.default, aten.bmm.default):
            lhs, rhs = args
            if _converts(lhs, rhs, self.block):
                self.converted += 1
                return self._product(lhs, rhs, lhs.dtype)
        elif func in (aten.addmm.default, aten.baddbmm.default):
            bias, lhs, rhs = args
            if _converts(lhs, rhs, self.block):
                self.converted += 1
                out_dtype = torch.result_type(lhs, rhs)
                result = self._product(lhs, rhs, out_dtype).float()
                alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
                if alpha != 1:
                    result = result * alpha
                result = result + (bias * beta if beta != 1 else bias)
                return result.to(out_dtype)
        elif func is aten._grouped_mm.default:
            return self._grouped(func, args, kwargs)
        if func in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
            self.kept += 1
        return self._high_precision(func, args, kwargs)

    def _high_precision(self, func, args, kwargs):
        """func as eager torch runs it, through its decomposition where one was given."""
        if func in self.decompositions:
            decomposed = self.decompositions[func](*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        return func(*args, **kwargs)

    def _grouped(self, func, args, kwargs):
        """aten._grouped_mm: each group's operands rounded along their contraction axis, the
        groups' spans of a ragged contraction (2-D x 2-D with offsets) padded apiece, each
        group's product over its padded span (as `_product`)."""
        lhs, rhs = args[0], args[1]
        offsets = args[2] if len(args) > 2 else kwargs.get("offs")
        if lhs.dtype not in MX_DTYPES or rhs.dtype not in MX_DTYPES:
            self.kept += 1
            return func(*args, **kwargs)
        self.converted += 1
        dtype = _operand_dtype(lhs.dtype)
        if lhs.ndim == 2 and rhs.ndim == 2:  # ragged K: groups of the contraction axis
            starts = [0, *offsets.tolist()[:-1]]
            outputs = [mx_round(lhs[:, s:e], -1, dtype, self.block, keep_padding=True)
                       @ mx_round(rhs[s:e], -2, dtype, self.block, keep_padding=True)
                       for s, e in zip(starts, offsets.tolist())]
            return torch.stack(outputs).to(lhs.dtype)
        rounded_lhs = mx_round(lhs, -1, dtype, self.block)
        rounded_rhs = mx_round(rhs, -2, dtype, self.block)
        return func(rounded_lhs, rounded_rhs, *args[2:], **kwargs).to(lhs.dtype)


def relative_distance(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """||candidate - reference|| / ||reference|| in fp64 (0 for two zero tensors)."""
    candidate, reference = candidate.detach().double(), reference.detach().double()
    norm = reference.norm()
    difference = (candidate - reference).norm()
    return float(difference / norm) if norm > 0 else float(difference)


def gradient_distances(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter name: the relative distance of model's gradient from reference[name]."""
    return {name: relative_distance(p.grad, reference[name])
            for name, p in model.named_parameters() if name in reference and p.grad is not None}
