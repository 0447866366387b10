"""The MX attention backward kernels (under the interpreter) against:

(1) the tile-faithful torch reference `mx_attention_backward_reference` (same quantizations,
    numerics-core quantizer) and, where the query length is a multiple of 32, the CPU op's
    backward `mxcompile.ops.attention_reference.attention_backward_impl` (the definition of the semantics):
    |g - ref| <= 1e-5 * max|ref| per gradient (measured <= 5e-7 * max|ref|: only the fp32
    summation order differs);
(2) fp32 autograd of unquantized attention, after the MX forward kernel (which also writes the
    logsumexp the backward takes; checked against the forward reference, |lse - ref| <= 1e-5,
    measured 4.8e-7): SQNR >= 20 dB with e4m3 gradients, >= 17 dB with e5m2 (measured over 3
    seeds: dq/dk 21.9-23.8 dB, dv 24.8-26.8 dB with e4m3; dq/dk 19.6-20.2 dB, dv 22.9-24.0 dB
    with e5m2; the MX forward output itself is at 25.0-26.9 dB).
"""

from __future__ import annotations

import math

import pytest
import torch

from mx_testing import sqnr_db
from mxcompile.ops.attention_reference import AttentionOptions, attention_backward_impl, attention_forward_impl
from mxcompile.numerics import E4M3, ScaleMode, quantize_along
from mxcompile.triton_templates import mx_attention_backward_triton, mx_attention_triton
from mxcompile.triton_templates.attention import mx_attention_reference
from mxcompile.triton_templates.attention_backward import mx_attention_backward_reference

TILES = {"BLOCK_M": 32, "BLOCK_N": 32}
TILES_64 = {"BLOCK_M": 64, "BLOCK_N": 64}  # one tile per head here; ~3x faster interpreted


def _tensors(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in shapes]


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> bool:
    return (got.float() - ref.float()).abs().max().item() <= rel * ref.float().abs().max().item()


@pytest.mark.parametrize(
    "bh,s_q,s_k,d,causal,attention_mode,grad_elem,tiles",
    [
        (2, 64, 64, 32, False, "both", "e4m3", TILES),
        (2, 64, 64, 64, True, "both", "e5m2", TILES),
        (2, 48, 64, 32, False, "both", "e4m3", {"BLOCK_M": 64, "BLOCK_N": 32}),
        (2, 64, 64, 32, True, "qk_only", "e4m3", TILES),
        (2, 64, 64, 32, False, "off", "e4m3", TILES),
    ],
    ids=["full", "causal-e5m2-d64", "ragged-queries", "causal-qk_only", "off"],
)
def test_backward_matches_references(
    bh: int, s_q: int, s_k: int, d: int, causal: bool, attention_mode: str, grad_elem: str, tiles: dict
) -> None:
    q, k, v, do = _tensors((bh, s_q, d), (bh, s_k, d), (bh, s_k, d), (bh, s_q, d))
    q = q * torch.logspace(-2, 2, d, base=2.0)  # columns over 4 binades
    v = v * torch.logspace(-3, 3, s_k, base=2.0)[:, None]  # keys over 6 binades
    scale = 1.0 / math.sqrt(d)
    opts = dict(causal=causal, attention_mode=attention_mode, grad_elem=grad_elem)
    if s_q % 32 == 0:  # the CPU op's forward gives out and lse; its backward is the definition
        q4, k4, v4, do4 = (t.unsqueeze(0) for t in (q, k, v, do))
        fixed = (causal, scale, attention_mode, "e4m3")
        options = AttentionOptions(*fixed, "rceil", 32, 32, grad_elem=grad_elem)
        out, lse = attention_forward_impl(q4, k4, v4, None, options)
        cpu = attention_backward_impl(do4, q4, k4, v4, None, out, lse, options)
        out, lse = out[0], lse[0]
    else:
        out, lse = _tensors((bh, s_q, d), (bh, s_q), seed=1)
        cpu = None
    grads = mx_attention_backward_triton(q, k, v, out, do, lse, tiles=tiles, **opts)
    refs = mx_attention_backward_reference(q, k, v, out, do, lse, **opts)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        assert _close(got, ref), name
    if cpu is not None:
        for name, got, ref in zip(("dq", "dk", "dv"), grads, cpu, strict=True):
            assert _close(got, ref[0]), name


@pytest.mark.parametrize(
    "d,causal,grad_elem,min_db",
    [(32, False, "e4m3", 20.0), (64, True, "e4m3", 20.0), (32, True, "e5m2", 17.0)],
    ids=["full", "causal-d64", "causal-e5m2"],
)
def test_forward_lse_and_backward_vs_fp32_autograd(
    d: int, causal: bool, grad_elem: str, min_db: float
) -> None:
    bh, s = 2, 64
    q, k, v, do = _tensors((bh, s, d), (bh, s, d), (bh, s, d), (bh, s, d), seed=2)
    quantized = [
        *quantize_along(q, 2, E4M3, ScaleMode.RCEIL, 32),
        *quantize_along(k, 2, E4M3, ScaleMode.RCEIL, 32),
        *quantize_along(v, 1, E4M3, ScaleMode.RCEIL, 32),  # along the keys
    ]
    out, lse = mx_attention_triton(
        *quantized, causal=causal, out_dtype=torch.float32, tiles=TILES, return_lse=True
    )
    ref_out, ref_lse = mx_attention_reference(
        *quantized, causal=causal, block_n=32, return_lse=True
    )
    assert lse.shape == (bh, s) and lse.dtype == torch.float32
    assert (lse - ref_lse).abs().max().item() <= 1e-5 * max(1.0, ref_lse.abs().max().item())
    assert _close(out, ref_out)
    grads = mx_attention_backward_triton(
        q, k, v, out, do, lse, causal=causal, grad_elem=grad_elem, tiles=TILES_64
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal).backward(do)
    for name, got, leaf in zip(("dq", "dk", "dv"), grads, leaves, strict=True):
        assert sqnr_db(leaf.grad, got) >= min_db, name


def test_backward_bf16_and_4d() -> None:
    q, k, v, out, do = (t.reshape(1, 2, 64, 32).bfloat16() for t in _tensors(*[(2, 64, 32)] * 5))
    lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) / math.sqrt(32), dim=-1)
    grads = mx_attention_backward_triton(q, k, v, out, do, lse, tiles=TILES_64)
    refs = mx_attention_backward_reference(q.float(), k.float(), v.float(), out, do, lse)
    for got, ref in zip(grads, refs, strict=True):
        assert got.shape == (1, 2, 64, 32) and got.dtype == torch.bfloat16
        # bf16 stores: within 2 bf16 ulps (the interpreter truncates fp32 -> bf16).
        ulp = torch.finfo(torch.bfloat16).eps * ref.abs()
        assert ((got.float() - ref).abs() <= 2 * ulp + 1e-6).all()


def test_backward_errors() -> None:
    q, k, v, do = _tensors((1, 32, 32), (1, 64, 32), (1, 64, 32), (1, 32, 32))
    lse = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="causal=True needs"):
        mx_attention_backward_triton(q, k, v, q, do, lse, causal=True)
    with pytest.raises(ValueError, match="attention_mode="):
        mx_attention_backward_triton(q, k, v, q, do, lse, attention_mode="pv_only")
    with pytest.raises(ValueError, match="lse must be"):
        mx_attention_backward_triton(q, k, v, q, do, lse[:, :16])
    with pytest.raises(ValueError, match="S_k=48"):
        mx_attention_backward_triton(q, k[:, :48], v[:, :48], q, do, lse)
    with pytest.raises(ValueError, match="tiles"):
        mx_attention_backward_triton(q, k, v, q, do, lse, tiles={"BLOCK_M": 16, "BLOCK_N": 32})
