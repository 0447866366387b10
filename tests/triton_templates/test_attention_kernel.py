"""The MX attention forward kernel (under the interpreter) against the CPU op's torch
implementation, `mxcompile.ops.attention_reference.attention_forward_impl` (the definition):
bit for bit, output and logsumexp, with the kernel's BLOCK_N equal to the op's key_tile and the
interpreter's exp2, log2, row sums and fp32 dots made torch's (`attention_exactness`).

Q and K are quantized along head_dim and V along the keys outside the kernel (the numerics
core); the kernel expands them and rounds P in registers. Cases: sequences 64-256, head_dim 64
and 128, causal and not, sequences that are not a multiple of the tiles, E5M2 with floor
scales (the saturating clamp of P's rounding)."""

from __future__ import annotations

import math

import pytest
import torch

from attention_exactness import octave_operands, quantized, torch_primitives  # noqa: F401
from mxcompile.ops.attention_reference import AttentionOptions, attention_forward_impl
from mxcompile.triton_templates import mx_attention_triton


@pytest.mark.parametrize(
    "seq,head_dim,causal,key_tile,block_m,elem,scale_mode",
    [
        (64, 64, False, 32, 32, "e4m3", "rceil"),
        (96, 128, True, 64, 32, "e4m3", "rceil"),
        (160, 64, True, 64, 64, "e4m3", "rceil"),
        (256, 128, False, 128, 64, "e4m3", "rceil"),
        (96, 64, True, 64, 64, "e5m2", "floor"),
    ],
    ids=["s64-d64", "s96-d128-causal", "s160-d64-causal", "s256-d128", "s96-e5m2-floor-causal"],
)
def test_forward_bit_identical_to_the_cpu_op(
    torch_primitives, seq: int, head_dim: int, causal: bool, key_tile: int, block_m: int, elem: str,
    scale_mode: str,
) -> None:  # fmt: skip
    q, k, v, _ = octave_operands(1, 2, seq, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    options = AttentionOptions(causal, scale, "both", elem, scale_mode, 32, key_tile)
    ref_out, ref_lse = attention_forward_impl(q, k, v, None, options)
    operands = [*quantized(q, -1, elem, scale_mode), *quantized(k, -1, elem, scale_mode),
                *quantized(v, -2, elem, scale_mode)]  # fmt: skip
    out, lse = mx_attention_triton(
        *operands, sm_scale=scale, causal=causal, out_dtype=torch.float32, p_elem=elem,
        p_scale_mode=scale_mode, tiles={"BLOCK_M": block_m, "BLOCK_N": key_tile}, return_lse=True,
    )  # fmt: skip
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_attention_errors() -> None:
    q, qs = quantized(torch.randn(1, 32, 32), -1)
    k, ks = quantized(torch.randn(1, 64, 32), -1)
    v, vs = quantized(torch.randn(1, 64, 32), -2)
    with pytest.raises(ValueError, match="causal=True needs"):
        mx_attention_triton(q, qs, k, ks, v, vs, causal=True)
    with pytest.raises(ValueError, match="v_scale must be"):
        mx_attention_triton(q, qs, k, ks, v, ks, causal=False)
