"""The MX attention forward kernel against (1) the tile-faithful torch reference (same online
softmax and per-tile P quantization, numerics-core quantizer): |o - ref| <= 1e-5 * max(1, max|ref|)
(measured <= 9.6e-7 with outputs up to 9.8); (2) exact fp32 attention on the dequantized Q, K, V
(P not quantized): |o - exact| <= 0.02 * max|V| (P in E4M3 carries up to 2^-4 relative rounding
per element, the row's largest included: it lies in (1/2, 1], not at 1, under the integer running
maximum; measured 0.12-0.28 with max|V| = 28, i.e. <= 0.01 * max|V|)."""

from __future__ import annotations

import pytest
import torch

from mxcompile.numerics import E4M3, ScaleMode, quantize_along
from mxcompile.triton_templates import mx_attention_triton
from mxcompile.triton_templates.attention import mx_attention_exact, mx_attention_reference

TILES = {"BLOCK_M": 32, "BLOCK_N": 32}


def _qkv(bh: int, s_q: int, s_k: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bh, s_q, d, generator=g) * torch.logspace(-2, 2, d, base=2.0)
    k = torch.randn(bh, s_k, d, generator=g)
    v = torch.randn(bh, s_k, d, generator=g) * torch.logspace(-3, 3, s_k, base=2.0)[:, None]
    qq = quantize_along(q, 2, E4M3, ScaleMode.RCEIL, 32)
    kq = quantize_along(k, 2, E4M3, ScaleMode.RCEIL, 32)
    vq = quantize_along(v, 1, E4M3, ScaleMode.RCEIL, 32)  # along the key axis
    return (*qq, *kq, *vq)


@pytest.mark.parametrize(
    "shape,causal",
    [((2, 64, 64, 64), False), ((2, 64, 64, 64), True), ((1, 40, 96, 32), False)],
    ids=["full", "causal", "ragged-queries"],
)
def test_attention_matches_references(shape: tuple[int, int, int, int], causal: bool) -> None:
    args = _qkv(*shape)
    out = mx_attention_triton(*args, causal=causal, out_dtype=torch.float32, tiles=TILES)
    ref = mx_attention_reference(*args, causal=causal, block_n=TILES["BLOCK_N"])
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    exact = mx_attention_exact(*args, causal=causal)
    vmax = args[4].float().abs().max() * 2.0 ** (args[5].int().max() - 127)
    assert (out - exact).abs().max().item() <= 0.02 * vmax


def test_attention_4d_bf16_out() -> None:
    q, qs, k, ks, v, vs = _qkv(2, 64, 64, 32, seed=1)
    four = [t.reshape(1, 2, *t.shape[1:]) for t in (q, qs, k, ks, v, vs)]
    out = mx_attention_triton(*four, out_dtype=torch.bfloat16, tiles={"BLOCK_M": 64, "BLOCK_N": 64})
    ref = mx_attention_reference(q, qs, k, ks, v, vs, block_n=64).reshape(1, 2, 64, 32)
    assert out.shape == (1, 2, 64, 32) and out.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)
    assert ((out.float() - ref).abs() <= ulp + 1e-6).all()


def test_attention_errors() -> None:
    q, qs, k, ks, v, vs = _qkv(1, 32, 64, 32)
    with pytest.raises(ValueError, match="causal=True needs"):
        mx_attention_triton(q, qs, k, ks, v, vs, causal=True)
    with pytest.raises(ValueError, match="v_scale must be"):
        mx_attention_triton(q, qs, k, ks, v, ks, causal=False)
