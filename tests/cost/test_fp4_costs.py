"""The cost model prices FP4 (issue 48): a packed E2M1 operand's bytes with its scales, the FP4
GEMM's FLOPs, rate and scratch, the FP4 quantize's measured rate and scratch, and the saved FP4
operands' bytes against bf16. Profiles are synthetic; the scratch bounds are measured with the
allocator on small shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from cost_graphs import synthetic_profile
from mxcompile.config import GemmKernel
from mxcompile.cost.graph_costs import (GEMM_KERNEL_KEY, bytes_moved, flops_dtype_key, fp4_dequantize_time_s,
                                        fp4_gemm_runs_packed, node_flops, node_time_s, op_by_op_time_s,
                                        saved_quantized_operands, value_bytes, workspace_bytes)
from mxcompile.cost.profiles import B200, DEQUANTIZE_FP4_RATE, H100_SXM, QUANTIZE_FP4_RATE
from mxcompile.ops.mx_mm import MX_MM_FP4
from mxcompile.ops.quantize import QUANTIZE_FP4

M, K, N = 64, 128, 96  # K a multiple of both formats' blocks
# From the definitions: E2M1 is 4 bits (two per byte); NVFP4 has an E4M3 byte per 16 elements,
# MXFP4 an E8M0 byte per 32; the op returns a 0-d fp32 tensor scale for both (1.0 for MXFP4).
BLOCK = {"nvfp4": 16, "mxfp4": 32}
TENSOR_SCALE_BYTES = 4
BF16_BYTES = 2
FORMATS = tuple(BLOCK)
FP32_BYTES = 4


def _packed_bytes(numel: int, fmt: str) -> int:
    return numel // 2 + numel // BLOCK[fmt] + TENSOR_SCALE_BYTES


def _traced(fn, *inputs: torch.Tensor, mode: FakeTensorMode | None = None) -> list[fx.Node]:
    gm = fx.symbolic_trace(fn)
    FakeTensorProp(gm, mode).propagate(*inputs)
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _fp4_gemm_nodes(fmt: str, out_dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> tuple[fx.Node, fx.Node, fx.Node]:
    """(quantize of x along K, quantize of w along K, the FP4 GEMM) of x (M, K) @ w (K, N), on
    `device` ("cuda": fake tensors, a CUDA graph on a GPU-less machine)."""
    def gemm(x, w):
        a = QUANTIZE_FP4(x, 1, fmt, "rceil", False, False, 0, None)
        b = QUANTIZE_FP4(w, 0, fmt, "rceil", False, False, 0, None)
        return MX_MM_FP4(a[0], a[1], a[2], b[0], b[1], b[2], fmt, out_dtype)

    mode = FakeTensorMode()
    with mode:
        inputs = (torch.empty(M, K, device=device), torch.empty(K, N, device=device))
    nodes = _traced(gemm, *inputs, mode=mode)
    quantizes = [n for n in nodes if n.target is QUANTIZE_FP4]
    (mm,) = [n for n in nodes if n.target is MX_MM_FP4]
    return quantizes[0], quantizes[1], mm


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_fp4_bytes_are_half_a_byte_per_element_plus_scales(fmt):
    quantize, _, _ = _fp4_gemm_nodes(fmt)
    assert value_bytes(quantize.meta["val"]) == _packed_bytes(M * K, fmt)
    assert bytes_moved(quantize) == M * K * FP32_BYTES + _packed_bytes(M * K, fmt)
    # torch's own packed dtype: one element of float4_e2m1fn_x2 holds two E2M1 values
    assert value_bytes(torch.empty(M, K // 2, dtype=torch.float4_e2m1fn_x2)) == M * K // 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_gemm_priced_as_fp32_gemm_of_dequantized_operands(fmt):
    """FLOPs count the unpacked contraction (the packed operands are K/2 wide); the GEMM runs
    on fp32 block values even where the device has FP8 GEMMs; both operands' dequantize is on
    top, at the measured rate (both lowerings run it)."""
    _, _, mm = _fp4_gemm_nodes(fmt)
    flops = 2 * M * N * K
    assert node_flops(mm) == flops
    rate = 1e6
    profile = synthetic_profile(bandwidth=1e15, op_rates={DEQUANTIZE_FP4_RATE: rate})
    assert profile.native_fp8_gemm and flops_dtype_key(mm, profile) == "fp32"
    dequantize_s = (M * K + K * N) / rate
    assert fp4_dequantize_time_s(mm, profile) == pytest.approx(dequantize_s)
    assert node_time_s(mm, profile) == pytest.approx(flops / profile.flops("fp32") + dequantize_s)
    assert op_by_op_time_s(mm, profile) == node_time_s(mm, profile)  # no MX reference dequantize on top
    # Without a measured rate the dequantize costs its bytes: packed in, fp32 values out.
    unmeasured = synthetic_profile(bandwidth=1e9)
    read = _packed_bytes(M * K, fmt) + _packed_bytes(K * N, fmt)
    assert fp4_dequantize_time_s(mm, unmeasured) == pytest.approx((read + (M * K + K * N) * FP32_BYTES) / 1e9)


@pytest.mark.parametrize("fmt, out_dtype", [("nvfp4", torch.bfloat16), ("mxfp4", torch.float32)])
def test_cuda_fp4_gemm_priced_as_the_triton_kernel_on_packed_operands(fmt, out_dtype):
    """In a CUDA graph the FP4 GEMM runs the Triton FP4 GEMM on its packed operands: the same
    FLOPs at the bf16 tensor-core rate, the packed bytes in and the output out, no dequantize
    (even with a measured rate in the profile) and no scratch."""
    _, _, mm = _fp4_gemm_nodes(fmt, out_dtype, device="cuda")
    flops = 2 * M * N * K
    assert fp4_gemm_runs_packed(mm) and node_flops(mm) == flops
    moved = _packed_bytes(M * K, fmt) + _packed_bytes(K * N, fmt) + M * N * out_dtype.itemsize
    assert bytes_moved(mm) == moved
    profile = synthetic_profile(bandwidth=1e15, op_rates={DEQUANTIZE_FP4_RATE: 1e6})
    assert flops_dtype_key(mm, profile) == "bf16" and fp4_dequantize_time_s(mm, profile) == 0.0
    assert node_time_s(mm, profile) == pytest.approx(flops / profile.flops("bf16"))
    memory_bound = synthetic_profile(bandwidth=1e3)
    assert node_time_s(mm, memory_bound) == pytest.approx(moved / 1e3)
    assert workspace_bytes(mm) == 0
    _, _, cpu_mm = _fp4_gemm_nodes(fmt, out_dtype)  # the CPU graph's GEMM is dequantized and fp32
    assert not fp4_gemm_runs_packed(cpu_mm) and flops_dtype_key(cpu_mm, profile) == "fp32"
    assert workspace_bytes(cpu_mm) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_quantize_priced_at_its_measured_rate(fmt):
    quantize, _, _ = _fp4_gemm_nodes(fmt)
    slow = synthetic_profile(op_rates={QUANTIZE_FP4_RATE: 1e6})
    assert node_time_s(quantize, slow) == pytest.approx(M * K / 1e6)
    fast = synthetic_profile(op_rates={QUANTIZE_FP4_RATE: 1e15})  # never below the roofline
    assert node_time_s(quantize, fast) == pytest.approx(bytes_moved(quantize) / fast.memory_bandwidth)
    assert fp4_dequantize_time_s(quantize, slow) == 0.0


# The counted scratch is an upper bound of the measured one, and this close to it.
SCRATCH_TIGHTNESS = 0.95


@pytest.mark.parametrize("fmt, axis, block_2d, stochastic, rht", [
    ("nvfp4", 1, False, False, None), ("nvfp4", 0, True, False, None), ("nvfp4", 1, False, True, None),
    ("nvfp4", 0, False, False, 0), ("nvfp4", 0, False, True, 0), ("mxfp4", 1, False, False, None),
    ("mxfp4", 0, False, True, 0),
])
def test_fp4_quantize_scratch_bounds_what_it_allocates(fmt, axis, block_2d, stochastic, rht):
    from mxcompile.measure.memory import tensor_peak_bytes

    x = torch.randn(M, K)

    def quantize(x):
        return QUANTIZE_FP4(x, axis, fmt, "rceil", block_2d, stochastic, 0, rht)

    (node, *_) = _traced(quantize, x)
    outputs = []
    held = tensor_peak_bytes(lambda: outputs.append(quantize(x))) - value_bytes(outputs[0])
    counted = workspace_bytes(node)
    assert SCRATCH_TIGHTNESS * counted <= held <= counted, (held, counted)


@pytest.mark.parametrize("fmt, out_dtype", [("nvfp4", torch.float32), ("nvfp4", torch.bfloat16),
                                            ("mxfp4", torch.float32)])
def test_fp4_gemm_scratch_bounds_what_it_allocates(fmt, out_dtype):
    from mxcompile.measure.memory import tensor_peak_bytes

    x, w = torch.randn(M, K), torch.randn(K, N)
    a = QUANTIZE_FP4(x, 1, fmt, "rceil", False, False, 0, None)
    b = QUANTIZE_FP4(w, 0, fmt, "rceil", False, False, 0, None)
    _, _, node = _fp4_gemm_nodes(fmt, out_dtype)
    outputs = []
    held = tensor_peak_bytes(lambda: outputs.append(MX_MM_FP4(*a, *b, fmt, out_dtype))) - value_bytes(outputs[0])
    counted = workspace_bytes(node)
    assert SCRATCH_TIGHTNESS * counted <= held <= counted, (held, counted)


TOKENS, FEATURES = 100, 64  # tokens not a multiple of either block: the operand is padded along them


@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_fp4_operand_against_its_bf16_bytes(fmt):
    """A weight-gradient operand (quantized along tokens, zero-padded to the block first) saved
    whole, and one whose data a memory plan recomputes (only its scales saved): bytes of what is
    saved, bf16 bytes of the unpadded activation, and only where its data is saved."""
    block = BLOCK[fmt]
    padded = math.ceil(TOKENS / block) * block

    def saved(x, y):
        pad = torch.ops.aten.constant_pad_nd.default(x, [0, 0, 0, padded - TOKENS], 0.0)
        q = QUANTIZE_FP4(pad, 0, fmt, "rceil", False, False, 0, 0)
        r = QUANTIZE_FP4(y, 0, fmt, "rceil", False, False, 0, 0)
        return q[0], q[1], q[2], r[1], r[2]

    nodes = _traced(saved, torch.randn(TOKENS, FEATURES), torch.randn(padded, FEATURES))
    outputs = [n for n in nodes if n.target.__name__ == "getitem"]
    rows = saved_quantized_operands(outputs)
    assert [row["format"] for row in rows] == [fmt, fmt]
    whole, scales_only = rows
    assert whole["source"] == "x" and whole["shape"] == [TOKENS, FEATURES]
    assert whole["bytes"] == _packed_bytes(padded * FEATURES, fmt)
    assert whole["bf16_bytes"] == TOKENS * FEATURES * BF16_BYTES
    assert whole["to_bf16"] == whole["bytes"] / whole["bf16_bytes"]
    assert scales_only["bytes"] == padded * FEATURES // block + TENSOR_SCALE_BYTES
    assert scales_only["bf16_bytes"] == 0 and scales_only["to_bf16"] is None
    assert saved_quantized_operands(outputs + outputs[:1]) == rows  # a value saved twice counts once


@pytest.mark.parametrize("fmt, ratio", [("nvfp4", 9 / 32), ("mxfp4", 17 / 64)])
def test_unpadded_fp4_operand_ratio(fmt, ratio):
    """Half a byte per element and a scale byte per block, over two bytes: 9/32 (NVFP4) and 17/64
    (MXFP4), plus the 4-byte tensor scale."""
    quantize, _, _ = _fp4_gemm_nodes(fmt)
    outputs = list(quantize.users)
    (row,) = saved_quantized_operands(outputs)
    assert row["to_bf16"] == pytest.approx(ratio + TENSOR_SCALE_BYTES / (M * K * BF16_BYTES), rel=0, abs=1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_fp4_gemm_priced_at_the_fp4_tensor_core_rate_where_the_profile_has_one(fmt):
    """sm100+ multiplies E2M1 on block-scaled tcgen05: the B200 profile's FP4 rate, twice its
    FP8 rate; a profile without one (H100: the sm90 loop's bf16 wgmma) prices it at bf16."""
    _, _, mm = _fp4_gemm_nodes(fmt, torch.bfloat16, device="cuda")
    flops = 2 * M * N * K
    assert flops_dtype_key(mm, B200) == "fp4" and B200.flops("fp4") == 2 * B200.flops("fp8")
    assert node_time_s(mm, B200) == pytest.approx(max(flops / B200.flops("fp4"), bytes_moved(mm) / B200.memory_bandwidth))
    assert flops_dtype_key(mm, H100_SXM) == "bf16"


@pytest.mark.parametrize("kernel, packed", [(GemmKernel.DEQUANTIZED, False), (GemmKernel.TRITON, True),
                                            (GemmKernel.AUTO, True)])
def test_cuda_fp4_gemm_priced_as_the_gemm_kernel_it_was_given(kernel, packed):
    """gemm_kernel (the node's record): "dequantized" runs the fp32 GEMM of the block values
    in a CUDA graph too (`lowering.runs_triton_mx_gemm`), with its dequantize and scratch."""
    _, _, mm = _fp4_gemm_nodes("nvfp4", torch.bfloat16, device="cuda")
    mm.meta[GEMM_KERNEL_KEY] = kernel
    profile = synthetic_profile(bandwidth=1e15, op_rates={DEQUANTIZE_FP4_RATE: 1e6})
    assert fp4_gemm_runs_packed(mm) == packed
    assert flops_dtype_key(mm, profile) == ("bf16" if packed else "fp32")
    assert (fp4_dequantize_time_s(mm, profile) > 0) == (workspace_bytes(mm) > 0) == (not packed)
