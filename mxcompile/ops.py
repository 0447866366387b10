"""torch.library custom ops for MX quantize, dequantize and GEMM, with fake implementations.

The graph passes insert these ops into the joint graph, where they stay visible (to the
partitioner, the report and `mxcompile inspect`). Before Inductor compiles a graph, the backend
decomposes them into their pure-PyTorch definitions (`DECOMPOSITIONS`) so that Inductor fuses
quantization into its generated loops. Scales are uint8 biased exponents here: Inductor's CPU
code generation cannot handle torch.float8_e8m0fnu.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .numerics import (
    E8M0_NAN,
    dequantize_along,
    elem_format,
    inverse_scale_fp32_from_bytes,
    quantize_along,
    scale_bytes_from_amax,
    scale_fp32_from_bytes,
    scale_mode,
    split_blocks,
)
from .numerics.rounding import fake_quantize_blocks, quantize_blocks



def gemm_operand_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the MX GEMM dequantizes its operands to before multiplying (fp32 accumulation).

    bf16 for low-precision outputs: exact for every FP8 value times a power-of-two scale unless
    the product underflows bf16's subnormal range (scale byte < 3 for e4m3, < 10 for e5m2), and
    about 2x faster than fp32 on CPUs with AVX512-BF16. fp32 outputs get fp32 operands, so that
    the output carries no extra bf16 rounding.
    """
    return torch.float32 if out_dtype == torch.float32 else torch.bfloat16


# The eager quantize op rounds slices of about this many elements at a time: its scratch
# (fp32 temporaries of the rounding) stays bounded instead of growing with the tensor. Scratch
# per element of a slice, measured with torch.profiler's allocator events on fp32 inputs
# of 64 to 4M elements: 8.3-9.3 bytes (rounded up below); Inductor fuses the decomposed op.
QUANTIZE_SLICE_ELEMENTS = 2**16
QUANTIZE_SCRATCH_BYTES_PER_ELEMENT = 10


def quantize_scratch_bytes(numel: int) -> int:
    """Scratch bytes the eager quantize op holds for an input of ``numel`` elements."""
    return min(numel, QUANTIZE_SLICE_ELEMENTS) * QUANTIZE_SCRATCH_BYTES_PER_ELEMENT


def _quantize(
    x: torch.Tensor, axis: int, elem: str, mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode(mode), block_size)


def _dequantize(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    return dequantize_along(data, scale, axis % data.ndim, block_size, dtype)


def _mx_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    operand_dtype = gemm_operand_dtype(out_dtype)
    a_hp = dequantize_along(a, a_scale, a.ndim - 1, block_size, operand_dtype)
    b_hp = dequantize_along(b, b_scale, b.ndim - 2, block_size, operand_dtype)
    return torch.matmul(a_hp, b_hp).to(out_dtype)


@torch.library.custom_op("mxcompile::quantize", mutates_args=())
def quantize_op(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize x along axis: (fp8 data of x's shape, uint8 scale bytes).

    The data keeps x's memory layout (that of `torch.empty_like(x)`), so that the transposed
    weight of a linear layer is quantized in its own memory order; the scales are contiguous.
    """
    axis = axis % x.ndim
    out = torch.empty_like(x, dtype=elem_format(elem).dtype)
    scale_shape = list(x.shape)
    scale_shape[axis] //= block_size
    scale = x.new_empty(scale_shape, dtype=torch.uint8)
    # Slices across the blocks (each block lies in one slice), so that the fp32 temporaries of
    # the rounding are bounded by one slice (see QUANTIZE_SLICE_ELEMENTS).
    dim = next((d for d in range(x.ndim) if d != axis and x.shape[d] > 1), None)
    rows = x.shape[dim] if dim is not None else 1
    per_slice = max(1, QUANTIZE_SLICE_ELEMENTS * rows // max(x.numel(), 1))
    for start in range(0, rows, per_slice):
        if dim is None:
            part, out_part, scale_part = x, out, scale
        else:
            length = min(per_slice, rows - start)
            part, out_part, scale_part = (t.narrow(dim, start, length) for t in (x, out, scale))
        data, part_scale = _quantize(part, axis, elem, scale_mode, block_size)
        out_part.copy_(data)
        scale_part.copy_(part_scale)
    return out, scale


@quantize_op.register_fake
def _quantize_fake(x, axis, elem, scale_mode, block_size):
    scale_shape = list(x.shape)
    scale_shape[axis % x.ndim] //= block_size
    return (
        torch.empty_like(x, dtype=elem_format(elem).dtype),
        x.new_empty(scale_shape, dtype=torch.uint8),
    )


@torch.library.custom_op("mxcompile::dequantize", mutates_args=())
def dequantize_op(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """data * 2**(scale - 127) along axis, as dtype."""
    return _dequantize(data, scale, axis, block_size, dtype).contiguous()


@dequantize_op.register_fake
def _dequantize_fake(data, scale, axis, block_size, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.custom_op("mxcompile::mx_mm", mutates_args=())
def mx_mm_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """MX GEMM: a (..., M, K) quantized along K times b (..., K, N) quantized along K."""
    return _mx_mm(a, a_scale, b, b_scale, block_size, out_dtype).contiguous()


@mx_mm_op.register_fake
def _mx_mm_fake(a, a_scale, b, b_scale, block_size, out_dtype):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]), dtype=out_dtype)


@torch.library.custom_op("mxcompile::block_scales", mutates_args=())
def block_scales_op(
    amax: torch.Tensor, elem: str, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block (uint8 scale bytes, fp32 scale, fp32 inverse scale) from fp32 block amax.

    An op of its own in Inductor graphs on purpose: it runs once per block (1/32 of the
    elements), whereas inlined into the fused element loop its int/float bitcasts would run,
    unvectorized, once per element.
    """
    return _compiled_block_scales()(amax, elem, scale_mode)


def _block_scales(amax: torch.Tensor, elem: str, mode: str):
    scale_bytes = scale_bytes_from_amax(amax, elem_format(elem), _scale_mode(mode))
    return (scale_bytes.to(torch.uint8), scale_fp32_from_bytes(scale_bytes),
            inverse_scale_fp32_from_bytes(scale_bytes))


@functools.cache
def _compiled_block_scales() -> Callable:
    """_block_scales compiled once per process: a dozen small eager ops cost more than the
    fused quantization loop they feed (each is a parallel region of its own)."""
    return torch.compile(_block_scales, dynamic=True, fullgraph=True)


@block_scales_op.register_fake
def _block_scales_fake(amax, elem, scale_mode):
    return (torch.empty_like(amax, dtype=torch.uint8), torch.empty_like(amax),
            torch.empty_like(amax))


_scale_mode = scale_mode


def _is_transposed_contiguous(x: torch.Tensor) -> bool:
    """x is the transpose (of its last two dims) of a contiguous tensor, e.g. Wt of a linear."""
    return x.ndim >= 2 and not x.is_contiguous() and x.mT.is_contiguous()


def _swap_last_two(axis: int, ndim: int) -> int:
    return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(axis, axis)


def _blocks_and_scales(x: torch.Tensor, axis: int, elem: str, mode: str, block_size: int):
    """x split into fp32 blocks along `axis` in place (`numerics.split_blocks`) and their
    (bytes, scale, inverse scale) from the per-block op."""
    blocks = split_blocks(x, axis, block_size).to(torch.float32)
    amax = blocks.abs().amax(dim=axis + 1, keepdim=True)
    return blocks, torch.ops.mxcompile.block_scales(amax, elem, mode)


def quantize_for_inductor(
    x: torch.Tensor, axis: int, elem: str, mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxcompile::quantize written for Inductor's CPU code generation: bit-identical outputs
    (tests/test_ops.py), vectorizable element loops (`numerics.rounding`), no transposition
    of a transposed-contiguous input."""
    axis %= x.ndim
    if _is_transposed_contiguous(x):
        data, scales = quantize_for_inductor(x.mT, _swap_last_two(axis, x.ndim), elem, mode, block_size)
        return data.mT, scales.mT.contiguous()
    fmt = elem_format(elem)
    blocks, (scale_bytes, _scale, inverse) = _blocks_and_scales(x, axis, elem, mode, block_size)
    values = quantize_blocks(blocks, inverse, fmt)
    # NaN blocks: the positive NaN, whatever NaN the arithmetic produced (fmt.nan_byte).
    values = torch.where(scale_bytes == E8M0_NAN, float("nan"), values)
    data = values.to(fmt.dtype).reshape(x.shape)
    return data, scale_bytes.squeeze(axis + 1).contiguous()


def fake_quantize_for_inductor(
    x: torch.Tensor, axis: int, elem: str, mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize(quantize(x)) as `dtype` without an fp8 round trip (an MX GEMM operand)."""
    axis %= x.ndim
    if _is_transposed_contiguous(x):
        swapped = _swap_last_two(axis, x.ndim)
        return fake_quantize_for_inductor(x.mT, swapped, elem, mode, block_size, dtype).mT
    fmt = elem_format(elem)
    blocks, (_bytes, scale, inverse) = _blocks_and_scales(x, axis, elem, mode, block_size)
    return fake_quantize_blocks(blocks, scale, inverse, fmt).to(dtype).reshape(x.shape)


def dequantize_for_inductor(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """mxcompile::dequantize for Inductor: `dequantize_along`, run in the memory order of a
    transposed-contiguous input (the saved transposed weight) instead of transposing it."""
    axis %= data.ndim
    if _is_transposed_contiguous(data):
        swapped = _swap_last_two(axis, data.ndim)
        return dequantize_for_inductor(data.mT, scale.mT, swapped, block_size, dtype).mT
    return dequantize_along(data, scale, axis, block_size, dtype)


# Definitions of the ops for Inductor, used to decompose them before Inductor lowers a graph
# (mxcompile::block_scales stays an op: see its docstring).
DECOMPOSITIONS: dict = {
    torch.ops.mxcompile.quantize.default: quantize_for_inductor,
    torch.ops.mxcompile.dequantize.default: lambda *a: dequantize_for_inductor(*a).contiguous(),
    torch.ops.mxcompile.mx_mm.default: lambda *a: _mx_mm(*a).contiguous(),
}
