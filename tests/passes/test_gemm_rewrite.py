"""The GEMM rewrite pass: which GEMMs are converted, along which axes, and why not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mxcompile
from mxcompile.config import MXConfig
from mxcompile.examples import gpt_factory
from mxcompile.report import CONVERTED, KEPT

M, K, N = 160, 64, 96  # distinct lengths, so that every axis is identifiable


def _by_kind(report):
    return {d.kind: d for d in report.decisions}


def test_linear_layer_gets_the_three_recipe_gemms_with_their_axes():
    layer = nn.Linear(K, N, bias=True)
    x = torch.randn(M, K, requires_grad=True)
    report = mxcompile.explain(layer, x)
    kinds = _by_kind(report)
    assert set(kinds) == {"output", "input_grad", "weight_grad"}
    assert all(d.decision == CONVERTED for d in report.decisions)

    def contraction(decision):
        lhs, rhs = decision.operands
        assert lhs.shape[lhs.axis] == rhs.shape[rhs.axis]
        return lhs.shape[lhs.axis], (lhs.axis, rhs.axis)

    # Y = X Wt: X (M, K) and Wt (K, N) along K.
    assert contraction(kinds["output"]) == (K, (1, 0))
    assert kinds["output"].shapes == ((M, K), (K, N))
    # dX = dY W: dY (M, N) and W (N, K) along N.
    assert contraction(kinds["input_grad"]) == (N, (1, 0))
    assert kinds["input_grad"].shapes == ((M, N), (N, K))
    # dW = dYt X: dYt (N, M) and X (M, K) along M, the token axis.
    assert contraction(kinds["weight_grad"]) == (M, (1, 0))
    assert kinds["weight_grad"].shapes == ((N, M), (M, K))
    assert all(d.flops == 2 * M * N * K for d in report.decisions)


def test_rewritten_graphs_contain_mx_ops_and_no_converted_aten_gemm():
    layer = nn.Linear(K, N, bias=False)
    report = mxcompile.explain(layer, torch.randn(M, K, requires_grad=True))
    graphs = {g.name: g for g in report.graphs}
    for name in ("forward", "backward"):
        assert "aten.mm" in graphs[name].before
        assert "mxcompile.mx_mm" in graphs[name].after
        assert "aten.mm" not in graphs[name].after
    assert graphs["backward"].after.count("mxcompile.mx_mm") == 2


@pytest.mark.parametrize("k, padded", [(48, 64), (31, 32), (17, 32)])
def test_contraction_not_divisible_by_block_is_zero_padded(k, padded):
    layer = nn.Linear(k, 64, bias=False)
    report = mxcompile.explain(layer, torch.randn(64, k, requires_grad=True))
    kinds = _by_kind(report)
    assert kinds["output"].decision == CONVERTED
    assert f"K={k} zero-padded to {padded}" in kinds["output"].reason
    # dX contracts over N=64 and dW over M=64: no padding.
    assert kinds["input_grad"].decision == CONVERTED and "K=64)" in kinds["input_grad"].reason
    assert kinds["weight_grad"].decision == CONVERTED and "K=64)" in kinds["weight_grad"].reason
    forward = next(g.after for g in report.graphs if g.name == "forward")
    assert forward.count("aten.constant_pad_nd") == 2  # both operands of Y = X Wt


@pytest.mark.parametrize("k", [16, 4])
def test_contraction_whose_padding_would_double_the_work_stays_high_precision(k):
    layer = nn.Linear(k, 64, bias=False)
    report = mxcompile.explain(layer, torch.randn(64, k, requires_grad=True))
    kinds = _by_kind(report)
    assert kinds["output"].decision == KEPT
    assert f"contraction length {k} pads to 32 (block_size=32)" in kinds["output"].reason
    assert kinds["input_grad"].decision == CONVERTED
    assert kinds["weight_grad"].decision == CONVERTED


def test_include_exclude_min_flops_and_hp_weight_grad_are_recorded():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    report = mxcompile.explain(model, x, config=MXConfig(exclude=(r"^2$",)))
    kept = [d for d in report.decisions if d.decision == KEPT]
    assert kept and all(d.module == "2" and "exclude pattern" in d.reason for d in kept)

    report = mxcompile.explain(model, x, config=MXConfig(include=(r"^0$",)))
    assert {d.module for d in report.decisions if d.decision == CONVERTED} == {"0"}

    report = mxcompile.explain(model, x, config=MXConfig(min_gemm_flops=10**9))
    assert all(d.decision == KEPT and "min_gemm_flops" in d.reason for d in report.decisions)

    report = mxcompile.explain(model, x, config=MXConfig(hp_weight_grad=True))
    for d in report.decisions:
        assert (d.decision == KEPT) == (d.kind == "weight_grad"), d


def test_gradient_operands_take_the_gradient_format():
    layer = nn.Linear(K, N, bias=False)
    report = mxcompile.explain(layer, torch.randn(M, K, requires_grad=True),
                               config=MXConfig(grad_elem="e5m2"))
    kinds = _by_kind(report)
    assert [o.elem for o in kinds["output"].operands] == ["e4m3", "e4m3"]
    assert [o.elem for o in kinds["input_grad"].operands] == ["e5m2", "e4m3"]
    assert [o.elem for o in kinds["weight_grad"].operands] == ["e5m2", "e4m3"]


def test_every_gpt_gemm_is_converted_forward_and_backward():
    model, (idx,) = gpt_factory("tiny")
    report = mxcompile.explain(model, idx)
    assert report.converted_flop_fraction == 1.0
    kinds = {(d.graph, d.kind) for d in report.decisions}
    assert kinds >= {("forward", "output"), ("backward", "input_grad"), ("backward", "weight_grad")}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    outputs = [d for d in report.decisions if d.kind == "output" and d.op == "aten.mm.default"]
    assert len(outputs) == len(linears)
    # The MX copy is what the backward keeps: saved activations shrink.
    assert report.saved_bytes_after < report.saved_bytes_before
    assert any(t["dtype"] == "torch.float8_e4m3fn" for t in report.saved_tensors_after)


def test_batched_gemms_are_converted_along_their_contraction_axis():
    a = torch.randn(4, 64, 96, requires_grad=True)
    b = torch.randn(4, 96, 32, requires_grad=True)
    report = mxcompile.explain(lambda x, y: torch.bmm(x, y), a, b)
    forward = [d for d in report.decisions if d.graph == "forward"]
    assert len(forward) == 1 and forward[0].decision == CONVERTED
    lhs, rhs = forward[0].operands
    assert (lhs.axis, rhs.axis) == (2, 1) and lhs.shape[2] == rhs.shape[1] == 96


def test_explain_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mxcompile.explain(model, torch.randn(32, 64))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
