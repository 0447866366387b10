"""The MX attention backward kernels (under the interpreter) against the CPU op's torch
implementation, `mxcompile.ops.attention_reference.attention_backward_impl` (the definition):
dQ, dK and dV bit for bit, with the interpreter's exp2, row sums and fp32 dots made torch's
(`attention_exactness`). The op contracts each key tile's dK and dV over all its queries in one
product and adds dQ key tile by key tile: the kernels sum in that order with the dQ kernel's
BLOCK_N equal to the op's key_tile and one dK/dV query step covering the queries (BLOCK_M >=
the sequence).

Q, K, V and dO are quantized outside the kernels along each product's contraction axis
(`quantize_backward_operands`, the numerics core); the kernels expand them and round P and dS
in registers. The logsumexp and the output come from the op's forward. Cases: sequences 64-256,
head_dim 64 and 128, causal and not, sequences that are not a multiple of the tiles, E5M2
gradients, and the modes qk_only and off (fp32 value path).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_exactness import octave_operands, quantized, torch_primitives  # noqa: F401
from mxcompile.ops.attention_reference import AttentionOptions, attention_backward_impl, attention_forward_impl
from mxcompile.triton_templates import mx_attention_backward_triton
from mxcompile.triton_templates.attention_backward import quantize_backward_operands


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


@pytest.mark.parametrize(
    "seq,head_dim,causal,key_tile,block_m,mode,grad_elem",
    [
        (64, 64, False, 32, 64, "both", "e4m3"),
        (96, 128, True, 64, 128, "both", "e5m2"),
        (160, 64, True, 64, 256, "both", "e4m3"),
        (256, 128, False, 128, 256, "both", "e4m3"),
        (96, 64, True, 64, 128, "qk_only", "e4m3"),
        (64, 64, False, 32, 64, "off", "e4m3"),
    ],
    ids=["s64-d64", "s96-d128-causal-e5m2", "s160-d64-causal", "s256-d128", "s96-causal-qk_only", "s64-off"],
)
def test_backward_bit_identical_to_the_cpu_op(
    torch_primitives, seq: int, head_dim: int, causal: bool, key_tile: int, block_m: int, mode: str,
    grad_elem: str,
) -> None:  # fmt: skip
    q, k, v, do = octave_operands(1, 2, seq, head_dim, seed=1)
    scale = 1.0 / math.sqrt(head_dim)
    options = AttentionOptions(causal, scale, mode, "e4m3", "rceil", 32, key_tile, grad_elem=grad_elem)
    out, lse = attention_forward_impl(q, k, v, None, options)
    refs = attention_backward_impl(do, q, k, v, None, out, lse, options)
    operands = quantize_backward_operands(q, k, v, do, quantized, attention_mode=mode, forward_elem="e4m3",
                                          grad_elem=grad_elem)  # fmt: skip
    grads = mx_attention_backward_triton(
        operands, out, do, lse, sm_scale=scale, causal=causal, attention_mode=mode, grad_elem=grad_elem,
        tiles={"BLOCK_M": block_m, "BLOCK_N": key_tile},
    )  # fmt: skip
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert torch.equal(got, ref), name


def test_backward_errors() -> None:
    q, k, v, do = octave_operands(1, 1, 64, 32)
    operands = quantize_backward_operands(q, k, v, do, quantized, attention_mode="both", forward_elem="e4m3",
                                          grad_elem="e4m3")  # fmt: skip
    lse = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="attention_mode="):
        mx_attention_backward_triton(operands, q, do, lse, attention_mode="pv_only")
    with pytest.raises(ValueError, match="lse must be"):
        mx_attention_backward_triton(operands, q, do, lse[..., :32])
    with pytest.raises(ValueError, match="operands.v.data must be"):
        mx_attention_backward_triton(operands, q, do, lse, attention_mode="qk_only")
    with pytest.raises(ValueError, match="tiles"):
        mx_attention_backward_triton(operands, q, do, lse, tiles={"BLOCK_M": 16, "BLOCK_N": 32})
