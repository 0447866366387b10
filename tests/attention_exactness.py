"""What the bit-for-bit tests of the MX attention kernels share: the interpreter's elementary
operations made torch's, and the operands quantized along each product's contraction axis.

The Triton interpreter runs a kernel's operations as numpy calls; the reference
(`mxcompile.ops.attention_reference`) runs torch's. Four of them are not the same function on
these machines: numpy's and torch's exp2 and log2 differ in the last bit for about a fifth of
fp32 inputs, their row sums add in different orders, and OpenBLAS's small-matrix kernel (numpy's
matmul of 32 x k by a transposed k x 32) sums in another order than torch's matmul (every other
tile shape here agrees). `torch_primitives` makes the interpreter call torch for those four (a
dot without the contraction positions that only add exact zeros: `_torch_dot`), so
that a bit-for-bit comparison checks the kernels' algorithm (operand values, quantization axes,
the order of every accumulation), not numpy against torch. On a GPU the kernels' exp2 is
`ex2.approx` and their MMAs sum in the tensor cores' order anyway.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter

from mxcompile.numerics import elem_format, quantize_along, scale_mode_named


def _torch_unary(fn):
    def create(self, arg):
        return self.unary_op(arg, lambda a: fn(torch.from_numpy(np.ascontiguousarray(a))).numpy())

    return create


def _torch_sum(self, input):
    data = torch.from_numpy(np.ascontiguousarray(input.handle.data))
    return self.to_tensor(data.sum(dim=self.axis, keepdim=self.keep_dims).numpy(), input.dtype)


def _contributing_span(a: torch.Tensor, b: torch.Tensor) -> slice:
    """The contraction positions from the first to the last whose product term is not zero for
    every output (a's column or b's row all zero contributes exact zeros)."""
    live = (a != 0).any(dim=0) & (b != 0).any(dim=1)
    positions = live.nonzero().flatten()
    if positions.numel() == 0:
        return slice(0, 0)
    return slice(int(positions[0]), int(positions[-1]) + 1)


def _torch_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.data.dtype != np.float32 or b.data.dtype != np.float32:
        raise TypeError(f"torch_primitives: fp32 dots only, got {a.data.dtype} x {b.data.dtype}")
    lhs, rhs = torch.from_numpy(a.data), torch.from_numpy(b.data)
    # A kernel tile's contraction runs over masked rows (causal, past the sequence) that the
    # reference's product leaves out: without them the matmul has the reference's length, so
    # the CPU's GEMM kernel blocks it the same way (on the AVX512 EPYC, a 256-long contraction
    # with 96 zero rows summed dK in another order than the reference's 160).
    span = _contributing_span(lhs, rhs)
    product = torch.matmul(lhs[:, span], rhs[span, :]).numpy()
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


@pytest.fixture
def torch_primitives(monkeypatch: pytest.MonkeyPatch) -> None:
    """exp2, log2, sum reductions and fp32 dots of the interpreter computed by torch."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", _torch_unary(torch.exp2))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_log2", _torch_unary(torch.log2))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _torch_dot)
    monkeypatch.setattr(interpreter.ReduceOps, "sum", _torch_sum)


def quantized(x: torch.Tensor, axis: int, elem: str = "e4m3", scale_mode: str = "rceil") -> tuple:
    """(FP8 data, uint8 scales) of x along axis, blocks of 32 (the numerics core)."""
    return quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode_named(scale_mode), 32)


def octave_operands(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0) -> tuple:
    """q, k, v, dO (batch, heads, seq, head_dim) fp32 whose magnitudes vary over several octaves
    along head_dim (q) and the sequence (v, dO): a wrong quantization axis changes values."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    q = torch.randn(shape, generator=g) * torch.logspace(-2, 2, head_dim, base=2.0)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g) * torch.logspace(-3, 3, seq, base=2.0)[:, None]
    do = torch.randn(shape, generator=g) * torch.logspace(2, -2, seq, base=2.0)[:, None]
    return q, k, v, do
