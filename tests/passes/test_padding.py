"""Zero-padding of contraction axes (passes/mx_gemm): padded MX GEMMs against an independent
reference that pads explicitly, bit for bit; run-time padding of symbolic lengths without
recompilation. Compiles use mx_testing.eager_mxfp8_backend, except the one Inductor check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from padding_testing import octaves, train_at_lengths
from mx_testing import eager_mxfp8_backend, fake_quantize, sqnr_db
from mxcompile.config import MXConfig
from mxcompile.report import CONVERTED, Report

BLOCK = 32


def _padded_fake_quantize(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The reference: pad with zeros along axis to a multiple of the block, then MX-round."""
    axis %= x.ndim
    pad = [0, 0] * (x.ndim - 1 - axis) + [0, -x.shape[axis] % BLOCK]
    return fake_quantize(F.pad(x, pad), axis, BLOCK)


def _reference_linear(x, weight, bias, grad_y):
    """(y, dx, dw, db) of Y = X Wt + b with every GEMM in MX, operands padded explicitly."""
    y = _padded_fake_quantize(x, 1) @ _padded_fake_quantize(weight.t(), 0) + bias
    dx = _padded_fake_quantize(grad_y, 1) @ _padded_fake_quantize(weight, 0)
    dw = _padded_fake_quantize(grad_y.t(), 1) @ _padded_fake_quantize(x, 0)
    return y, dx, dw, grad_y.sum(0)


def _run_linear(compiled, layer, x, grad_y):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    y = compiled(x)
    y.backward(grad_y)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("tokens, features", [(260, 40), (65, 64)])
def test_padded_linear_is_bit_identical_to_explicit_padding(tokens, features):
    """260 tokens: dW contracts over tokens (260 -> 288); 40 input features: Y pads K to 64."""
    layer = nn.Linear(features, 96)
    x, grad_y = octaves(tokens, features, seed=1), octaves(tokens, 96, seed=2)
    report = Report({})
    compiled = torch.compile(layer, backend=eager_mxfp8_backend(MXConfig(), report))
    got = _run_linear(compiled, layer, x, grad_y)
    want = _reference_linear(x, layer.weight.detach(), layer.bias.detach(), grad_y)
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(g, w), name
    kinds = {d.kind: d for d in report.decisions}
    assert set(kinds) == {"output", "input_grad", "weight_grad"}
    assert all(d.decision == CONVERTED for d in report.decisions)
    assert f"K={tokens} zero-padded to {-(-tokens // BLOCK) * BLOCK}" in kinds["weight_grad"].reason


class _MLP(nn.Module):
    def __init__(self, width=64, hidden=96):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))  # relu: exact, so the reference can follow


def test_symbolic_lengths_are_padded_at_run_time_without_recompiling():
    """Lengths 64, 96, 128: dynamo recompiles once with a symbolic token count; every GEMM of
    every graph is converted; further lengths (not multiples of 32 included) reuse the
    symbolic graph, pad at run time, and match the explicitly padded reference bit for bit."""
    counters.clear()
    model = _MLP()
    report = Report({})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(MXConfig(), report))
    for tokens in (64, 96, 128):
        compiled(octaves(2, tokens, 64, seed=tokens)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert report.decisions and all(d.decision == CONVERTED for d in report.decisions)
    symbolic = [d for d in report.decisions if "zero-padded at run time" in d.reason]
    assert {d.kind for d in symbolic} == {"weight_grad"}, [d.reason for d in report.decisions]
    assert len(symbolic) == 2

    for tokens in (100, 33):
        x = octaves(2, tokens, 64, seed=tokens)
        grad = octaves(2, tokens, 64, seed=tokens + 1)
        model.zero_grad()
        compiled(x).backward(grad)
        got = [p.grad.clone() for p in (model.up.weight, model.down.weight)]

        # The reference: every GEMM through _reference_linear, tokens flattened.
        flat = x.reshape(-1, 64)
        hidden = _padded_fake_quantize(flat, 1) @ _padded_fake_quantize(model.up.weight.detach().t(), 0)
        hidden = (hidden + model.up.bias.detach()).requires_grad_()
        act = F.relu(hidden)
        _, d_act, dw_down, _ = _reference_linear(act.detach(), model.down.weight.detach(),
                                                 model.down.bias.detach(), grad.reshape(-1, 64))
        (d_hidden,) = torch.autograd.grad(act, hidden, d_act)
        dw_up = _padded_fake_quantize(d_hidden.t(), 1) @ _padded_fake_quantize(flat, 0)
        assert torch.equal(got[1], dw_down), tokens
        assert torch.equal(got[0], dw_up), tokens
    assert counters["stats"]["unique_graphs"] == 2, "a run-time length caused a recompilation"


class _Block(nn.Module):
    """Projections around causal SDPA: padded GEMMs and padded attention in one graph."""

    def __init__(self, width=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, width))


@pytest.mark.slow
def test_inductor_lowers_the_run_time_padded_graph_like_the_eager_pipeline():
    """One Inductor compile with a symbolic token count (mark_dynamic), run at 65 and 100
    tokens: the padding lowers on CPU and matches the eager lowering; the model's graph is
    compiled once (the backend is called once per joint graph)."""
    from mxcompile.backend import mxfp8_backend

    torch.manual_seed(0)
    model = _Block()
    results = {}
    for name, backend in (("eager", eager_mxfp8_backend()), ("inductor", mxfp8_backend)):
        torch._dynamo.reset()
        calls = []

        def counting(gm, example_inputs, backend=backend):
            calls.append(gm)
            return backend(gm, example_inputs)

        compiled = torch.compile(model, backend=counting)
        for tokens in (65, 100):
            x = octaves(2, tokens, 64, seed=tokens)
            torch._dynamo.mark_dynamic(x, 1)
            model.zero_grad()
            y = compiled(x)
            y.backward(octaves(2, tokens, 64, seed=tokens + 1))
            results[name, tokens] = (y.detach(), model.qkv.weight.grad.clone())
        assert len(calls) == 1, (name, len(calls))
    for tokens in (65, 100):
        for eager, inductor in zip(results["eager", tokens], results["inductor", tokens]):
            assert sqnr_db(eager, inductor) >= 60, tokens


def test_hf_llama_trained_at_three_lengths_converts_every_gemm_of_every_graph():
    """An HF Llama (sdpa attention, GQA, RoPE) trained at 64, 96 and 128 tokens: dynamo
    recompiles once with a symbolic sequence length and keeps that graph for 128; every GEMM
    (attention included) of both compiled graphs is MX, the symbolic ones padded at run time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(config).train()
    report = Report({})
    compiles = train_at_lengths(model, report, (64, 96, 128))
    assert compiles == 2, compiles
    kept = [(d.op, d.reason) for d in report.decisions if d.decision != CONVERTED]
    assert report.decisions and not kept, kept
    assert any("zero-padded at run time" in d.reason for d in report.decisions if d.kind == "attention")
    assert any("zero-padded at run time" in d.reason for d in report.decisions if d.kind == "weight_grad")
