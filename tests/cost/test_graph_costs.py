"""Prices of the MX ops in the cost model: quantize, mx_mm and attention, on profiles with and
without measured op rates and FP8 GEMMs. No timing: the profiles here are synthetic."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from cost_graphs import GIGA, first_of_each_op, synthetic_profile, traced_ops
from mx_gemm_graph import MX_GEMM_SHAPE, traced_mx_gemm
from mxcompile.config import GemmKernel, MXConfig
from mxcompile.cost.graph_costs import (GEMM_KERNEL_KEY, attention_flops, attention_pass_time_s, attention_passes,
                                        bytes_moved, fused_run_time_s, node_flops, node_time_s, op_by_op_run_time_s,
                                        op_by_op_time_s, reference_dequantize_time_s, value_bytes,
                                        workspace_bytes)
from mxcompile.cost.profiles import ATTENTION_PASS_RATE, ATTENTION_RATE, DEQUANTIZE_RATE, QUANTIZE_RATE, DeviceProfile
from mxcompile.ops.attention import ATTENTION, ATTENTION_BACKWARD
from mxcompile.ops.attention_reference import default_key_tile

CONFIG = MXConfig()
M, K, N = MX_GEMM_SHAPE
ATTENTION_SHAPE = (2, 3, 64, 32)  # (batch, heads, seq, head_dim)


@pytest.fixture(scope="module")
def mx_nodes() -> dict[str, fx.Node]:
    return first_of_each_op(traced_mx_gemm(CONFIG))


def test_quantize_priced_at_least_its_bytes_over_bandwidth(mx_nodes):
    quantize = mx_nodes["mxcompile::quantize"]
    moved = M * K * 4 + M * K + M * K // CONFIG.block_size  # fp32 in, fp8 out, one scale byte per block
    assert bytes_moved(quantize) == moved
    profile = synthetic_profile()
    assert node_time_s(quantize, profile) == pytest.approx(moved / profile.memory_bandwidth)


def test_quantize_priced_at_its_measured_rate_when_slower_than_memory(mx_nodes):
    quantize = mx_nodes["mxcompile::quantize"]
    slow = synthetic_profile(op_rates={QUANTIZE_RATE: 1e6})  # elements/s, far below the memory roofline
    assert node_time_s(quantize, slow) == pytest.approx(M * K / 1e6)
    fast = synthetic_profile(op_rates={QUANTIZE_RATE: 1e15})  # a rate above the roofline never lowers the price
    assert node_time_s(quantize, fast) == pytest.approx(bytes_moved(quantize) / fast.memory_bandwidth)


def test_mx_mm_priced_at_fp8_only_with_fp8_gemms(mx_nodes):
    mm = mx_nodes["mxcompile::mx_mm"]
    flops = 2 * M * N * K
    assert node_flops(mm) == flops
    slow_memory = dict(bandwidth=1e15)  # so the GEMM is compute-bound
    assert node_time_s(mm, synthetic_profile(**slow_memory)) == pytest.approx(flops / (40 * GIGA))
    # Without FP8 GEMMs (a CPU) an fp32-output MX GEMM multiplies fp32 operands: the fp32 rate.
    assert node_time_s(mm, synthetic_profile(native_fp8_gemm=False, **slow_memory)) == pytest.approx(flops / (10 * GIGA))


def test_mx_mm_with_the_dequantized_kernel_priced_at_its_operands_rate():
    """gemm_kernel="dequantized" (the node's record): a GEMM of the dequantized operands (fp32
    for this fp32-output GEMM) even on a device with FP8 GEMMs."""
    mm = first_of_each_op(traced_mx_gemm(CONFIG))["mxcompile::mx_mm"]
    mm.meta[GEMM_KERNEL_KEY] = GemmKernel.DEQUANTIZED  # as gemm_rewrite records the config's
    assert node_time_s(mm, synthetic_profile(bandwidth=1e15)) == pytest.approx(2 * M * N * K / (10 * GIGA))


def test_mx_mm_run_as_its_reference_adds_its_operands_dequantize(mx_nodes):
    """The eager lowering runs an MX GEMM as its torch reference, which dequantizes A (M x K) and
    B (K x N) op by op before the GEMM (on the 2-core host about as long as the GEMM): priced
    at the measured dequantize rate on top of the GEMM, and only when asked for and measured."""
    mm, quantize = mx_nodes["mxcompile::mx_mm"], mx_nodes["mxcompile::quantize"]
    rate = 1e6  # operand elements/s
    profile = synthetic_profile(native_fp8_gemm=False, op_rates={DEQUANTIZE_RATE: rate})
    dequantize_s = (M * K + K * N) / rate
    assert reference_dequantize_time_s(mm, profile) == pytest.approx(dequantize_s)
    assert op_by_op_time_s(mm, profile) == pytest.approx(node_time_s(mm, profile) + dequantize_s)
    assert op_by_op_time_s(quantize, profile) == node_time_s(quantize, profile)
    unmeasured = synthetic_profile(native_fp8_gemm=False)  # e.g. CUDA: the op is a Triton MX GEMM
    assert op_by_op_time_s(mm, unmeasured) == node_time_s(mm, unmeasured)
    # Op by op, the quantizes and the reference GEMM each at their own price, nothing fused.
    nodes = [n for n in mm.graph.nodes if n.op == "call_function"]
    expected = sum(node_time_s(n, profile) for n in nodes) + dequantize_s
    assert op_by_op_run_time_s(nodes, profile) == pytest.approx(expected)


def test_attention_priced_by_its_gemm_flops_and_measured_rate():
    q, k, v = (torch.randn(ATTENTION_SHAPE) for _ in range(3))
    batch, heads, seq, width = ATTENTION_SHAPE
    tail = (CONFIG.scale_mode.value, CONFIG.block_size, default_key_tile(CONFIG.block_size))

    def attend(q, k, v):
        return ATTENTION(q, k, v, None, True, width**-0.5, CONFIG.attention.value, CONFIG.forward_elem.value, *tail)

    node = traced_ops(attend, q, k, v)["mxcompile::attention"]
    flops = 2 * 2 * batch * heads * seq * seq * width  # S = QK^T and O = PV
    assert node_flops(node) == flops == attention_flops(batch, heads, seq, seq, width, width)
    roofline = synthetic_profile(bandwidth=1e15)
    assert node_time_s(node, roofline) == pytest.approx(flops / roofline.flops("fp8"))
    measured = synthetic_profile(bandwidth=1e15, op_rates={ATTENTION_RATE: 1e8})
    assert node_time_s(node, measured) == pytest.approx(flops / 1e8)
    # With a measured pass rate, each pass (a key tile of a batch chunk; the op's default chunk
    # is one element) adds its fixed time.
    passes = batch * -(-seq // default_key_tile(CONFIG.block_size))
    assert attention_passes(node) == passes and attention_passes(node, chunk=batch) == passes // batch
    with_passes = synthetic_profile(bandwidth=1e15, op_rates={ATTENTION_RATE: 1e8, ATTENTION_PASS_RATE: 1e3})
    assert node_time_s(node, with_passes) == pytest.approx(flops / 1e8 + passes / 1e3)
    assert attention_pass_time_s(node, with_passes, chunk=batch) == pytest.approx(passes / batch / 1e3)
    assert attention_pass_time_s(node, measured) == 0.0  # no pass rate: the passes are not priced


def test_unknown_op_rate_is_an_error():
    with pytest.raises(ValueError, match="unknown keys"):
        synthetic_profile(op_rates={"softmax": 1.0})
    with pytest.raises(ValueError, match="sources lacks"):
        DeviceProfile(name="x", peak_flops={"fp32": 1.0, "bf16": 1.0, "fp8": 1.0}, memory_bandwidth=1.0,
                      host_link_bandwidth=1.0, op_rates={QUANTIZE_RATE: 1.0},
                      sources={"peak_flops.fp32": "a", "peak_flops.bf16": "b", "peak_flops.fp8": "c",
                               "memory_bandwidth": "d", "host_link_bandwidth": "e"})



def _masked_index_put_accumulate(weight_grad, mask, ids, grad):
    return torch.ops.aten._unsafe_masked_index_put_accumulate.default(weight_grad, mask, [ids], grad)


_ATEN_SCRATCH_CASES = {  # schema name: (the op on fresh inputs, the inputs)
    "aten::mul": (lambda x: torch.ops.aten.mul.Tensor(x, 0.5), lambda: (torch.randn(M, K),)),
    "aten::mean": (lambda x: torch.ops.aten.mean.dim(x, [-1], True), lambda: (torch.randn(M, K),)),
    "aten::ne": (lambda x: torch.ops.aten.ne.Scalar(x, -100), lambda: (torch.randint(0, 9, (M, K)),)),
    "aten::sum": (lambda x: torch.ops.aten.sum.default(x), lambda: (torch.rand(M, K) > 0.5,)),
    "aten::_unsafe_masked_index_put_accumulate": (  # the embedding backward of eager lowering
        _masked_index_put_accumulate,
        lambda: (torch.zeros(N, K), torch.ones(M, 1, dtype=torch.bool), torch.randint(0, N, (M,)), torch.randn(M, K))),
}


@pytest.mark.parametrize("name", sorted(_ATEN_SCRATCH_CASES))
def test_eager_aten_scratch_bounds_what_the_kernel_allocates(name):
    """The scratch counted for an eager ATen kernel bounds what the allocator sees it hold beside
    its output (the op's peak minus its output bytes), and the kernel does hold some."""
    from mxcompile.measure.memory import tensor_peak_bytes

    fn, make_inputs = _ATEN_SCRATCH_CASES[name]
    inputs = make_inputs()
    node = traced_ops(fn, *inputs)[name]
    outputs = []
    peak = tensor_peak_bytes(lambda: outputs.append(fn(*inputs)))
    scratch = peak - value_bytes(outputs[0])
    assert 0 < scratch <= workspace_bytes(node), (scratch, workspace_bytes(node))


ATTENTION_SCRATCH_SLACK = 1.25  # counted scratch of one batch element at most 1.25x the measured


@pytest.mark.parametrize("width", [32, 64, 128])
def test_attention_scratch_counts_its_batch_chunk_and_bounds_what_the_ops_allocate(width):
    """The attention ops' counted scratch is per chunk of batch elements (their `batch_chunk`)
    and bounds the allocator's peak beside their outputs, forward and backward, at head widths
    whose score tile is 4, 2 and 1 times the query; a larger chunk does hold more. For one
    element it is within ATTENTION_SCRATCH_SLACK of the peak (one constant per op, the worst
    case of every width, counted 2.3x the forward's scratch at width 64)."""
    from mxcompile.measure.memory import tensor_peak_bytes

    batch, heads, seq = 4, 2, 128
    q, k, v, do = (torch.randn(batch, heads, seq, width) for _ in range(4))
    common = (True, width**-0.5, CONFIG.attention.value, CONFIG.forward_elem.value)
    tail = (CONFIG.scale_mode.value, CONFIG.block_size, default_key_tile(CONFIG.block_size))

    def forward(chunk):
        def run(q, k, v):
            return ATTENTION(q, k, v, None, *common, *tail, chunk)
        return run

    def backward(chunk):
        def run(do, q, k, v, out, lse):
            return ATTENTION_BACKWARD(do, q, k, v, None, out, lse, *common, CONFIG.grad_elem.value, *tail, chunk)
        return run

    out, lse = forward(1)(q, k, v)
    for make, inputs, name in ((forward, (q, k, v), "mxcompile::attention"),
                               (backward, (do, q, k, v, out, lse), "mxcompile::attention_backward")):
        counted, held = {}, {}
        for chunk in (1, batch):
            fn = make(chunk)
            counted[chunk] = workspace_bytes(traced_ops(fn, *inputs)[name])
            outputs = []
            peak = tensor_peak_bytes(lambda: outputs.append(fn(*inputs)))
            held[chunk] = peak - sum(value_bytes(t) for t in outputs[0])
            assert 0 < held[chunk] <= counted[chunk], (name, chunk, held[chunk], counted[chunk])
        assert counted[1] <= ATTENTION_SCRATCH_SLACK * held[1], (name, held[1], counted[1])
        assert counted[batch] == batch * counted[1]
        assert held[batch] > held[1], (name, held)


def test_a_recomputation_is_priced_with_its_pointwise_chains_fused():
    """A GELU-like chain before a GEMM, priced as Inductor runs it: the chain's intermediates stay
    in registers, so the chain reads its inputs and writes the GEMM's operand once; the GEMM
    costs what it costs alone. A closure ending in a pointwise op writes its result."""
    aten = torch.ops.aten

    def chain(x, w):
        half = aten.mul.Tensor(x, 0.5)
        erf = aten.erf.default(half)
        one_plus = aten.add.Tensor(erf, 1.0)
        gated = aten.mul.Tensor(one_plus, x)
        return aten.mm.default(gated, w), gated

    x, w = torch.randn(M, K), torch.randn(K, N)
    gm = fx.symbolic_trace(chain)
    FakeTensorProp(gm).propagate(x, w)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    half, erf, one_plus, gated, mm = nodes
    profile = synthetic_profile(bandwidth=1e9)
    x_bytes = M * K * 4
    # half reads x, gated reads x and writes its output (read by the GEMM): three passes.
    expected = 3 * x_bytes / 1e9 + node_time_s(mm, profile)
    assert fused_run_time_s(nodes, profile) == pytest.approx(expected)
    # Each op alone: x read and written by half, erf and add, gated reads two and writes one: 9 passes.
    assert sum(node_time_s(n, profile) for n in nodes) == pytest.approx(9 * x_bytes / 1e9 + node_time_s(mm, profile))
    # Run op by op (the eager lowering) every op pays alone.
    assert op_by_op_run_time_s(nodes, profile) == pytest.approx(sum(node_time_s(n, profile) for n in nodes))
    # Ending at the pointwise `gated`: the same three passes, the result written once.
    assert fused_run_time_s(nodes[:4], profile) == pytest.approx(3 * x_bytes / 1e9)
    assert fused_run_time_s([half], profile) == pytest.approx(node_time_s(half, profile))
