"""Dropout inside rewritten graphs, lowered by Inductor on CPU: embedding, attention and
residual dropout keep the default backend's semantics (a fraction p of elements zeroed, the
kept ones scaled by 1 / (1 - p), the forward's mask reused by the backward) and train mode
differs from eval. Two Inductor compiles in all: the training graph and the eval graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxcompile
from mxcompile.report import CONVERTED

P = 0.25
BATCH, SEQ, WIDTH, HEADS = 2, 32, 64, 2
VOCAB = BATCH * SEQ  # each token appears once, so an embedding row's gradient is one position's
# A fraction of zeros drawn from BATCH * SEQ * WIDTH = 4096 Bernoulli(P) draws has a standard
# deviation of 0.007; five of them.
ZERO_FRACTION_TOLERANCE = 0.035
ATTENTION_DRAWS = 200
# Mean over ATTENTION_DRAWS attention-dropout draws against the no-dropout (eval) output, as a
# relative norm. Measured 0.054 (sampling and MX noise); without the 1/(1-p) scaling, 0.26.
ATTENTION_MEAN_TOLERANCE = 0.12


class DropoutEverywhere(nn.Module):
    """Embedding dropout, attention dropout and residual dropout around MX GEMMs. Attention reads
    the embedding before its dropout and detached, so that the embedding's gradient comes only
    through the embedding-dropout path (which the test checks exactly)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        e = self.emb(ids)
        h = F.dropout(e, P, self.training)
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(e.detach()).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0, is_causal=True)
        y = self.proj(a.transpose(1, 2).flatten(-2))
        r = h + F.dropout(y, P, self.training)
        return e, h, y, r


def _zero_fraction(t: torch.Tensor) -> float:
    return (t == 0).float().mean().item()


@pytest.fixture(scope="module")
def runs():
    """One compiled training step (r's gradient given, so the expected parameter gradients
    follow from the returned tensors), ATTENTION_DRAWS further training forwards, two eval forwards."""
    torch.manual_seed(0)
    model = DropoutEverywhere()
    ids = torch.randperm(VOCAB).view(BATCH, SEQ)
    compiled = torch.compile(model, backend="mxfp8")
    e, h, y, r = compiled(ids)
    r_grad = torch.randn(r.shape)
    r.backward(r_grad)
    train = {"e": e.detach(), "h": h.detach(), "y": y.detach(), "r": r.detach(), "r_grad": r_grad,
             "emb_grad": model.emb.weight.grad[ids].clone(), "proj_bias_grad": model.proj.bias.grad.clone()}
    draws = [compiled(ids)[2].detach() for _ in range(ATTENTION_DRAWS)]
    train["y_draws"] = torch.stack(draws)
    model.eval()
    with torch.no_grad():
        evals = [tuple(t.clone() for t in compiled(ids)) for _ in range(2)]
    return train, evals, mxcompile.report_of(model)


def test_embedding_dropout_zeroes_p_and_scales_the_rest(runs):
    train, _, _ = runs
    e, h = train["e"], train["h"]
    assert abs(_zero_fraction(h) - P) < ZERO_FRACTION_TOLERANCE
    kept = h != 0
    torch.testing.assert_close(h[kept], e[kept] / (1 - P))


def test_residual_dropout_zeroes_p_and_scales_the_rest(runs):
    train, _, _ = runs
    dropped = train["r"] - train["h"]  # exactly 0 where the residual branch was dropped
    assert abs(_zero_fraction(dropped) - P) < ZERO_FRACTION_TOLERANCE
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], train["y"][kept] / (1 - P), rtol=1e-5, atol=1e-5)


def test_backward_reuses_the_forward_masks(runs):
    train, _, _ = runs
    # Embedding row of each token: the upstream gradient through the mask, scaled.
    expected_emb = (train["h"] != 0) * train["r_grad"] / (1 - P)
    torch.testing.assert_close(train["emb_grad"], expected_emb)
    # proj's bias gradient: the residual-dropout mask applied to r's gradient, summed over tokens.
    mask = (train["r"] - train["h"]) != 0
    expected_bias = (mask * train["r_grad"] / (1 - P)).sum((0, 1))
    torch.testing.assert_close(train["proj_bias_grad"], expected_bias, rtol=1e-5, atol=1e-7)


def test_attention_dropout_is_unbiased_and_random(runs):
    train, evals, _ = runs
    draws, y_eval = train["y_draws"], evals[0][2]
    assert not torch.equal(draws[0], draws[1]), "attention dropout drew the same mask twice"
    assert not torch.allclose(draws[0], y_eval)
    relative = ((draws.mean(0) - y_eval).norm() / y_eval.norm()).item()
    assert relative < ATTENTION_MEAN_TOLERANCE, relative


def test_eval_mode_has_no_dropout_and_is_deterministic(runs):
    _, evals, _ = runs
    (e, h, y, r), second = evals
    assert torch.equal(h, e)
    torch.testing.assert_close(r - h, y)
    for a, b in zip(evals[0], second):
        assert torch.equal(a, b)


def test_the_gemms_around_dropout_are_converted(runs):
    _, _, reports = runs
    assert len(reports) == 2  # the training graph and the eval graph
    linear = [d for r in reports for d in r.decisions if d.kind != "attention"]
    assert {d.graph for d in linear} == {"forward", "backward", "inference"}
    assert all(d.decision == CONVERTED for d in linear), [(d.node, d.reason) for d in linear if d.decision != CONVERTED]
