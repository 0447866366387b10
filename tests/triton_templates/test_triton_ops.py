"""The triton_op registrations and the lowering hook.

Eager: on CPU tensors under the interpreter the Triton ops equal the reference ops.
Tracing: with fake CUDA tensors (no GPU here) a graph of reference ops is traced, the hook
retargets its nodes to the Triton ops, and AOTAutograd's functionalisation decomposes those into
`triton_kernel_wrapper_functional` nodes holding the generated kernels. Without a GPU, torch's
kernel analysis (identify_accessed_tensors -> generate_ttir) cannot ask a driver for a target
("0 active drivers"), logs a warning and assumes every kernel argument is mutated; selection
is still visible, which is what these tests check.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from triton.runtime.jit import JITFunction

import mxcompile.ops  # noqa: F401  (reference ops)
from mxcompile.triton_templates.ops import TRITON_REPLACEMENTS, use_triton_kernels


def _reference_graph(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a, sa = torch.ops.mxcompile.quantize(x, -1, "e4m3", "rceil", 32)
    b, sb = torch.ops.mxcompile.quantize(w, 0, "e4m3", "rceil", 32)
    return torch.ops.mxcompile.mx_mm(a, sa, b, sb, 32, torch.bfloat16)


def test_triton_ops_match_reference_ops_eagerly() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, 64, generator=g) * torch.logspace(-4, 4, 64)
    # Last axis (row-wise kernel), axis 0 of a 2-D tensor (column-wise kernel), a middle axis
    # (moved last, then back).
    for t, axis in ((x, -1), (x[:, 0], 0), (x, 1), (x, 0)):
        ref = torch.ops.mxcompile.quantize(t, axis, "e5m2", "even", 16)
        got = torch.ops.mxcompile.triton_quantize(t, axis, "e5m2", "even", 16)
        assert got[0].shape == ref[0].shape and got[0].is_contiguous()
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(got[1], ref[1])
    x = x[:4]
    w = torch.randn(64, 32, generator=g)
    a, sa = torch.ops.mxcompile.quantize(x, -1, "e4m3", "rceil", 32)
    b, sb = torch.ops.mxcompile.quantize(w, 0, "e4m3", "rceil", 32)
    ref = torch.ops.mxcompile.mx_mm(a, sa, b, sb, 32, torch.float32)
    got = torch.ops.mxcompile.triton_mx_mm(a, sa, b, sb, 32, torch.float32)
    assert got.shape == (4, 16, 32)
    # The reference op multiplies bf16-dequantized operands (exact here) in bf16 on the CPU.
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()


def _fake_cuda_inputs() -> tuple[FakeTensorMode, torch.Tensor, torch.Tensor]:
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(128, 96, device="cuda", dtype=torch.bfloat16)
    return mode, x, w


def test_hook_selects_triton_ops_on_fake_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")  # a GPU-less machine without the interpreter
    _, x, w = _fake_cuda_inputs()
    gm = make_fx(_reference_graph, tracing_mode="fake")(x, w)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.mxcompile.mx_mm.default in targets
    # No GPU here, so triton_available() says no: the checked hook leaves the graph alone...
    assert use_triton_kernels(gm) == 0
    # ...and the unchecked one (device and shapes only) retargets all three nodes.
    assert use_triton_kernels(gm, check_device=False) == 3
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert set(TRITON_REPLACEMENTS.values()) <= targets
    assert not set(TRITON_REPLACEMENTS) & targets
    assert "triton_mx_mm" in gm.code and "mxcompile.mx_mm" not in gm.code
    # CPU graphs keep the reference ops.
    cpu = make_fx(_reference_graph)(torch.randn(64, 128), torch.randn(128, 96))
    assert use_triton_kernels(cpu, check_device=False) == 0


def test_aot_trace_shows_generated_kernels(caplog: pytest.LogCaptureFixture) -> None:
    """Trace the retargeted graph through AOTAutograd with fake CUDA tensors, far enough to see
    the forward graph the backend compiler would get (then stop: nothing can run here)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    _, x, w = _fake_cuda_inputs()
    gm = make_fx(_reference_graph, tracing_mode="fake")(x, w)
    use_triton_kernels(gm, check_device=False)
    graphs: list[torch.fx.GraphModule] = []

    class _Captured(Exception):
        pass

    def capture(graph: torch.fx.GraphModule, example_inputs: list) -> None:
        graphs.append(graph)
        raise _Captured

    with caplog.at_level(logging.ERROR), pytest.raises(_Captured):
        aot_function(gm, fw_compiler=capture)(x, w)
    (graph,) = graphs
    wrappers = [n for n in graph.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) for n in wrappers]
    names = [getattr(k, "fn", k).fn.__name__ for k in kernels]  # Autotuner -> JITFunction -> fn
    assert names == ["mx_quantize_kernel", "mx_quantize_kernel", "mx_mm_kernel"]
    # Compiled-mode JITFunctions (not the interpreter's), as a GPU launch needs.
    assert all(isinstance(getattr(k, "fn", k), JITFunction) for k in kernels)
    quantize_kwargs = [n.kwargs["kwargs"] for n in wrappers[:2]]
    assert [(kw["ROWWISE"], kw["COLWISE"]) for kw in quantize_kwargs] == [
        (True, False),
        (False, True),
    ]
    assert wrappers[2].kwargs["kwargs"]["USE_DOT_SCALED"] is True


def test_fake_cpu_tracing_under_the_interpreter() -> None:
    """Fake CPU tensors (as in FakeTensorProp) trace through the Triton ops even with
    TRITON_INTERPRET=1: the interpreter is only used for real tensors."""
    x, w = torch.randn(32, 64), torch.randn(64, 32)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, sa = torch.ops.mxcompile.triton_quantize(x, -1, "e4m3", "rceil", 32)
        b, sb = torch.ops.mxcompile.triton_quantize(w, 0, "e4m3", "rceil", 32)
        return torch.ops.mxcompile.triton_mx_mm(a, sa, b, sb, 32, torch.float32)

    gm = make_fx(f, tracing_mode="fake")(x, w)
    assert "triton_mx_mm" in gm.code
    assert torch.allclose(gm(x, w), f(x, w))  # the traced graph runs the ops for real
