"""The MX quantize ops: `mxcompile::quantize`, `mxcompile::dequantize`, `mxcompile::fake_quantize`.

    mxcompile::quantize(x, axis, elem, scale_mode, block_size) -> (fp8 data, uint8 scale bytes)
    mxcompile::dequantize(data, scale, axis, block_size, dtype) -> dtype tensor
    mxcompile::fake_quantize(x, axis, elem, scale_mode, block_size, dtype) -> dtype tensor

Each op has its torch reference (the numerics core, `mxcompile.numerics`) and its fake; quantize
has a CUDA kernel registered with `register_kernel("cuda")`: the Triton quantize kernel of
`mxcompile.triton_templates` where it supports the call, the torch reference otherwise. Eager
calls and Inductor's fallback kernels reach that CUDA kernel alike, so the lowering keeps the
op opaque on CUDA. Their CPU kernels (`ops.cpu_kernels`) run the native kernels
(`ops.native`), and where those cannot run the Inductor forms defined here
(`quantize_for_inductor`'s arithmetic, `numerics.fake_quantize_along` and `dequantize_along`
with their block scales stored once per block), compiled once with dynamic sizes; the CPU
lowering keeps the ops opaque too. On CUDA the forms with fp8 casts (`quantize_with_casts`,
`fake_quantize_with_casts`) are decomposed into the graph for Inductor to fuse.
`fake_quantize` is inserted by the lowering only (`lowering.lower_mx_gemms`), after autograd.
Scales are uint8 biased exponents here: Inductor's CPU code generation cannot view tensors as
torch.float8_e8m0fnu (the public API converts at its edge, `numerics.e8m0_from_bytes`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..numerics import (
    blocks_and_scales,
    dequantize_along,
    elem_format,
    fake_quantize_along,
    quantize_along,
    scale_bytes_from_amax,
    scales_shape,
)
from ..numerics import scale_mode_named  # the ops' argument name shadows it
from ..numerics.formats import block_format as block_format_named  # the ops' argument name shadows it
from ..numerics.fp4_operand import fp4_block_values_from_bytes, fp4_operand, quantize_fp4_operand
from ..numerics.scales import identity

_log = logging.getLogger(__name__)

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
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode_named(scale_mode), block_size)


@torch.library.custom_op("mxcompile::quantize", mutates_args=())
def quantize_op(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize x along axis: (fp8 data of x's shape, uint8 scale bytes).

    The data keeps x's memory layout (that of `torch.empty_like(x)`), so that the transposed
    weight of a linear layer is quantized in its own memory order; the scales are contiguous.
    """
    return quantize_reference(x, axis, elem, scale_mode, block_size)


def quantize_reference(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation of `mxcompile::quantize` (the numerics core, in slices)."""
    axis = axis % x.ndim
    out, scale = _quantize_fake(x, axis, elem, scale_mode, block_size)
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
    return (
        torch.empty_like(x, dtype=elem_format(elem).dtype),
        x.new_empty(scales_shape(x.shape, axis % x.ndim, block_size), dtype=torch.uint8),
    )


def triton_quantize_unsupported(x: torch.Tensor, elem: str, block_size: int) -> str | None:
    """Why the Triton quantize kernel cannot run this call of `mxcompile::quantize`, or None."""
    from ..triton_templates import triton_available

    ok, why = triton_available(x.device, elem=elem, block_size=block_size)
    return None if ok else why


def in_layout_of(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t (of x's shape) in the layout of `torch.empty_like(x, dtype=t.dtype)`, the layout the
    ops' fake implementations give: t itself where it already has it (nothing allocated), else
    a copy."""
    if t.stride() == x.stride() or t.stride() == torch.empty_like(x, dtype=t.dtype, device="meta").stride():
        return t
    return torch.empty_like(x, dtype=t.dtype).copy_(t)


def quantize_with_triton(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize x along axis with the Triton kernel (contiguous outputs): the last axis and
    axis 0 of a 2-D tensor directly, any other axis moved last (a copy) and back."""
    from ..triton_templates import _interpreting
    from ..triton_templates.quantize import quantize_launch

    fmt, scale_mode = elem_format(elem), scale_mode_named(scale_mode)
    axis = axis % x.ndim
    if axis == x.ndim - 1 or (x.ndim == 2 and axis == 0):
        rowwise = axis == x.ndim - 1
        x2 = x.reshape(-1, x.shape[-1]) if rowwise else x
        row_d, row_s, col_d, col_s = quantize_launch(
            x2, rowwise=rowwise, colwise=not rowwise, fmt=fmt, scale_mode=scale_mode,
            block_size=block_size, interpret=_interpreting(),
        )  # fmt: skip
        if rowwise:
            scale_shape = (*x.shape[:-1], x.shape[-1] // block_size)
            return row_d.reshape(x.shape), row_s.reshape(scale_shape)
        return col_d, col_s
    moved = x.movedim(axis, -1).contiguous()
    row_d, row_s, _, _ = quantize_launch(
        moved.reshape(-1, moved.shape[-1]), rowwise=True, colwise=False, fmt=fmt, scale_mode=scale_mode,
        block_size=block_size, interpret=_interpreting(),
    )  # fmt: skip
    data = row_d.reshape(moved.shape).movedim(-1, axis).contiguous()
    scale = row_s.reshape(*moved.shape[:-1], -1).movedim(-1, axis).contiguous()
    return data, scale


@quantize_op.register_kernel("cuda")
def quantize_cuda(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxcompile::quantize` on CUDA: the Triton kernel when `triton_quantize_unsupported`
    says it can run, the torch reference otherwise (logged at DEBUG level with the reason). The
    outputs have the fake implementation's layouts. Also callable on CPU tensors under
    TRITON_INTERPRET=1 (the tests)."""
    reason = triton_quantize_unsupported(x, elem, block_size)
    if reason is not None:
        _log.debug("mxcompile::quantize: torch reference, not the Triton kernel: %s", reason)
        return quantize_reference(x, axis, elem, scale_mode, block_size)
    data, scale = quantize_with_triton(x, axis, elem, scale_mode, block_size)
    return in_layout_of(x, data), scale


@torch.library.custom_op("mxcompile::dequantize", mutates_args=())
def dequantize_op(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """data * 2**(scale - 127) along axis, as dtype (scale: uint8 bytes); contiguous."""
    return dequantize_reference(data, scale, axis, block_size, dtype)


def dequantize_reference(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The torch implementation of `mxcompile::dequantize` (the numerics core)."""
    return dequantize_along(data, scale, axis % data.ndim, block_size, dtype).contiguous()


@dequantize_op.register_fake
def _dequantize_fake(data, scale, axis, block_size, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.custom_op("mxcompile::fake_quantize", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def fake_quantize_op(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize(quantize(x)) as `dtype`, without the fp8 round trip: the values an MX GEMM
    multiplies. The result has x's memory layout (that of `torch.empty_like(x, dtype=dtype)`),
    so that the transposed weight of a linear layer is rounded in its own memory order; the
    tag makes Inductor pass x in the strides the graph was traced with."""
    return fake_quantize_reference(x, axis, elem, scale_mode, block_size, dtype)


def fake_quantize_reference(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The torch implementation of `mxcompile::fake_quantize` (the numerics core)."""
    rounded = fake_quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode_named(scale_mode), block_size)
    return in_layout_of(x, rounded.to(dtype))


@fake_quantize_op.register_fake
def _fake_quantize_fake(x, axis, elem, scale_mode, block_size, dtype):
    return torch.empty_like(x, dtype=dtype)


def _is_transposed_contiguous(x: torch.Tensor) -> bool:
    """x is the transpose (of its last two dims) of a contiguous tensor, e.g. Wt of a linear."""
    return x.ndim >= 2 and not x.is_contiguous() and x.mT.is_contiguous()


def _swap_last_two(axis: int, ndim: int) -> int:
    return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(axis, axis)


def inductor_realized(t: torch.Tensor) -> torch.Tensor:
    """t, stored in a buffer of its own under Inductor (eagerly: t itself, or a copy in t's own
    strides). Inductor inlines an elementwise node into each of its users and re-expands it
    at every use; a per-block value used by every element of its block is cheaper stored once
    per block, and the expression trees, and with them Inductor's code generation time, stay
    small (see `numerics.scale_fp32_from_amax`'s `materialize`). The prim's lowering requires
    the given strides, which realizes the node."""
    from torch._inductor import inductor_prims  # noqa: F401  (registers torch.ops.prims.inductor_*)

    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def _blocks_and_scales(x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int):
    """x split into fp32 blocks along `axis` in place (`numerics.split_blocks`), their scale
    bytes (the numerics core's bitcast form: evaluated once per block, where the bytes are
    stored), and their fp32 scales and inverse scales in the bitcast-free form
    (`numerics.blocks_and_scales`), which Inductor vectorizes; the scales are computed once
    per block into a buffer that the element loop reads."""
    fmt, scale_mode = elem_format(elem), scale_mode_named(scale_mode)
    blocks, amax, scale, inverse = blocks_and_scales(x, axis, fmt, scale_mode, block_size,
                                                     materialize=inductor_realized)
    return blocks, scale_bytes_from_amax(amax, fmt, scale_mode), scale, inverse


def _in_memory_order(function: Callable[..., Any], x: torch.Tensor, axis: int, *args: Any) -> Any:
    """function(x, axis, *args), run on the memory order of a transposed-contiguous x (the
    saved transposed weight) instead of transposing it: its tensor outputs are transposed back
    (views); None (the function declined) passes through."""
    axis %= x.ndim
    if not _is_transposed_contiguous(x):
        return function(x, axis, *args)
    out = function(x.mT, _swap_last_two(axis, x.ndim), *args)
    if out is None:
        return None
    return tuple(t.mT for t in out) if isinstance(out, tuple) else out.mT


def _quantize_arithmetic(x: torch.Tensor, axis: int, elem: str, scale_mode: str,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = elem_format(elem)
    blocks, scale_bytes, scale, inverse = _blocks_and_scales(x, axis, elem, scale_mode, block_size)
    # Clamped, then rounded by the fp8 cast itself (round to nearest even, as the reference
    # does): Inductor's CPU code vectorizes fp32 -> fp8 with AVX512 (ATen's vec512_float8), and
    # rounding first in fp32 (`numerics.rounding`, which the fake-quantize CPU kernel needs,
    # having no cast) would only repeat the cast's work (4096x4096 bf16, interleaved A/B in one
    # process: 8.6 -> 6.3 ms along the last axis, 8.9 -> 7.0 ms along the first).
    values = (blocks * inverse).clamp(-fmt.max_normal, fmt.max_normal)
    # NaN blocks (scale byte 0xFF, scale NaN): the positive NaN, whatever NaN the arithmetic
    # produced (fmt.nan_byte). `scale != scale`, not `isnan`: Inductor's CPU code runs isnan
    # element by element, a comparison vectorizes (blocks along the first axis load a vector of
    # scales: 4096x4096 bf16 quantized along it 16.0 -> 8.0 ms).
    values = torch.where(scale != scale, float("nan"), values)
    return values.to(fmt.dtype).reshape(x.shape), scale_bytes.to(torch.uint8).squeeze(axis + 1)


def quantize_for_inductor(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxcompile::quantize written for Inductor's CPU code generation: bit-identical outputs
    (tests/ops/test_quantize.py), vectorizable loops (block scales in the bitcast-free form of
    `numerics.scale_fp32_from_amax`, elements clamped and cast), no transposition of a
    transposed-contiguous input."""
    data, scales = _in_memory_order(_quantize_arithmetic, x, axis, elem, scale_mode, block_size)
    return data, scales.contiguous()


def quantize_with_casts(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxcompile::quantize for Inductor's CUDA (Triton) code generation: the numerics core's own
    definition (`quantize_along`: scale bytes by bit manipulation, elements by the fp8 cast),
    which Triton runs natively, and no transposition of a transposed-contiguous input.

    Not the CPU form's fp32-arithmetic rounding (`numerics.rounding`): its Veltkamp splits
    (c = v*s; c - (c - v)) are exact only if every product is rounded before the subtraction,
    and Triton contracts a multiply and an add into an FMA by default (Inductor compiles its
    kernels with `enable_fp_fusion`), which skips that rounding."""
    data, scales = _in_memory_order(_quantize, x, axis, elem, scale_mode, block_size)
    return data, scales.contiguous()


def _fake_quantize_casts(x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int,
                         dtype: torch.dtype) -> torch.Tensor:
    data, scale_bytes = _quantize(x, axis, elem, scale_mode, block_size)
    return dequantize_along(data, scale_bytes, axis, block_size, dtype)


def fake_quantize_with_casts(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize(quantize(x)) as `dtype`, in the CUDA form of `quantize_with_casts`: fused by
    Inductor into one kernel with no fp8 tensor stored."""
    return _in_memory_order(_fake_quantize_casts, x, axis, elem, scale_mode, block_size, dtype)


def dequantize_for_inductor(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """mxcompile::dequantize for Inductor: `dequantize_along`, run in the memory order of a
    transposed-contiguous input (the saved transposed weight) instead of transposing it. On
    CPU its block scales are stored once per block (`inductor_realized`): computed per element, their
    int-to-float bitcast ran as an element loop (a 2048x2048 dequantize 3.2x slower); Triton
    bitcasts in registers, so CUDA graphs keep the scales inline."""
    axis %= data.ndim
    if _is_transposed_contiguous(data):
        swapped = _swap_last_two(axis, data.ndim)
        return dequantize_for_inductor(data.mT, scale.mT, swapped, block_size, dtype).mT
    materialize = inductor_realized if data.device.type == "cpu" else identity
    return dequantize_along(data, scale, axis, block_size, dtype, materialize=materialize)


# ---------------------------------------------------------------------------------------------
# FP4 (MXFP4, NVFP4): the same three ops, with the block format row as a parameter and the FP4
# recipes' operand options (`numerics.fp4_operand`): 16x16 weight blocks, stochastic rounding
# with draws seeded from the operand and `seed`, the random Hadamard transform with the signs of
# `rht_seed` (None: none). Scales travel as uint8 bytes (E8M0 or E4M3 bits), the NVFP4 tensor
# scale S_dec as a 0-d fp32 tensor (1.0 for MXFP4), which the FP4 GEMM applies to its output.
# No Triton or native quantize kernel yet: the torch references run on every device, and the lowerings
# keep the ops opaque (no Inductor decomposition).


def _fp4_options(block_format: str, scale_mode: str, block_2d: bool, stochastic: bool, seed: int,
                 rht_seed: int | None) -> dict[str, Any]:
    return dict(scale_mode=scale_mode_named(scale_mode), block_2d=block_2d, stochastic=stochastic, seed=seed,
                rht_seed=rht_seed)


@torch.library.custom_op("mxcompile::quantize_fp4", mutates_args=())
def quantize_fp4_op(
    x: torch.Tensor, axis: int, block_format: str, scale_mode: str, block_2d: bool, stochastic: bool, seed: int,
    rht_seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP4-quantize x along axis (`numerics.fp4_operand.quantize_fp4_operand`): (uint8 data, two
    E2M1 codes per byte packed along axis; uint8 scale bytes; 0-d fp32 tensor scale S_dec)."""
    options = _fp4_options(block_format, scale_mode, block_2d, stochastic, seed, rht_seed)
    return tuple(t.contiguous() for t in quantize_fp4_operand(  # type: ignore[return-value]
        x, axis % x.ndim, block_format_named(block_format), **options))


@quantize_fp4_op.register_fake
def _quantize_fp4_fake(x, axis, block_format, scale_mode, block_2d, stochastic, seed, rht_seed):
    axis %= x.ndim
    fmt = block_format_named(block_format)
    packed = list(x.shape)
    packed[axis] //= fmt.elem.elements_per_byte
    return (x.new_empty(packed, dtype=torch.uint8),
            x.new_empty(scales_shape(x.shape, axis, fmt.block_size), dtype=torch.uint8),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("mxcompile::dequantize_fp4", mutates_args=())
def dequantize_fp4_op(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_format: str, dtype: torch.dtype
) -> torch.Tensor:
    """The block values q * s of `quantize_fp4`'s data and scale bytes, as dtype (the tensor
    scale is not applied: the FP4 GEMM applies it to its output); contiguous."""
    fmt = block_format_named(block_format)
    return fp4_block_values_from_bytes(data, scale, axis % data.ndim, fmt, dtype).contiguous()


@dequantize_fp4_op.register_fake
def _dequantize_fp4_fake(data, scale, axis, block_format, dtype):
    shape = list(data.shape)
    shape[axis % data.ndim] *= block_format_named(block_format).elem.elements_per_byte
    return data.new_empty(shape, dtype=dtype)


@torch.library.custom_op("mxcompile::fake_quantize_fp4", mutates_args=())
def fake_quantize_fp4_op(
    x: torch.Tensor, axis: int, block_format: str, scale_mode: str, block_2d: bool, stochastic: bool, seed: int,
    rht_seed: int | None, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dequantize_fp4(quantize_fp4(x)) without the packed round trip, bit for bit: (block values
    q * s as dtype, contiguous; the 0-d fp32 tensor scale S_dec)."""
    options = _fp4_options(block_format, scale_mode, block_2d, stochastic, seed, rht_seed)
    values, tensor_decode = fp4_operand(x, axis % x.ndim, block_format_named(block_format), **options)
    return values.to(dtype).contiguous(), tensor_decode


@fake_quantize_fp4_op.register_fake
def _fake_quantize_fp4_fake(x, axis, block_format, scale_mode, block_2d, stochastic, seed, rht_seed, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


# The overloads the graph passes insert.
QUANTIZE = torch.ops.mxcompile.quantize.default
DEQUANTIZE = torch.ops.mxcompile.dequantize.default
FAKE_QUANTIZE = torch.ops.mxcompile.fake_quantize.default
QUANTIZE_FP4 = torch.ops.mxcompile.quantize_fp4.default
DEQUANTIZE_FP4 = torch.ops.mxcompile.dequantize_fp4.default
FAKE_QUANTIZE_FP4 = torch.ops.mxcompile.fake_quantize_fp4.default

# The ops' definitions for Inductor, used to decompose them before Inductor lowers a graph.
DECOMPOSITIONS: dict = {
    QUANTIZE: quantize_for_inductor,
    DEQUANTIZE: lambda *a: dequantize_for_inductor(*a).contiguous(),
}
