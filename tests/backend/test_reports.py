"""What the backend did while training: every compiled graph's report is kept (bounded), found by
model, logged in one line, and a graph that keeps more than 5% of its GEMM FLOPs warns once.
The graphs run eagerly (the recording path is the same one `backend="mxfp8"` takes)."""

from __future__ import annotations

import functools
import gc
import logging
import math
import warnings

import pytest
import torch
import torch.nn as nn

import mxcompile
from mxcompile.backend import compile_and_record
from mxcompile.config import MXConfig
from mxcompile.lowering import eager_compiler
from mxcompile.report import CONVERTED, Report, ReportHistory


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _recording_backend(config: MXConfig = MXConfig()):
    return functools.partial(compile_and_record, config=config, lower=eager_compiler)


def _step(compiled, x):
    compiled(x).sum().backward()


@pytest.fixture(autouse=True)
def _empty_history():
    mxcompile.clear_reports()
    yield
    mxcompile.clear_reports()


def test_each_compile_leaves_a_report_found_by_its_model(caplog):
    torch.manual_seed(0)
    a, b = TwoLinear(), TwoLinear()
    x = torch.randn(32, 64)
    with caplog.at_level(logging.INFO, logger="mxcompile"):
        compiled_a = torch.compile(a, backend=_recording_backend())
        _step(compiled_a, x)
        _step(torch.compile(b, backend=_recording_backend()), x)
        a.eval()
        with torch.no_grad():
            compiled_a(x)  # recompiles: an inference graph
    every = mxcompile.reports()
    of_a, of_b = mxcompile.report_of(compiled_a), mxcompile.report_of(b)
    assert len(every) == 3 and len(of_a) == 2 and len(of_b) == 1
    assert every[0] is of_a[0] and every[1] is of_b[0] and every[2] is of_a[1]
    assert {d.graph for d in of_a[0].decisions} == {"forward", "backward"}
    assert {d.graph for d in of_a[1].decisions} == {"inference"}
    assert all(r.converted_flop_fraction == 1.0 for r in every)
    messages = [r.getMessage() for r in caplog.records if r.name == "mxcompile"]
    lines = [m for m in messages if m.startswith("mxcompile: compiled graph")]
    assert len(lines) == 3
    # one step each, the one that compiles: not measured (step_coverage.py measures the next one)
    assert not [m for m in messages if m.startswith("mxcompile: the step: ")], messages
    assert lines[0].startswith("mxcompile: compiled graph 0: forward+backward: 5 of 5 GEMMs in MXFP8, 100.0%")
    assert lines[0].endswith("0 kept")


def test_a_graph_keeping_over_5_percent_warns_once_with_its_top_reasons():
    torch.manual_seed(0)
    model = TwoLinear()
    compiled = torch.compile(model, backend=_recording_backend(MXConfig(exclude=("fc2",))))
    x = torch.randn(32, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # one compile, so one warning
            _step(compiled, x)
    kept_warnings = [w for w in caught if issubclass(w.category, mxcompile.MXKeptWarning)]
    assert len(kept_warnings) == 1
    message = str(kept_warnings[0].message)
    (report,) = mxcompile.report_of(model)
    assert 0.05 < 1 - report.converted_flop_fraction < 1
    assert "module 'fc2' matches exclude pattern 'fc2'" in message and "3 GEMMs" in message


class _SevenLinear(nn.Module):
    """Six linear layers, an attention and an lm_head: nvfp4's defaults keep round(0.15 * 6) = 1
    layer and the lm_head in high precision (its high_precision_layers), and the attention
    (attention="off"), over 5% of the GEMM FLOPs. The attention is SDPA, or written out
    (softmax(Q Kᵀ / sqrt(d)) V: the eager softmax form HF's attn_implementation="eager" runs)."""

    def __init__(self, eager_attention: bool = False):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
        self.lm_head = nn.Linear(64, 64, bias=False)
        self.eager_attention = eager_attention

    def forward(self, x):
        heads = self.layers(x).view(1, -1, 2, 32).transpose(1, 2)  # (batch, heads, tokens, head_dim)
        if self.eager_attention:
            scores = torch.matmul(heads, heads.transpose(-2, -1)) / math.sqrt(heads.shape[-1])
            attended = torch.matmul(torch.softmax(scores, dim=-1), heads)
        else:
            attended = nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
        return self.lm_head(attended.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("exclude, eager_attention", [((), False), (("layers.0",), False), ((), True)])
def test_an_fp4_recipes_own_high_precision_layers_do_not_warn(exclude, eager_attention):
    """What the nvfp4 recipe keeps by design (its high-precision layers, attention under its
    default attention="off", SDPA or written out) is no reason to warn (it warned on every nvfp4
    compile, and on eager softmax attention until its reason began with the recipe's); a layer
    kept for another reason still warns, naming that reason only."""
    torch.manual_seed(0)
    model = _SevenLinear(eager_attention)
    config = MXConfig.for_recipe("nvfp4", {"exclude": exclude})
    compiled = torch.compile(model, backend=_recording_backend(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(compiled, torch.randn(32, 64))
    (report,) = mxcompile.report_of(model)
    assert report.gemm_flops_kept_by_recipe > 0.05 * report.gemm_flops_total
    messages = [str(w.message) for w in caught if issubclass(w.category, mxcompile.MXKeptWarning)]
    if not exclude:
        assert messages == []
    else:
        (message,) = messages
        assert "exclude pattern 'layers.0'" in message and "besides the" in message
        reasons = message.split("top reasons:")[1]
        assert "high_precision_layers=" not in reasons and "attention=" not in reasons


def test_a_fully_converted_graph_does_not_warn():
    torch.manual_seed(0)
    compiled = torch.compile(TwoLinear(), backend=_recording_backend())
    with warnings.catch_warnings():
        warnings.simplefilter("error", mxcompile.MXKeptWarning)
        _step(compiled, torch.randn(32, 64))
    assert all(d.decision == CONVERTED for d in mxcompile.reports()[0].decisions)


def test_history_is_bounded_and_holds_no_tensor_alive():
    history = ReportHistory(capacity=2)
    reports = [Report({}) for _ in range(3)]
    weight = torch.zeros(4)
    indices = [history.record(r, [weight])[0] for r in reports]
    assert indices == [0, 1, 2]
    assert history.all() == reports[1:]
    module = nn.Linear(4, 4)
    history.record(reports[0], list(module.parameters()))
    assert history.of_module(module) == [reports[0]]
    del module
    gc.collect()
    history.record(Report({}), [torch.zeros(4)])  # a fresh tensor may reuse a freed id
    assert all(not r.decisions for r in history.all())
    with pytest.raises(ValueError, match="capacity"):
        ReportHistory(capacity=0)


def test_report_of_rejects_what_is_not_a_module():
    with pytest.raises(ValueError, match="nn.Module"):
        mxcompile.report_of(lambda x: x)


def test_report_of_finds_the_shared_graph_from_every_block_of_a_per_block_compile():
    """torchtitan's `block.compile(...)`: one graph serves every block of the same shape."""
    torch._dynamo.reset()
    mxcompile.clear_reports()
    blocks = nn.Sequential(TwoLinear(), TwoLinear())
    backend = _recording_backend()
    for block in blocks:
        block.compile(backend=backend)
    _step(blocks, torch.randn(64, 64, requires_grad=True))  # every block's input needs a gradient
    first, second = mxcompile.report_of(blocks[0]), mxcompile.report_of(blocks[1])
    assert len(mxcompile.reports()) == 1, "the blocks were meant to share one graph"
    assert first and second == first


def test_a_graph_without_gemms_says_so():
    torch._dynamo.reset()
    mxcompile.clear_reports()
    compiled = torch.compile(lambda x: (x * 2).sin(), backend=_recording_backend())
    compiled(torch.randn(8, requires_grad=True)).sum().backward()
    (report,) = mxcompile.reports()
    assert report.summary() == "no GEMMs in this graph: nothing to run in MXFP8"
