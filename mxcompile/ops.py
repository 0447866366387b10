"""torch.library custom ops for MX quantize, dequantize and GEMM, with fake implementations.

The graph passes insert these ops into the joint graph, where they stay visible (to the
partitioner, the report and `mxcompile inspect`). Before Inductor compiles a graph, the backend
decomposes them into their pure-PyTorch definitions (`DECOMPOSITIONS`) so that Inductor fuses
quantization into its generated loops. Scales are uint8 biased exponents here: Inductor's CPU
code generation cannot handle torch.float8_e8m0fnu.
"""

from __future__ import annotations

from typing import Callable

import torch

from .numerics import (
    dequantize_along,
    elem_format,
    quantize_along,
    scale_mode,
)



def gemm_operand_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the MX GEMM dequantizes its operands to before multiplying (fp32 accumulation).

    bf16 for low-precision outputs: exact for every FP8 value times a power-of-two scale unless
    the product underflows bf16's subnormal range (scale byte < 3 for e4m3, < 10 for e5m2), and
    about 2x faster than fp32 on CPUs with AVX512-BF16. fp32 outputs get fp32 operands, so that
    the output carries no extra bf16 rounding.
    """
    return torch.float32 if out_dtype == torch.float32 else torch.bfloat16


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
    """MX-quantize x along axis: (fp8 data of x's shape, uint8 scale bytes)."""
    data, scale = _quantize(x, axis, elem, scale_mode, block_size)
    return data.contiguous(), scale.contiguous()


@quantize_op.register_fake
def _quantize_fake(x, axis, elem, scale_mode, block_size):
    shape = list(x.shape)
    scale_shape = list(shape)
    scale_shape[axis % x.ndim] //= block_size
    return (
        x.new_empty(shape, dtype=elem_format(elem).dtype),
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


def _contiguous_pair(fn: Callable) -> Callable:
    def wrapped(*args):
        data, scale = fn(*args)
        return data.contiguous(), scale.contiguous()

    return wrapped


# Pure-PyTorch definitions of the ops, used to decompose them before Inductor lowers a graph.
DECOMPOSITIONS: dict = {
    torch.ops.mxcompile.quantize.default: _contiguous_pair(_quantize),
    torch.ops.mxcompile.dequantize.default: lambda *a: _dequantize(*a).contiguous(),
    torch.ops.mxcompile.mx_mm.default: lambda *a: _mx_mm(*a).contiguous(),
}
