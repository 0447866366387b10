"""mxcompile.profiling.layer_error: SQNR, block statistics, per-layer errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mxcompile
from mxcompile.examples import get_example
from mxcompile.numerics import E4M3
from mxcompile.profiling.layer_error import block_stats, linear_errors, sqnr_db

BLOCK = 32


def test_sqnr_db() -> None:
    ref = torch.ones(100)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(torch.zeros(4), torch.ones(4)) is None
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)  # noise is 10% of the signal


def test_block_stats_flush_and_scale_range_along_the_right_axis() -> None:
    # Column 0 holds a huge value in every row: along axis 1 each row's block has it, so tiny
    # elements in the same row underflow; along axis 0 the columns are separate blocks.
    x = torch.full((BLOCK, BLOCK), 2.0**-20)
    x[:, 0] = 2.0**10
    along_rows = block_stats(x, 1, E4M3, "rceil", BLOCK, role="X", axis_name="K")
    along_cols = block_stats(x, 0, E4M3, "rceil", BLOCK, role="X", axis_name="M")
    assert along_rows.flushed_fraction == pytest.approx((BLOCK - 1) / BLOCK)
    assert along_cols.flushed_fraction == 0.0
    assert along_cols.min_scale_exponent < along_rows.min_scale_exponent
    assert along_rows.saturated_block_fraction == 0.0  # rceil never saturates


def test_floor_scales_can_saturate() -> None:
    x = torch.full((1, BLOCK), 1.0)
    x[0, 0] = 480.0  # 480 / 2**floor(log2 480) - 8 = 480 > 448
    stats = block_stats(x, 1, E4M3, "floor", BLOCK, role="X", axis_name="K")
    assert stats.saturated_block_fraction == 1.0


def test_linear_errors_follow_the_report() -> None:
    model, inputs = get_example("mlp")()
    config = mxcompile.MXConfig(exclude=("layers.2",))
    report = mxcompile.explain(model, *inputs, config=config)
    layers = linear_errors(model, inputs, config, report)
    assert [layer.module for layer in layers] == ["layers.0.linear", "layers.1.linear", "layers.2.linear"]
    by_module = {layer.module: {g.kind: g for g in layer.gemms} for layer in layers}
    assert by_module["layers.0.linear"]["input_grad"].status == "absent"  # the input needs no grad
    assert {g.status for g in by_module["layers.2.linear"].values()} == {"kept"}
    measured = by_module["layers.1.linear"]
    for kind in ("output", "input_grad", "weight_grad"):
        assert measured[kind].status == "measured"
        assert 20.0 < measured[kind].sqnr_db < 40.0  # e4m3: about 3 mantissa bits
    assert all(p.grad is None for p in model.parameters())


def test_linear_errors_without_report_checks_divisibility() -> None:
    model = nn.Linear(48, 32)
    layers = linear_errors(model, (torch.randn(32, 48),))
    kinds = {g.kind: g for g in layers[0].gemms}
    assert kinds["output"].status == "not_divisible"
    assert kinds["weight_grad"].status == "measured"


def test_all_zero_blocks_do_not_widen_the_scale_range() -> None:
    x = torch.zeros(2, BLOCK)
    x[0] = 1.0
    stats = block_stats(x, 1, E4M3, "rceil", BLOCK, role="dY", axis_name="N")
    assert stats.min_scale_exponent == stats.max_scale_exponent == -8  # 1.0 / 448 rounds up to 2**-8
