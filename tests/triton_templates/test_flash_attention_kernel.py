"""The bf16 flash-attention reference kernels (under the interpreter) against fp32
`scaled_dot_product_attention` and its autograd.

Tolerances:
  * fp32 inputs (the interpreter multiplies fp32 exactly; only the summation order and the
    exp2-based softmax differ): |x - ref| <= 1e-5 * max(1, max|ref|) for the output, the
    logsumexp and each gradient (measured <= 8.6e-7).
  * fp16 inputs, forward (the half-precision path: P cast to V's dtype for P V, the output
    stored in it): each fp32 -> fp16 conversion errs by less than 2**-10 relative (truncated or
    rounded), once for P and once for the output, so |o - ref| <= 2**-9 * max|V| with ref the
    fp32 attention of the same fp16 inputs (measured 5.0e-5 * max|V|). Not bf16: the Triton
    3.9 interpreter's `tl.dot` of bf16 operands is wrong (errors of 1e10 on a 16 x 16 product
    of N(0, 1) values; fp16 exact); on a GPU bf16 and fp16 take the same code path.
"""

from __future__ import annotations

import pytest
import torch

from mxcompile.triton_templates.flash_attention import (
    flash_attention_backward_launch,
    flash_attention_backward_reference,
    flash_attention_launch,
    flash_attention_reference,
)

FP32_REL = 1e-5
FP16_OUTPUT_REL_TO_VMAX = 2.0**-9
TILES_32 = {"BLOCK_M": 32, "BLOCK_N": 32}  # several tiles along both axes at these lengths


def _qkv(heads: int, s_q: int, s_k: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    """Q with columns over 4 binades (peaked softmax rows), V with keys over 6, dO plain."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, s_q, d, generator=g) * torch.logspace(-2, 2, d, base=2.0)
    k = torch.randn(heads, s_k, d, generator=g)
    v = torch.randn(heads, s_k, d, generator=g) * torch.logspace(-3, 3, s_k, base=2.0)[:, None]
    do = torch.randn(heads, s_q, d, generator=g)
    return [q, k, v, do]


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    finite = ref.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(got[~finite], ref[~finite]), what
    err = (got[finite] - ref[finite]).abs().max().item()
    assert err <= FP32_REL * max(1.0, ref[finite].abs().max().item()), (what, err)


@pytest.mark.parametrize(
    "heads,s_q,s_k,d,causal",
    [(2, 64, 64, 64, False), (1, 96, 96, 128, True), (2, 40, 96, 64, False), (1, 80, 80, 64, True)],
    ids=["d64", "causal-d128", "ragged-queries", "causal-ragged"],
)
def test_fp32_forward_and_backward_match_sdpa(
    heads: int, s_q: int, s_k: int, d: int, causal: bool
) -> None:
    q, k, v, do = _qkv(heads, s_q, s_k, d)
    out, lse = flash_attention_launch(
        q, k, v, causal=causal, tiles=TILES_32, store_lse=True, interpret=True
    )
    ref_out, ref_lse = flash_attention_reference(q, k, v, causal=causal)
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse")
    grads = flash_attention_backward_launch(
        q, k, v, out, do, lse, causal=causal, tiles=TILES_32, interpret=True
    )
    refs = flash_attention_backward_reference(q, k, v, do, causal=causal)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        _assert_close(got, ref, name)


def test_fp16_forward_within_two_conversions() -> None:
    q, k, v, _ = (t.half() for t in _qkv(2, 64, 64, 64, seed=1))
    out = flash_attention_launch(q, k, v, causal=True, interpret=True)  # interpreter tiles
    ref, _ = flash_attention_reference(q, k, v, causal=True)
    assert out.dtype == torch.float16
    err = (out.float() - ref).abs().max().item()
    assert err <= FP16_OUTPUT_REL_TO_VMAX * v.float().abs().max().item(), err


def test_errors() -> None:
    q, k, v, _ = _qkv(1, 32, 64, 32)
    with pytest.raises(ValueError, match="causal=True needs"):
        flash_attention_launch(q, k, v, causal=True, interpret=True)
    with pytest.raises(ValueError, match="like q"):
        flash_attention_launch(q, k.bfloat16(), v, interpret=True)
    with pytest.raises(ValueError, match="not autotuned"):
        flash_attention_launch(q, k, v, interpret=False)
