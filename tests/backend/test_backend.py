"""The mxfp8 backend end to end: entry point, numerics against an independent emulation,
dynamic shapes, graph breaks, non-finite values, fallbacks and the user's model left intact."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxcompile
import mxcompile.passes as passes
from mx_testing import MXLinearFunction, eager_mxfp8_backend, sqnr_db
from mxcompile.config import MXConfig
from mxcompile.report import CONVERTED, Report

SQNR_TARGET_DB = 25.0
MLP_GRAD_SQNR_DB = 22.0
# Inputs whose rows span 2**8 in magnitude: dW quantizes X along the token axis, so a block of
# 32 tokens shares one scale across rows of very different size (the recipe's known weak spot).
OCTAVE_GRAD_SQNR_DB = 15.0


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 96)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# GELU, not ReLU: ReLU's mask flips wherever MX error moves a pre-activation across zero, which
# on its own costs about 16 dB of input-gradient SQNR against fp32 whatever the GEMM precision.
def _emulated_two_linear(model: TwoLinear, x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(MXLinearFunction.apply(x, model.fc1.weight, model.fc1.bias))
    return MXLinearFunction.apply(h, model.fc2.weight, model.fc2.bias)


# The compiled MX graph against the independent emulation: equal but for rare FP8 rounding flips
# (seen: 123 dB at batch 96, 11 of 9216 outputs off; inf at the others). MX against unquantized
# fp32 is 25-30 dB here, so 60 dB still tells the MX numerics apart from anything else.
EMULATION_AGREEMENT_DB = 60.0


def _run(model, x, params=None):
    """Output, input gradient and parameter gradients of one forward+backward."""
    params = list(params if params is not None else model.parameters())
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return y.detach(), x.grad, grads


def _octave_data(shape, seed):
    """Magnitudes spread over several octaves along rows and columns (see FACTS.md)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-4, 5, (shape[0], 1), generator=g).float())
    cols = torch.exp2(torch.randint(-4, 5, (1, shape[1]), generator=g).float())
    return torch.randn(shape, generator=g) * rows * cols


@pytest.fixture(scope="module")
def two_linear():
    torch.manual_seed(0)
    return TwoLinear()


def test_inductor_compiled_matches_eager_mx_emulation_and_fp32_sqnr(two_linear):
    """Output, input gradient and weight gradients of the Inductor-compiled mxfp8 step equal an
    eager MX emulation (same quantization, fp32 GEMMs) up to fp32 accumulation order.
    Against fp32 the output stays >= 25 dB; on these octave-spread inputs gradients measured
    20.8 dB (dX) and 17.7 dB (worst dW)."""
    x = _octave_data((256, 64), seed=1)
    compiled = torch.compile(two_linear, backend="mxfp8")
    y_c, dx_c, dw_c = _run(compiled, x)
    y_e, dx_e, dw_e = _run(lambda t: _emulated_two_linear(two_linear, t), x, two_linear.parameters())
    y_r, dx_r, dw_r = _run(two_linear, x)
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_c, dx_e, rtol=1e-5, atol=1e-5)
    for got, want in zip(dw_c, dw_e):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert sqnr_db(y_r, y_c) >= SQNR_TARGET_DB
    assert sqnr_db(dx_r, dx_c) >= OCTAVE_GRAD_SQNR_DB
    for ref, got in zip(dw_r, dw_c):
        assert sqnr_db(ref, got) >= OCTAVE_GRAD_SQNR_DB


def test_fp32_sqnr_on_the_mlp_example_forward_and_backward():
    """Three MX layers deep, measured: output 25.4 dB, input gradient 23.8 dB, weight gradients
    23.4-24.0 dB (error grows with depth in the backward). Asserted: 25 dB out, 22 dB grads."""
    from mxcompile.examples import mlp_factory

    model, (x,) = mlp_factory("tiny")
    reference = _run(model, x)
    rewritten = _run(torch.compile(model, backend=eager_mxfp8_backend()), x)
    assert sqnr_db(reference[0], rewritten[0]) >= SQNR_TARGET_DB
    assert sqnr_db(reference[1], rewritten[1]) >= MLP_GRAD_SQNR_DB
    for ref, got in zip(reference[2], rewritten[2]):
        assert sqnr_db(ref, got) >= MLP_GRAD_SQNR_DB


def test_rewrite_is_real_not_a_passthrough(two_linear):
    """Guards the tests above: the rewritten model differs from fp32 by MX-sized error."""
    x = _octave_data((64, 64), seed=2)
    y_r = two_linear(x)
    y_c = torch.compile(two_linear, backend=eager_mxfp8_backend())(x)
    assert 20 < sqnr_db(y_r, y_c) < 45


def test_dynamic_batch_gives_correct_results_without_recompiling(two_linear):
    """One graph with a symbolic batch serves every batch, computing what a graph compiled for
    that batch computes; and it is the MX emulation up to FP8 rounding flips (a last-bit
    difference of fp32 accumulation order can move a value across an FP8 rounding boundary, so
    the emulation is compared by SQNR, not elementwise)."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend(eager_mxfp8_backend())
    compiled = torch.compile(two_linear, backend=counter, dynamic=True)
    for batch in (96, 160, 224):  # not 64: duck sizing would tie the batch to in_features
        x = _octave_data((batch, 64), seed=batch)
        y_c, dx_c, grads_c = _run(compiled, x)
        static = torch.compile(two_linear, backend=eager_mxfp8_backend(), dynamic=False)
        y_s, dx_s, grads_s = _run(static, x)
        torch.testing.assert_close(y_c, y_s, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_s, rtol=0, atol=0)
        for got, want in zip(grads_c, grads_s):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        y_e, dx_e, _ = _run(lambda t: _emulated_two_linear(two_linear, t), x, two_linear.parameters())
        assert min(sqnr_db(y_e, y_c), sqnr_db(dx_e, dx_c)) >= EMULATION_AGREEMENT_DB, (sqnr_db(y_e, y_c), sqnr_db(dx_e, dx_c))
    assert counter.frame_count == 1


def test_fullgraph_on_the_examples():
    from mxcompile.examples import gpt_factory, mlp_factory

    for model, inputs in (gpt_factory("tiny"), mlp_factory("tiny")):
        report = Report({})
        compiled = torch.compile(model, backend=eager_mxfp8_backend(report=report), fullgraph=True)
        compiled(*inputs).float().sum().backward()  # fullgraph: a graph break raises
        # The one graph went through the pipeline: its GEMMs were converted, and every
        # parameter got a finite gradient from the rewritten backward.
        assert any(d.decision == CONVERTED for d in report.decisions), report.decisions
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_graph_breaks_leave_each_piece_rewritten():
    class Breaking(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            x = self.a(x)
            print("", end="")  # a graph break
            if x.sum() > 0:  # data-dependent control flow
                x = x * 2
            return self.b(x)

    torch.manual_seed(0)
    model = Breaking()
    x = _octave_data((32, 64), seed=3)
    report = Report({})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(report=report))
    y = compiled(x)
    assert {d.module for d in report.decisions if d.decision == "mxfp8"} == {"a", "b"}
    assert sqnr_db(model(x), y) >= SQNR_TARGET_DB


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_and_weights_propagate(two_linear, bad):
    x = _octave_data((32, 64), seed=4)
    x[3, 5] = bad
    compiled = torch.compile(copy.deepcopy(two_linear), backend=eager_mxfp8_backend())
    y, dx, _ = _run(compiled, x)
    assert not torch.isfinite(y[3]).any()
    assert torch.isfinite(y[:3]).all()
    model = copy.deepcopy(two_linear)
    with torch.no_grad():
        model.fc2.weight[7, 0] = bad
    y = torch.compile(model, backend=eager_mxfp8_backend())(_octave_data((32, 64), seed=5))
    assert not torch.isfinite(y[:, 7]).any()


def test_user_model_is_never_changed_and_checkpoints_round_trip(two_linear):
    model = copy.deepcopy(two_linear)
    params = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()}
    modules = list(model.modules())
    compiled = torch.compile(model, backend=eager_mxfp8_backend())
    compiled(torch.randn(32, 64))
    assert {n: p for n, p in model.named_parameters()} == params
    assert list(model.modules()) == modules
    assert all(torch.equal(values[n], p) for n, p in model.named_parameters())
    buffer = io.BytesIO()
    torch.save(compiled.state_dict(), buffer)
    buffer.seek(0)
    fresh = TwoLinear()
    fresh.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in torch.load(buffer).items()})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_recompiling_with_another_config_takes_the_new_config(two_linear):
    x = torch.randn(32, 64)
    first, second = Report({}), Report({})
    torch.compile(two_linear, backend=eager_mxfp8_backend(MXConfig(), first))(x)
    torch.compile(two_linear, backend=eager_mxfp8_backend(MXConfig(exclude=("fc1",)), second))(x)
    assert all(d.decision == "mxfp8" for d in first.decisions)
    assert {d.module for d in second.decisions if d.decision == "kept"} == {"fc1"}


def _failing_pass(gm, config, graph_name):
    raise RuntimeError("boom at node addmm")


def test_a_failing_pass_falls_back_with_a_warning_or_raises(two_linear, monkeypatch):
    monkeypatch.setattr(passes, "PIPELINE", (("exploding_pass", _failing_pass),))
    x = torch.randn(32, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(two_linear, backend=eager_mxfp8_backend())(x)
    assert any("exploding_pass" in str(w.message) for w in caught)
    torch.testing.assert_close(y, two_linear(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="exploding_pass.*boom at node addmm"):
        torch.compile(two_linear, backend=eager_mxfp8_backend(MXConfig(fallback=False)))(x)


def test_inference_graphs_go_through_the_same_passes(two_linear):
    report = Report({})
    with torch.no_grad():
        torch.compile(two_linear, backend=eager_mxfp8_backend(report=report))(torch.randn(32, 64))
    assert [d.graph for d in report.decisions] == ["inference", "inference"]
    assert all(d.decision == "mxfp8" for d in report.decisions)


def test_options_map_onto_mxconfig_and_bad_options_list_what_is_accepted(two_linear):
    with pytest.raises(Exception, match="unknown mxfp8 option.*accepted options"):
        torch.compile(two_linear, backend="mxfp8", options={"scale": "floor"})(torch.randn(8, 64))
    with pytest.raises(ValueError, match="give either config or options"):
        mxcompile.backend.mxfp8_backend(None, [], options={"block_size": 32}, config=MXConfig())
    with pytest.raises(ValueError, match="sets backend and options itself"):
        mxcompile.compile(two_linear, backend="inductor")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_compiling_a_cpu_graph_starts_building_the_native_kernels(monkeypatch, device):
    """The backend starts the quantize ops' native CPU kernels' build in the background when it
    compiles a graph with CPU inputs (it then overlaps the compilation), and not otherwise."""
    import torch.fx as fx

    import mxcompile.backend as backend
    from mxcompile.ops.native import build

    started = []
    monkeypatch.setattr(build, "build_in_background", lambda: started.append(True))
    monkeypatch.setattr(backend, "compile_and_record", lambda gm, inputs, config: gm)  # no compile
    gm = fx.symbolic_trace(lambda x: x * 2)
    assert backend.mxfp8_backend(gm, [torch.ones(2, device=device)]) is gm
    assert started == ([True] if device == "cpu" else [])
