"""mxcompile.coverage on one process: `Module.compile(backend=...)` on torch.nn modules never
reaches the backend (torch 2.13), `uncompiled_linears` names those layers with the usage that
works, `mxcompile.compile` warns once, and the usage it names trains in MX."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mxcompile
from mx_testing import MXLinearFunction, eager_mxfp8_backend
from mxcompile.coverage import Usage, uncompiled_linears, warn_uncompiled

GRAD_RTOL = 1e-5
MX_VS_FP32_MIN = 1e-2  # e4m3 keeps 3 mantissa bits: MX gradients differ from fp32 by about 6e-2
ROWS = 32


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


def _recording_backend(calls: list):
    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("build", [lambda: nn.Linear(128, 128), _sequential], ids=["linear", "sequential"])
def test_module_compile_on_torch_nn_never_calls_the_backend_and_is_named(build):
    module = build()
    calls: list = []
    module.compile(backend=_recording_backend(calls))
    module(torch.randn(ROWS, 128)).sum().backward()
    assert calls == []  # torch's behaviour that makes the check necessary
    found = uncompiled_linears(module)
    assert [u.module for u in found] == (["0", "2"] if isinstance(module, nn.Sequential) else [""])
    assert all(u.usage is Usage.MODULE_COMPILE and "torch.compile(model" in u.fix for u in found)


def test_user_forward_and_torch_compile_are_not_named():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _sequential()

        def forward(self, x):
            return self.body(x)

    net = Net()
    net.compile(backend="eager")  # a user forward is traced: Module.compile works here
    assert uncompiled_linears(net) == []
    assert uncompiled_linears(torch.compile(_sequential(), backend="eager")) == []
    assert uncompiled_linears(_sequential()) == []  # nothing compiled, nothing expected
    assert uncompiled_linears(_sequential(), compiled=True) == []


def test_warning_names_the_module_once():
    module = nn.Linear(128, 128)
    module.compile(backend="mxfp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_uncompiled(module)
    assert len(caught) == 1
    assert "Module.compile" in str(caught[0].message) and "<root>" in str(caught[0].message)


def test_mxcompile_compile_of_a_sequential_warns_nothing_and_trains_in_mx():
    """The usage the warning names (torch.compile(module)) on the issue's nn.Sequential:
    gradients equal the independent MX emulation and differ from fp32."""
    model, plain = _sequential(), _sequential()
    x = torch.randn(ROWS, 128, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mxcompile.compile must not warn here
        mxcompile.compile(_sequential())
    torch.compile(model, backend=eager_mxfp8_backend())(x).square().mean().backward()
    plain(x).square().mean().backward()

    def emulated(x):
        hidden = nn.functional.gelu(MXLinearFunction.apply(x, plain[0].weight, plain[0].bias))
        return MXLinearFunction.apply(hidden, plain[2].weight, plain[2].bias)

    fp32 = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.zero_grad()
    emulated(x).square().mean().backward()
    for name, param in model.named_parameters():
        mx_grad, ref = param.grad, dict(plain.named_parameters())[name].grad
        assert ((mx_grad - ref).norm() / ref.norm()).item() <= GRAD_RTOL, name
        assert ((mx_grad - fp32[name]).norm() / fp32[name].norm()).item() > MX_VS_FP32_MIN, name
