"""The CUDA kernels of `mxcompile::quantize` and `mxcompile::mx_mm` (registered with
`register_kernel("cuda")`), and the CUDA lowering that keeps those ops opaque.

Eager: called directly on CPU tensors under the interpreter, the CUDA kernels (the Triton
path) equal the torch references. Tracing: with fake CUDA tensors (no GPU here) a graph of the
ops is traced and lowered as for CUDA: quantize stays opaque (Inductor runs it as a fallback
kernel, which dispatches to the CUDA kernel), dequantize is decomposed, and mx_mm stays opaque
where `lowering.runs_triton_mx_gemm` says so, else becomes a GEMM of dequantized operands.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from mxcompile import lowering
from mxcompile.config import GemmKernel
from mxcompile.lowering import decompose_mx_ops
from mxcompile.ops import CUDA_KERNEL_OPS
from mxcompile.ops.mx_mm import MX_MM, mx_mm_cuda, triton_mx_mm_unsupported
from mxcompile.ops.quantize import DEQUANTIZE, QUANTIZE, quantize_cuda, triton_quantize_unsupported
from mxcompile.passes.meta_keys import GEMM_KERNEL_KEY

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # the Triton path on the CPU


def _graph(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, sa = QUANTIZE(x, -1, "e4m3", "rceil", 32)
    b, sb = QUANTIZE(w, 0, "e4m3", "rceil", 32)
    return MX_MM(a, sa, b, sb, 32, torch.bfloat16), DEQUANTIZE(b, sb, 0, 32, torch.float32)


def test_cuda_kernels_match_the_torch_references_eagerly() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, 64, generator=g) * torch.logspace(-4, 4, 64)
    # Last axis (row-wise kernel), axis 0 of a 2-D tensor (column-wise kernel), a middle axis
    # (moved last, then back), a transposed input (output in the fake's layout).
    for t, axis in ((x, -1), (x[:, 0], 0), (x, 1), (x, 0), (x[0].t(), 0)):
        assert triton_quantize_unsupported(t, "e5m2", 16) is None  # the interpreter
        ref = QUANTIZE(t, axis, "e5m2", "even", 16)
        got = quantize_cuda(t, axis, "e5m2", "even", 16)
        assert got[0].shape == ref[0].shape and got[0].stride() == ref[0].stride()
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(got[1], ref[1])
    x = x[:4]
    w = torch.randn(64, 32, generator=g)
    a, sa = QUANTIZE(x, -1, "e4m3", "rceil", 32)
    b, sb = QUANTIZE(w, 0, "e4m3", "rceil", 32)
    assert triton_mx_mm_unsupported(a, b, 32) is None
    ref = MX_MM(a, sa, b, sb, 32, torch.float32)
    got = mx_mm_cuda(a, sa, b, sb, 32, torch.float32)
    assert got.shape == (4, 16, 32)
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()
    # A 3-D B: the Triton GEMM takes a 2-D B, so the CUDA kernel runs the torch reference.
    b3, sb3 = QUANTIZE(torch.randn(4, 64, 32, generator=g), 1, "e4m3", "rceil", 32)
    assert "2-D B" in triton_mx_mm_unsupported(a, b3, 32)
    assert torch.equal(mx_mm_cuda(a, sa, b3, sb3, 32, torch.float32), MX_MM(a, sa, b3, sb3, 32, torch.float32))


def test_quantize_and_mx_mm_have_cuda_kernels() -> None:
    """Eager CUDA calls and Inductor's fallback kernels reach the Triton kernels through the
    dispatcher's CUDA key, not through a graph rewrite."""
    for op in CUDA_KERNEL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), op
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(DEQUANTIZE.name(), "CUDA")


def _lowered_cuda_targets(kernel: GemmKernel | None) -> list:
    """Targets of `_graph` traced with fake CUDA tensors and lowered as for CUDA, its mx_mm node
    carrying `kernel` as gemm_rewrite records it (None: no record)."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(128, 96, device="cuda", dtype=torch.bfloat16)
    gm = make_fx(_graph, tracing_mode="fake")(x, w)
    if kernel is not None:
        for node in gm.graph.nodes:
            if node.target in (MX_MM, QUANTIZE):
                node.meta[GEMM_KERNEL_KEY] = kernel
    lowered = decompose_mx_ops(gm, [x, w], opaque=CUDA_KERNEL_OPS)
    return [n.target for n in lowered.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kernel, mx_tensor_cores, triton_gemm", [
    (GemmKernel.TRITON, False, True),
    (GemmKernel.DEQUANTIZED, True, False),
    (GemmKernel.AUTO, True, True),
    (GemmKernel.AUTO, False, False),  # Hopper and older: no MX tensor cores
    (None, False, False),  # an mx_mm no pass recorded a kernel for: "auto"
])
def test_cuda_lowering_keeps_the_kernel_ops_opaque(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                  kernel, mx_tensor_cores, triton_gemm) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a GPU-less machine
    monkeypatch.setattr(lowering, "has_mx_tensor_cores", lambda device: mx_tensor_cores)
    with caplog.at_level(logging.INFO, logger="mxcompile"):
        targets = _lowered_cuda_targets(kernel)
    said = "1 MX GEMM(s) of a CUDA graph run as cuBLAS GEMMs" in caplog.text
    assert said != triton_gemm, caplog.text  # the lowering says where it sends the GEMMs
    assert DEQUANTIZE not in targets  # no CUDA kernel of its own: decomposed for Inductor
    if triton_gemm:
        assert targets.count(QUANTIZE) == 2  # the Triton quantize kernel: one per operand
        assert targets.count(MX_MM) == 1
    else:  # a GEMM of fake-quantized operands (fp8 casts: Triton contracts FMAs) that Inductor lowers
        assert MX_MM not in targets
        # w's fp8 copy, which the second output dequantizes: Inductor's code where a pass
        # recorded the GEMM's kernel, the Triton kernel through the op otherwise
        assert targets.count(QUANTIZE) == (0 if kernel is not None else 1)
        assert torch.ops.aten.mm.default in targets
        assert torch.ops.prims.convert_element_type.default in targets
        # each operand's block maxima, and w's once more for its fp8 copy
        assert targets.count(torch.ops.aten.amax.default) == (3 if kernel is not None else 2)


def test_cpu_lowering_decomposes_every_mx_op() -> None:
    cpu = make_fx(_graph)(torch.randn(64, 128), torch.randn(128, 96))
    cpu_targets = {n.target for n in decompose_mx_ops(cpu, [torch.randn(64, 128), torch.randn(128, 96)]).graph.nodes}
    assert not cpu_targets & {QUANTIZE, MX_MM, DEQUANTIZE}
