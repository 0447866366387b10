"""An independent eager emulation of MX training GEMMs, written from the recipe: each operand
quantized along its own contraction axis with the numerics core, then an fp32 matmul."""

from __future__ import annotations

import functools

import torch

from mxcompile.numerics import E4M3, ScaleMode, dequantize_along, quantize_along


def fake_quantize(x: torch.Tensor, axis: int, block_size: int = 32) -> torch.Tensor:
    data, scale = quantize_along(x, axis % x.ndim, E4M3, ScaleMode.RCEIL, block_size)
    return dequantize_along(data, scale, axis % x.ndim, block_size, torch.float32)


class MXLinearFunction(torch.autograd.Function):
    """Y = X Wt + b with the three recipe GEMMs in MX (X: (M, K), W: (N, K))."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        y = fake_quantize(x, 1) @ fake_quantize(weight.t(), 0)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = fake_quantize(grad_y, 1) @ fake_quantize(weight, 0)  # contraction over N
        grad_w = fake_quantize(grad_y.t(), 1) @ fake_quantize(x, 0)  # contraction over M
        return grad_x, grad_w, grad_y.sum(0)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    reference, approximation = reference.detach().double(), approximation.detach().double()
    noise = (reference - approximation).norm()
    return float(20 * torch.log10(reference.norm() / noise))


def eager_mxfp8_backend(config=None, report=None):
    """The mxfp8 pipeline (AOTAutograd, passes, partition) with eager execution of the
    rewritten graphs: tests about the rewrite skip Inductor's compile time."""
    from mxcompile.backend import compile_graph
    from mxcompile.config import MXConfig
    from mxcompile.lowering import eager_compiler

    return functools.partial(compile_graph, config=config or MXConfig(), lower=eager_compiler,
                             report=report)


def special_quantize_data(shape=(96, 128), seed=0) -> torch.Tensor:
    """fp32 rows spread over 2**-30 .. 2**30, with a zero block (and a -0.0), a NaN, an Inf, a
    block below fp32's normal range, values at e4m3's saturation boundary and a subnormal
    midpoint: the edge cases of quantization, for the Inductor forms' bit-exactness tests."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-30, 30, (shape[0], 1), generator=g).float())
    x = torch.randn(shape, generator=g) * rows
    x[0, :32] = 0.0
    x[0, 5] = -0.0
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3, 64:96] = 2.0**-133
    x[4, :8] = 448.0 * torch.tensor([1, -1, 1.03, -1.07, 1.1, 0.99, 2 ** -20, -(2 ** -24)])
    x[5, 3] = 1.5 * 2.0**-140
    return x


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns, as the integer dtype of its width."""
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, except that any NaN matches any NaN: a NaN's payload is not part of
    the answer. ATen's conversions do not agree on it (fp32 -> bf16: 0xFFFF vectorized, 0x7FC0
    scalar; fp32 -> fp16: 0x7E00 and 0x7F80 within one tensor, body and tail), nor do Inductor's
    and eager fp8 conversions (e5m2 0x7F -> 0x7FE00000 vectorized, the default NaN eagerly)."""
    return a.dtype == b.dtype and bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())
