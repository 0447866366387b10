"""The FX adapter and graph costs on small AOTAutograd graphs (no dynamo, no Inductor)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from mx_gemm_graph import MX_GEMM_SHAPE, traced_mx_gemm
from mxcompile.cost.graph_costs import fused_run_time_s, node_flops, node_time_s, value_bytes
from mxcompile.cost.profiles import DEQUANTIZE_RATE, H100_SXM, DeviceProfile
from mxcompile.ops.attention import ATTENTION
from mxcompile.ops.mx_mm import MX_MM
from mxcompile.planner import plan_activation_memory
from mxcompile.planner.budget import MemoryBudget
from mxcompile.planner.fx_adapter import MemoryModel, _merged_groups, _replayed_once, build_problem, fused_nodes
from mxcompile.planner.problem import SavedTensor

M, K, N = 64, 32, 48


def _eager(gm, inputs):
    return make_boxed_func(gm.forward)


def partitioned(fn, *inputs, params=(1,)):
    """(fw, bw, num_fwd_outputs) of fn under AOTAutograd's min-cut partition."""
    captured = {}

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        captured.update(fw=fw, bw=bw, n=num_fwd_outputs)
        return fw, bw

    compiled = aot_function(fn, fw_compiler=_eager, bw_compiler=_eager, partition_fn=partition)
    compiled(*inputs).sum().backward()
    return captured["fw"], captured["bw"], captured["n"]


def mlp(x, w):
    return torch.tanh(torch.relu(x @ w) * 2.0) @ w.t()


def test_value_bytes_counts_fp8_and_scales_exactly() -> None:
    data = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    scales = torch.empty(M, K // 32, dtype=torch.uint8)
    assert value_bytes((data, scales)) == M * K + M * K // 32


def test_mm_flops_and_saved_tensors() -> None:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(K, N, requires_grad=True)
    fw, bw, n_out = partitioned(mlp, x, w)
    mms = [n for n in fw.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert node_flops(mms[0]) == 2 * M * N * K
    adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM)
    problem = adapted.problem
    output = next(n for n in fw.graph.nodes if n.op == "output")
    saved = [a.name for a in output.args[0][n_out:] if isinstance(a, fx.Node) and a.name != "primals_2"]
    assert [t.name for t in problem.tensors] == saved
    assert problem.n_forward_steps == sum(1 for n in fw.graph.nodes if n.op == "call_function")
    assert adapted.keep_all_peak_bytes >= max(problem.baseline_bytes)
    for tensor in problem.tensors:
        assert tensor.first_backward_use >= problem.n_forward_steps
        if tensor.recomputable and tensor.nbytes > 0:
            assert tensor.recompute_cost_s > 0
    assert adapted.budget_for_fraction(1.0) == adapted.keep_all_peak_bytes


def test_dropout_is_not_recomputable() -> None:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(K, N, requires_grad=True)
    fw, bw, n_out = partitioned(lambda a, b: torch.nn.functional.dropout(a @ b, 0.5, training=True) @ b.t(), x, w)
    adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM)
    random = [t for t in adapted.problem.tensors if "dropout" in " ".join(adapted.closures[t.name])
              or any("dropout" in n or "rand" in n or "bernoulli" in n for n in adapted.closures[t.name])]
    assert random and all(not t.recomputable for t in random)


def test_plan_is_deterministic() -> None:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(K, N, requires_grad=True)
    fw, bw, n_out = partitioned(mlp, x, w)
    plans = []
    for _ in range(2):
        adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM, budget=MemoryBudget.of_fraction(0.8))
        plans.append(plan_activation_memory(adapted.problem).decisions)
    assert plans[0] == plans[1]



HEADS, SEQ, HEAD_DIM = 2, 32, 32


def _attention(q, k, v):
    out, _ = ATTENTION(q, k, v, None, True, HEAD_DIM ** -0.5, "both", "e4m3", "rceil", 32, SEQ)
    return out


def _qkv(x, w):
    """q, k, v cut by ``split`` from one GEMM output (B, H, S, 3D): views of one storage."""
    return (x @ w).split(HEAD_DIM, dim=-1)


def _attention_of_split(x, w):
    return _attention(*_qkv(x, w))


def _attention_of_split_q(x, w):
    q, k, v = _qkv(x, w)
    return _attention(q, k * 2.0, v * 3.0)  # k and v get storages of their own; q stays a piece


def _split_graphs(fn):
    x = torch.randn(1, HEADS, SEQ, HEAD_DIM, requires_grad=True)
    w = torch.randn(HEAD_DIM, 3 * HEAD_DIM, requires_grad=True)
    fw, bw, n_out = partitioned(fn, x, w)
    adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM)
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    pieces = [t for t in adapted.problem.tensors if fw_nodes[t.name].target is operator.getitem
              and fw_nodes[t.name].args[0].target is torch.ops.aten.split.Tensor]
    return adapted, pieces


STORAGE_BYTES = HEADS * SEQ * 3 * HEAD_DIM * 4  # the fp32 GEMM output q, k and v are cut from


def test_saved_split_pieces_share_one_decision_and_their_storage_bytes() -> None:
    adapted, pieces = _split_graphs(_attention_of_split)
    names = tuple(t.name for t in pieces)
    assert len(names) == 3 and names in adapted.tie_groups, (adapted.problem.tensors, adapted.tie_groups)
    assert sum(t.nbytes for t in pieces) == STORAGE_BYTES


def test_a_saved_split_piece_holds_its_whole_storage() -> None:
    adapted, pieces = _split_graphs(_attention_of_split_q)
    # q alone is saved, as a piece of the GEMM output: the storage stays alive whole while q is.
    assert [t.nbytes for t in pieces] == [STORAGE_BYTES], adapted.problem.tensors


def test_user_outputs_and_tangents_are_held_to_the_end_of_the_step() -> None:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(K, N, requires_grad=True)
    fw, bw, n_out = partitioned(mlp, x, w)
    adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM)
    problem = adapted.problem
    output_bytes = tangent_bytes = M * K * 4  # mlp returns (M, K); its tangent has its shape
    for step in range(problem.n_forward_steps, len(problem.steps)):
        # the caller holds the output through the backward, autograd the tangent
        assert problem.baseline_bytes[step] >= adapted.input_bytes + output_bytes + tangent_bytes, step


def _gelu_mlp(x, w):
    h = x @ w
    return (h * 0.5 * (1 + torch.erf(h * 0.7071))) @ w.t()


def test_the_fused_model_stores_no_pointwise_value_read_by_one_pointwise_op() -> None:
    """Forward of _gelu_mlp: mm, mul(h, .5), mul_1(h, .7071), erf, add, mul_2, t, mm_1, t_5.
    mul, mul_1, erf and add each feed one pointwise op, so Inductor computes them inside mul_2's
    kernel: the fused model drops their bytes (S each: 64 x 48 fp32) from every step they lived
    in op by op, and h (saved as `mm`) is read where mul_2 runs, not where mul_1 runs."""
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    fw, bw, n_out = partitioned(_gelu_mlp, x, w)
    fw_ops = [n for n in fw.graph.nodes if n.op == "call_function"]
    assert [n.name for n in fw_ops] == ["mm", "mul", "mul_1", "erf", "add", "mul_2", "t", "mm_1", "t_5"]
    assert {n.name for n in fused_nodes(fw_ops, MemoryModel.FUSED_POINTWISE)} == {"mul", "mul_1", "erf", "add"}
    assert not fused_nodes(fw_ops, MemoryModel.OP_BY_OP)

    def adapt(model):
        return build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM,
                             memory_model=model)

    op_by_op, fused = adapt(MemoryModel.OP_BY_OP), adapt(MemoryModel.FUSED_POINTWISE)
    size = 64 * 48 * 4
    # live op by op at steps 1..5: {mul}, {mul, mul_1}, {mul, mul_1, erf}, {mul, erf, add}, {mul, add}
    assert [a - b for a, b in zip(op_by_op.problem.baseline_bytes[1:6], fused.problem.baseline_bytes[1:6])] == [
        size, 2 * size, 3 * size, 3 * size, 2 * size]
    h = {m: next(t for t in a.problem.tensors if t.name == "mm") for m, a in (("op", op_by_op), ("fused", fused))}
    assert (h["op"].last_forward_use, h["fused"].last_forward_use) == (2, 5)
    # backward: h is read by mul and mul_1; mul feeds mul_3 -> mul_6 -> mul_7 -> add_1 (stored)
    bw_ops = [n.name for n in bw.graph.nodes if n.op == "call_function"]
    step = {name: op_by_op.problem.n_forward_steps + i for i, name in enumerate(bw_ops)}
    assert h["op"].first_backward_use == h["fused"].first_backward_use == step["mul"]
    assert (h["op"].last_backward_use, h["fused"].last_backward_use) == (step["mul_1"], step["add_1"])
    assert fused.keep_all_peak_bytes < op_by_op.keep_all_peak_bytes


def test_each_lowering_times_an_mx_gemm_as_it_runs_it() -> None:
    """Op by op (the eager lowering) an MX GEMM runs as its torch reference, dequantizing both
    operands first; under Inductor its operands are fake-quantized inside the GEMM's graph. So
    only the op-by-op model adds the profile's measured dequantize time, to the step and to a
    recomputation that replays it; and only Inductor's fuses pointwise chains."""
    nodes = [n for n in traced_mx_gemm().graph.nodes if n.op == "call_function"]
    mm = next(n for n in nodes if n.target is MX_MM)
    rates = {**H100_SXM.to_dict(), "op_rates": {DEQUANTIZE_RATE: 1e6},
             "sources": {**H100_SXM.sources, f"op_rates.{DEQUANTIZE_RATE}": "synthetic"}}
    profile = DeviceProfile.from_dict(rates)
    m, k, n = MX_GEMM_SHAPE
    dequantize_s = (m * k + k * n) / 1e6
    assert MemoryModel.FUSED_POINTWISE.step_time_s(mm, profile) == node_time_s(mm, profile)
    assert MemoryModel.OP_BY_OP.step_time_s(mm, profile) == node_time_s(mm, profile) + dequantize_s
    assert MemoryModel.FUSED_POINTWISE.run_time_s(nodes, profile) == fused_run_time_s(nodes, profile)
    op_by_op = sum(node_time_s(n, profile) for n in nodes) + dequantize_s  # summed in another order
    assert MemoryModel.OP_BY_OP.run_time_s(nodes, profile) == pytest.approx(op_by_op, rel=1e-12)


# Saved outputs of one op take one decision and replay the op once: a quantize op's data, scales
# and tensor scale (an FP4 operand, issue 48), a layer norm's statistics.


def _saved(name: str, cost: float, work: int) -> SavedTensor:
    return SavedTensor(name=name, nbytes=16, produced_at=0, last_forward_use=0, first_backward_use=2,
                       last_backward_use=2, recompute_cost_s=cost, recompute_work_bytes=work)


def test_one_replay_priced_on_the_first_output():
    tensors = [_saved("data", 3.0, 100), _saved("scale", 3.0, 90), _saved("other", 1.0, 10)]
    priced = _replayed_once(tensors, [("data", "scale")])
    assert [(t.recompute_cost_s, t.recompute_work_bytes) for t in priced] == [(3.0, 100), (0.0, 0), (1.0, 10)]
    assert _replayed_once(tensors, []) == tensors


def test_groups_sharing_a_name_merge_in_order_of_first_appearance():
    groups = [("a", "b"), ("c", "d"), ("e", "f"), ("b", "e")]
    assert _merged_groups(groups) == (("a", "b", "e", "f"), ("c", "d"))
    assert _merged_groups([("a", "b"), ("c",)]) == (("a", "b"), ("c",))
    assert _merged_groups([]) == ()


def _normed(x, w):
    return torch.nn.functional.layer_norm(x @ w, (N,)) @ w.t()


def test_saved_outputs_of_one_op_are_one_decision_priced_once():
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(K, N, requires_grad=True)
    fw, bw, n_out = partitioned(_normed, x, w)
    adapted = build_problem(fw, bw, num_fwd_outputs=n_out, param_input_indices=[1], profile=H100_SXM)
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    by_op: dict = {}
    for t in adapted.problem.tensors:
        node = fw_nodes[t.name]
        if node.target is operator.getitem:
            by_op.setdefault(node.args[0].name, []).append(t)
    (statistics,) = [ts for ts in by_op.values() if len(ts) > 1]  # the layer norm's mean and rstd
    assert tuple(t.name for t in statistics) in adapted.tie_groups
    assert statistics[0].recompute_cost_s > 0 and statistics[0].recompute_work_bytes >= 0
    assert all(t.recompute_cost_s == 0 and t.recompute_work_bytes == 0 for t in statistics[1:])
    lifetimes = {(t.produced_at, t.last_forward_use, t.first_backward_use, t.last_backward_use) for t in statistics}
    assert len(lifetimes) == 1
