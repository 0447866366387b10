"""Where compiled FP4 GEMMs run: the lowering keeps `mxcompile::mx_mm_fp4` in CUDA graphs (its
CUDA kernel is the Triton FP4 GEMM: block-scaled tcgen05 on sm100+, expand_bf16 on sm90) and
lowers it to a GEMM of dequantized operands in CPU graphs (Inductor's CPU code), as
`lowering.runs_triton_mx_gemm(..., fp4=True)` decides.

No GPU here: the CUDA graph is traced with fake CUDA tensors (FakeTensorMode makes them on a
CPU-only torch) and lowered as `inductor_compiler` lowers CUDA graphs, up to Inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from mxcompile import lowering
from mxcompile.config import GemmKernel, MXConfig
from mxcompile.lowering import decompose_mx_ops, runs_triton_mx_gemm
from mxcompile.ops import CPU_KERNEL_OPS, CUDA_KERNEL_OPS
from mxcompile.ops.mx_mm import MX_MM_FP4
from mxcompile.ops.quantize import DEQUANTIZE_FP4, FAKE_QUANTIZE_FP4, QUANTIZE_FP4
from mxcompile.passes.gemm_rewrite import rewrite_gemms
from mxcompile.passes.graph_facts import GraphInfo
from mxcompile.passes.meta_keys import GEMM_KERNEL_KEY, GRAPH_INFO_KEY

FORMATS = ["mxfp4", "nvfp4"]
SEED = 7
M, K, N = 64, 128, 96


def _fp4_gemm(block_format: str):
    """x (M, K) @ w (K, N), each quantized along K, and w's block values read back from its
    packed bytes (a second user of the packed operand, as a saved weight has)."""

    def gemm(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = QUANTIZE_FP4(x, -1, block_format, "rceil", False, False, SEED, None)
        b = QUANTIZE_FP4(w, 0, block_format, "rceil", False, False, SEED, None)
        product = MX_MM_FP4(*a, *b, block_format, torch.bfloat16)
        return product, DEQUANTIZE_FP4(b[0], b[1], 0, block_format, torch.float32)

    return gemm


def _lowered_targets(block_format: str, device: str, kernel: GemmKernel | None) -> list:
    """Call targets of `_fp4_gemm` traced on `device` ("cuda": fake tensors) and lowered for it,
    its mx_mm_fp4 node recording `kernel` (None: no record, i.e. "auto")."""
    with FakeTensorMode():
        x = torch.empty(M, K, device=device, dtype=torch.bfloat16)
        w = torch.empty(K, N, device=device, dtype=torch.bfloat16)
    gm = make_fx(_fp4_gemm(block_format), tracing_mode="fake")(x, w)
    if kernel is not None:
        for node in gm.graph.nodes:
            if node.target is MX_MM_FP4:
                node.meta[GEMM_KERNEL_KEY] = kernel
    opaque = CUDA_KERNEL_OPS if device == "cuda" else CPU_KERNEL_OPS
    lowered = decompose_mx_ops(gm, [x, w], opaque=opaque)
    return [n.target for n in lowered.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kernel, device, mx_tensor_cores, triton_gemm", [
    (GemmKernel.AUTO, "cuda", False, True),  # sm90: expand_bf16 beats the fp32 dequantized GEMM
    (GemmKernel.AUTO, "cuda", True, True),  # sm100+: FP4 tensor cores
    (GemmKernel.TRITON, "cuda", False, True),
    (GemmKernel.DEQUANTIZED, "cuda", True, False),
    (GemmKernel.AUTO, "cpu", False, False),
    (GemmKernel.TRITON, "cpu", False, False),  # no Triton in CPU graphs
])
def test_fp4_rule(monkeypatch: pytest.MonkeyPatch, kernel: GemmKernel, device: str, mx_tensor_cores: bool,
                  triton_gemm: bool) -> None:
    monkeypatch.setattr(lowering, "has_mx_tensor_cores", lambda device: mx_tensor_cores)
    assert runs_triton_mx_gemm(kernel, torch.device(device), fp4=True) is triton_gemm


def test_mxfp8_auto_rule_unchanged_below_mx_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP8 "auto" on sm90 stays cuBLAS on exactly dequantized bf16 operands (the static
    comparison in `runs_triton_mx_gemm`); FP4 "auto" there takes the Triton kernel."""
    monkeypatch.setattr(lowering, "has_mx_tensor_cores", lambda device: False)
    cuda = torch.device("cuda")
    assert not runs_triton_mx_gemm(GemmKernel.AUTO, cuda)
    assert runs_triton_mx_gemm(GemmKernel.AUTO, cuda, fp4=True)


@pytest.mark.parametrize("block_format", FORMATS)
@pytest.mark.parametrize("kernel", [None, GemmKernel.TRITON])
def test_cuda_graphs_keep_the_fp4_gemm_op(monkeypatch: pytest.MonkeyPatch, block_format: str,
                                          kernel: GemmKernel | None) -> None:
    """In a CUDA graph, on any GPU (here: one without MX tensor cores, sm90), the FP4 GEMM stays
    the op with its packed operands, which Inductor calls as a fallback kernel: the Triton FP4
    GEMM. Nothing is fake-quantized or multiplied by aten.mm."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a GPU-less machine
    monkeypatch.setattr(lowering, "has_mx_tensor_cores", lambda device: False)
    targets = _lowered_targets(block_format, "cuda", kernel)
    assert targets.count(MX_MM_FP4) == 1, targets
    assert targets.count(QUANTIZE_FP4) == 2
    assert FAKE_QUANTIZE_FP4 not in targets
    assert torch.ops.aten.mm.default not in targets


@pytest.mark.parametrize("block_format", FORMATS)
def test_dequantized_fp4_gemms_in_cuda_graphs_and_cpu_graphs(monkeypatch: pytest.MonkeyPatch,
                                                              block_format: str) -> None:
    """gemm_kernel "dequantized" on CUDA, and every CPU graph: the FP4 GEMM becomes the fp32
    GEMM of fake-quantized block values (the packed weight is still quantized for its other
    user)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for device, kernel in (("cuda", GemmKernel.DEQUANTIZED), ("cpu", None)):
        targets = _lowered_targets(block_format, device, kernel)
        assert MX_MM_FP4 not in targets, device
        assert targets.count(FAKE_QUANTIZE_FP4) == 2, device
        assert targets.count(QUANTIZE_FP4) == 1, device
        assert torch.ops.aten.mm.default in targets, device


@pytest.mark.parametrize("recipe", FORMATS)
@pytest.mark.parametrize("kernel, dequantized", [(GemmKernel.DEQUANTIZED, True), (GemmKernel.TRITON, False)])
def test_gemm_kernel_option_reaches_fp4_gemms_through_gemm_rewrite(monkeypatch: pytest.MonkeyPatch, recipe: str,
                                                                     kernel: GemmKernel, dequantized: bool) -> None:
    """The gemm_kernel option, set on the config, decides the CUDA lowering of the FP4 GEMMs
    gemm_rewrite emits (its mx_mm_fp4 records it, as MXFP8's mx_mm does): "dequantized" lowers
    the linear layer's GEMM to the fp32 GEMM of block values, "triton" keeps the op (as "auto"
    does on every GPU, so a GEMM without the record would be kept too)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with FakeTensorMode():
        x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
    gm = make_fx(torch.nn.functional.linear, tracing_mode="fake")(x, w)
    gm.meta[GRAPH_INFO_KEY] = GraphInfo(kind="inference", param_input_indices=(1,))  # w: the layer's weight
    config = MXConfig.for_recipe(recipe, {"gemm_kernel": kernel.value, "high_precision_layers": 0})
    rewrite_gemms(gm, config, "inference")
    targets = [n.target for n in decompose_mx_ops(gm, [x, w], opaque=CUDA_KERNEL_OPS).graph.nodes]
    assert (MX_MM_FP4 not in targets) is dequantized, targets
    assert (FAKE_QUANTIZE_FP4 in targets) is dequantized, targets
