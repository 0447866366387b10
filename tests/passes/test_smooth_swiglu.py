"""The Smooth-SwiGLU pass: where it matches, that it keeps the function, what it does to MX rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxcompile
from mxcompile import passes
from mxcompile.config import MXConfig
from mxcompile.passes.smooth_swiglu import KIND, NOT_SMOOTHED, SMOOTHED, smooth_swiglu
from mxcompile.report import CONVERTED, Report

from mx_testing import eager_mxfp8_backend, sqnr_db

D, HIDDEN, TOKENS = 256, 512, 256  # K = HIDDEN: 16 blocks of 32 hidden channels
OUTLIER_CHANNEL = 7


class SwiGLU(nn.Module):
    """A LLaMA-style MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d: int = D, hidden: int = HIDDEN, activation=F.silu):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.activation = activation

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class SigmoidSwiGLU(SwiGLU):
    """silu written out as x * sigmoid(x)."""

    def forward(self, x):
        gate = self.w1(x)
        return self.w2(gate * torch.sigmoid(gate) * self.w3(x))


class GeluMLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class TwoInputGLU(SwiGLU):
    """silu(w1 x) * w3 z: a gated product whose projections read different inputs."""

    def forward(self, x, z):
        return self.w2(F.silu(self.w1(x)) * self.w3(z))


def _swiglu_rows(report: Report):
    return [d for d in report.decisions if d.kind == KIND]


def _model(seed: int = 0, outlier: float = 1.0, compensate: bool = False) -> SwiGLU:
    """A SwiGLU MLP whose hidden channel OUTLIER_CHANNEL is `outlier` times the others (its row of
    w3 scaled); with `compensate`, w2's column of that channel is divided by `outlier`, so that the
    channel does not dominate the output."""
    torch.manual_seed(seed)
    model = SwiGLU()
    with torch.no_grad():
        model.w3.weight[OUTLIER_CHANNEL] *= outlier
        if compensate:
            model.w2.weight[:, OUTLIER_CHANNEL] /= outlier
    return model


def _train_step(model: nn.Module, x: torch.Tensor, config: MXConfig | None):
    """Output, loss gradient of every parameter and report of one step (eager fp32 when config is None)."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    report = Report(config={})
    run = model if config is None else torch.compile(model, backend=eager_mxfp8_backend(config, report))
    y = run(x)
    y.square().mean().backward()
    return y.detach(), {name: p.grad for name, p in model.named_parameters()}, report


# (1) Where it matches.

@pytest.mark.parametrize("model_class", [SwiGLU, SigmoidSwiGLU])
def test_matches_a_llama_style_swiglu_mlp(model_class):
    torch.manual_seed(0)
    report = mxcompile.explain(model_class(64, 128), torch.randn(2, 16, 64, requires_grad=True),
                               config=MXConfig(smooth_swiglu=True))
    rows = _swiglu_rows(report)
    assert len(rows) == 1, rows
    row = rows[0]
    assert row.decision == SMOOTHED and row.module == "w2" and row.graph == "forward", row
    assert row.flops == 0 and row.shapes == ((32, 128), (128, 64))
    assert "(w1, w3)" in row.reason
    # the down projection's forward GEMM is still converted, under the same node name
    down = [d for d in report.decisions if d.kind == "output" and d.node == row.node]
    assert len(down) == 1 and down[0].decision == CONVERTED and down[0].module == "w2"
    # the GEMM count is gemm_rewrite's: the smooth_swiglu row is not a GEMM of its own
    plain = mxcompile.explain(model_class(64, 128), torch.randn(2, 16, 64, requires_grad=True))
    assert sum(d.kind != KIND for d in report.decisions) == len(plain.decisions)
    assert report.totals()["gemms"] == plain.totals()["gemms"]  # the totals and summary count GEMMs only


def test_matches_hugging_face_llama_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, hidden_act="silu")
    torch.manual_seed(0)
    mlp = LlamaMLP(config)
    report = mxcompile.explain(mlp, torch.randn(2, 16, 64), config=MXConfig(smooth_swiglu=True))
    rows = _swiglu_rows(report)
    assert [(d.decision, d.module) for d in rows] == [(SMOOTHED, "down_proj")], rows
    assert "(gate_proj, up_proj)" in rows[0].reason


def test_not_matched_elsewhere():
    x = torch.randn(2, 16, 64, requires_grad=True)
    on = MXConfig(smooth_swiglu=True)
    # no product feeds a GEMM: not a candidate, no row
    assert _swiglu_rows(mxcompile.explain(GeluMLP(), x, config=on)) == []
    assert _swiglu_rows(mxcompile.explain(nn.Linear(64, 64), x, config=on)) == []
    # GeGLU: a gated product, but not silu
    rows = _swiglu_rows(mxcompile.explain(SwiGLU(64, 128, activation=F.gelu), x, config=on))
    assert [d.decision for d in rows] == [NOT_SMOOTHED] and "not silu" in rows[0].reason, rows
    # the two projections read different inputs
    rows = _swiglu_rows(mxcompile.explain(TwoInputGLU(64, 128), x, torch.randn(2, 16, 64), config=on))
    assert [d.decision for d in rows] == [NOT_SMOOTHED] and "different inputs" in rows[0].reason, rows
    # the down projection is excluded from MX: nothing to improve, recorded with the reason
    rows = _swiglu_rows(mxcompile.explain(SwiGLU(64, 128), x, config=on.replace(exclude=("w2",))))
    assert [d.decision for d in rows] == [NOT_SMOOTHED] and "exclude pattern" in rows[0].reason, rows


# (2) The same function.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_function_exactly_without_mx(monkeypatch, dtype):
    """With only this pass in the pipeline (no MX anywhere) the scaled down projection is bit for
    bit the original one: output and every gradient, on a model whose channel scales differ."""
    model, x = _model(outlier=1e4, compensate=True).to(dtype), torch.randn(TOKENS, D, dtype=dtype)
    monkeypatch.setattr(passes, "PIPELINE", (("smooth_swiglu", smooth_swiglu),))
    y0, g0, _ = _train_step(model, x, MXConfig())
    y1, g1, report = _train_step(model, x, MXConfig(smooth_swiglu=True))
    assert [d.decision for d in _swiglu_rows(report)] == [SMOOTHED]
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_same_function_exactly_with_mx_excluded():
    model, x = _model(outlier=1e4, compensate=True), torch.randn(TOKENS, D)
    y0, g0, _ = _train_step(model, x, MXConfig(exclude=(".*",)))
    y1, g1, report = _train_step(model, x, MXConfig(exclude=(".*",), smooth_swiglu=True))
    assert [d.decision for d in _swiglu_rows(report)] == [NOT_SMOOTHED]
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


# MX tolerance of one training step against the option-off run. Measured (relative norm of the
# difference, compensated outlier column): output 3.7e-7 (no outlier) and 2.4e-4 (x1000);
# gradients 0 and 5.3e-3..6.0e-3; 1.4e-2..3.3e-2 at x1e4. Each run is itself 6.4% (output) and
# 7.0-7.6% (gradients) from eager fp32, with or without the option: the difference is MX noise.
MX_RELATIVE_TOLERANCE = 0.05
FP32_RELATIVE_TOLERANCE = 0.1


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("outlier", [1.0, 1e3, 1e4])
def test_loss_and_gradients_match_the_option_off_run_within_mx_tolerance(outlier):
    model, x = _model(outlier=outlier, compensate=True), torch.randn(TOKENS, D)
    y_ref, g_ref, _ = _train_step(model, x, None)
    y_off, g_off, _ = _train_step(model, x, MXConfig())
    y_on, g_on, report = _train_step(model, x, MXConfig(smooth_swiglu=True))
    assert [d.decision for d in _swiglu_rows(report)] == [SMOOTHED]
    assert _relative(y_on, y_off) < MX_RELATIVE_TOLERANCE
    assert _relative(y_on.square().mean(), y_off.square().mean()) < MX_RELATIVE_TOLERANCE
    assert _relative(y_on, y_ref) < FP32_RELATIVE_TOLERANCE
    for name in g_ref:
        assert _relative(g_on[name], g_off[name]) < MX_RELATIVE_TOLERANCE, name
        # w2's gradient is the gradient of the original w2, as eager autograd gives it
        assert _relative(g_on[name], g_ref[name]) < FP32_RELATIVE_TOLERANCE, name


def test_dynamic_token_count_and_inference_graph():
    model = _model(outlier=1e4, compensate=True)
    report = Report(config={})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(MXConfig(smooth_swiglu=True), report), dynamic=True)
    torch._dynamo.reset()
    for tokens in (64, 96):
        x = torch.randn(tokens, D)
        assert _relative(compiled(x).detach(), model(x).detach()) < FP32_RELATIVE_TOLERANCE
    with torch.no_grad():
        x = torch.randn(80, D)
        assert _relative(compiled(x), model(x)) < FP32_RELATIVE_TOLERANCE
    rows = _swiglu_rows(report)
    assert {d.graph for d in rows} == {"forward", "inference"} and all(d.decision == SMOOTHED for d in rows), rows


# (3) What it does to the down projection's MX rounding. w1 and w3 stay in fp32, so that H is
# exact and the SQNR is the down projection's own.

DOWN_ONLY = (r"^w1$", r"^w3$")


def _down_projection_sqnr(outlier: float, compensate: bool) -> tuple[float, float]:
    model, x = _model(outlier=outlier, compensate=compensate), torch.randn(TOKENS, D)
    reference = model(x).detach()
    off = _train_step(model, x, MXConfig(exclude=DOWN_ONLY))[0]
    on = _train_step(model, x, MXConfig(exclude=DOWN_ONLY, smooth_swiglu=True))[0]
    return sqnr_db(reference, off), sqnr_db(reference, on)


def test_outlier_channel_sharing_blocks_improves_sqnr():
    """An outlier channel 1e5x the others whose weight column is 1e5x smaller (so the output is
    not the outlier's alone): without the option the outlier's 31 neighbours in each block of H
    fall below e4m3's range; with it they keep their precision. Measured: 25.2 dB -> 28.4 dB."""
    off, on = _down_projection_sqnr(1e5, compensate=True)
    assert on > off + 2.0, (off, on)
    assert on > 28.0, (off, on)


def test_outlier_within_e4m3_range_changes_nothing_measurable():
    """A channel 1000x the others: MX's per-block scales already hold it (e4m3 spans 2^15 within a
    block), so the option changes the down projection's SQNR by less than 0.01 dB (measured 28.39
    dB with the column compensated, 28.82 dB without, both with and without the option): the
    outlier's own product dominates the output and its relative rounding is the same either way."""
    for compensate in (True, False):
        off, on = _down_projection_sqnr(1e3, compensate)
        assert abs(on - off) < 0.01, (compensate, off, on)


# (4) Off by default.

def test_off_by_default():
    assert MXConfig().smooth_swiglu is False
    assert MXConfig.from_options({"smooth_swiglu": True}).smooth_swiglu is True
    with pytest.raises(ValueError, match="smooth_swiglu"):
        MXConfig(smooth_swiglu="yes")
    assert "smooth_swiglu" in [name for name, _ in passes.PIPELINE]
    names = [name for name, _ in passes.PIPELINE]
    assert names.index("smooth_swiglu") < names.index("gemm_rewrite")
    report = mxcompile.explain(SwiGLU(64, 128), torch.randn(2, 16, 64, requires_grad=True))
    assert _swiglu_rows(report) == []
    assert any(p.name == "smooth_swiglu" and p.nodes_added == 0 for p in report.passes)
