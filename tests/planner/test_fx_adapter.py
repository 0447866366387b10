"""The FX adapter and graph costs on small AOTAutograd graphs (no dynamo, no Inductor)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from mxcompile.cost.graph_costs import node_flops, value_bytes
from mxcompile.cost.profiles import H100_SXM
from mxcompile.planner import plan_activation_memory
from mxcompile.planner.budget import MemoryBudget
from mxcompile.planner.fx_adapter import build_problem

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
