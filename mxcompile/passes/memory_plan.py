"""Apply the activation-memory plan: recompute by moving forward subgraphs into the backward,
offload via custom ops.

Flow (:func:`plan_and_partition`, the pipeline's PARTITION_STAGE, run by ``backend.compile_graph``'s partition step):

1. partition the rewritten joint graph as usual (min-cut);
2. build the planner's :class:`~mxcompile.planner.Problem` from that forward/backward pair
   (:mod:`mxcompile.planner.fx_adapter`) and plan it for ``config.memory_budget``;
3. apply the plan to copies of the two graphs (:func:`apply_recompute`), exactly as the
   planner's model (:mod:`mxcompile.planner.memory`) describes it: a recomputed tensor is no
   longer a forward output; its closure (the forward nodes back to saved tensors and graph
   inputs) is copied into the backward just before its first backward use, and the copy
   replaces the saved value. A recompute input that is itself recomputed is reused where the
   plan has it resident, else replayed again at that point (a transient). Forward nodes that
   only fed removed outputs are dropped, so the forward also stops computing them;
4. model the peak of the rewritten pair (the adapter again, every remaining tensor kept or
   offloaded). It differs from the plan's prediction only through modelling details (e.g.
   a keep extension of a saved input that the plan had as transient); if it overshoots the
   budget, plan again with the target lowered by the overshoot (at most ``MAX_PLAN_ROUNDS``
   times) and keep the rewrite with the lowest peak;
5. give each MX attention op the largest batch chunk whose scratch fits the room the budget
   leaves at its step (:mod:`.attention_chunks`; the rewrite gave them one element per call);
6. for offloaded tensors, wrap the saved value in ``mxcompile::offload`` (forward, after its
   last forward use) and ``mxcompile::reload`` (backward, before its first use).

Why not torch's recompute tags (``CheckpointPolicy.MUST_RECOMPUTE``) and a second min-cut: the
partitioner then keeps one copy of each recomputed node alive from its first to its last
backward use, replays sibling outputs of multi-output ops and saves neighbours of its own
choosing, so the measured peak missed tight budgets (7% over at half the activation memory on
the tiny GPT); copying the closures ourselves makes the graphs match the model.

Recomputation replays the same deterministic ops on the same inputs, so gradients are
bit-identical to the unplanned step (random ops are never recomputed, see the adapter).

The offload / reload ops and what they cost today are in :mod:`mxcompile.ops.offload`.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters

from ..config import MXConfig
from ..ops import offload as offload_ops
from ..calibration.cpu import measure_cpu_profile
from ..cost.profiles import PROFILES, DeviceProfile
from ..planner import BudgetInfeasibleError, KEEP, OFFLOAD, RECOMPUTE, Plan, budget_curve, evaluate, plan_activation_memory
from ..planner.fx_adapter import AdapterResult, MemoryModel, build_problem
from ..planner.problem import BACKWARD, FORWARD
from ..report import Report
from .attention_chunks import ChunkDecision, widen_attention_chunks
from .hoist_saved import hoist_saved_values
from .meta_keys import PLANNED_GRAPH_KEY, PLAN_PLACED_KEY

PLAN_SOLVER = "auto"  # the ILP for small graphs, the heuristic for large (see mxcompile.planner)
PLAN_TIME_LIMIT_S = 5.0  # per ILP solve; the plan is part of compile time
MAX_PLAN_ROUNDS = 4  # plan, partition, check the partition's peak; re-plan tighter if it overshot
CURVE_FRACTIONS: tuple[float, ...] = (1.0, 0.75, 0.5, 0.3)  # report.memory_plan["budget_curve"]
CURVE_SOLVER = "heuristic"  # the curve is informative: the fast, monotone solver is enough
DEFAULT_GPU_PROFILE = "H100 SXM"  # for a CUDA device whose name matches no known profile

Partitioner = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


# --------------------------------------------------------------------------- helpers


def profile_for(graph: fx.GraphModule) -> DeviceProfile:
    """The device profile timing ``graph``: a datasheet profile for a known CUDA GPU (by
    name), else ``DEFAULT_GPU_PROFILE`` for CUDA, and a measured profile on CPU."""
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            name = torch.cuda.get_device_name(value.device)
            for profile_name, profile in PROFILES.items():
                if profile_name.split()[0] in name:
                    return profile
            return PROFILES[DEFAULT_GPU_PROFILE]
    return measure_cpu_profile()


class _RecomputeWriter:
    """Copies recompute closures from the forward graph into the backward graph (see
    :func:`apply_recompute`)."""

    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule, recomputed: set[str], adapted: AdapterResult,
                 num_fwd_outputs: int) -> None:
        self.fw, self.bw = fw, bw
        self.recomputed = recomputed
        self.closures = adapted.closures
        self.tensors = {t.name: t for t in adapted.problem.tensors}
        self.fw_nodes = {n.name: n for n in fw.graph.nodes}
        self.placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
        n_fwd = sum(1 for n in fw.graph.nodes if n.op == "call_function")
        bw_ops = [n for n in bw.graph.nodes if n.op == "call_function"]
        self.point = {n_fwd + i: n for i, n in enumerate(bw_ops)}  # planner step -> backward node
        self.copies: dict[int, dict[fx.Node, fx.Node]] = {}  # step -> forward node -> its copy there
        self.new_inputs: list[fx.Node] = []  # forward placeholders the backward now needs
        # Where new saved inputs go: the backward's saved values follow its saved SymInts.
        self.first_saved = next(n for n in bw.graph.nodes if n.op == "placeholder"
                                and not isinstance(n.meta.get("val"), torch.SymInt))
        self.num_fwd_outputs = num_fwd_outputs

    def materialize(self, name: str, step: int) -> fx.Node:
        """The backward node holding recomputed ``name`` at planner step ``step`` (created,
        with its closure, just before that step's node, unless already there)."""
        env = self.copies.setdefault(step, {})
        target = self.fw_nodes[name]
        if target in env:
            return env[target]
        point = self.point.get(step)
        if point is None:
            raise RuntimeError(f"memory plan: recompute point {step} of {name!r} is not a backward step; "
                               "this is a bug in mxcompile, please report it")
        for node in (self.fw_nodes[n] for n in self.closures[name]):
            if node in env:
                continue
            args = {arg: self.resolve(arg, step) for arg in node.all_input_nodes if arg not in env}
            with self.bw.graph.inserting_before(point):
                env[node] = self.bw.graph.node_copy(node, lambda arg: env[arg] if arg in env else args[arg])
            env[node].meta[PLAN_PLACED_KEY] = True  # node_copy gave the copy a meta dict of its own
        return env[target]

    def resolve(self, arg: fx.Node, step: int) -> fx.Node:
        """What a closure copied at ``step`` reads for the forward node ``arg`` (a saved tensor
        or a graph input; the closure's own members are looked up by the caller)."""
        if arg.name in self.recomputed:
            tensor = self.tensors[arg.name]
            resident = tensor.first_backward_use <= step <= tensor.last_backward_use
            return self.materialize(arg.name, tensor.first_backward_use if resident else step)
        if arg.name in self.placeholders:
            return self.placeholders[arg.name]
        if arg.op != "placeholder":
            raise RuntimeError(f"memory plan: recompute reads forward node {arg.name!r}, which is neither saved nor "
                               "a graph input; this is a bug in mxcompile, please report it")
        with self.bw.graph.inserting_before(self.first_saved):
            ph = self.bw.graph.placeholder(arg.name)
        ph.meta.update(arg.meta)
        self.placeholders[arg.name] = ph
        self.new_inputs.append(arg)
        return ph


def apply_recompute(fw: fx.GraphModule, bw: fx.GraphModule, names: Sequence[str], adapted: AdapterResult,
                    num_fwd_outputs: int) -> None:
    """Rewrite the partitioned pair ``fw``/``bw`` (in place) so that each saved tensor in
    ``names`` is recomputed in the backward as the planner models it (module docstring,
    step 3). ``adapted`` must come from :func:`build_problem` on this same pair."""
    recomputed = set(names)
    writer = _RecomputeWriter(fw, bw, recomputed, adapted, num_fwd_outputs)
    for name in sorted(recomputed, key=lambda n: (writer.tensors[n].first_backward_use, n)):
        ph = writer.placeholders[name]
        if ph.users:
            value = writer.materialize(name, writer.tensors[name].first_backward_use)
            ph.replace_all_uses_with(value)
        bw.graph.erase_node(ph)
        del writer.placeholders[name]
    output = next(n for n in fw.graph.nodes if n.op == "output")
    outputs = output.args[0]
    if not isinstance(outputs, (list, tuple)):
        raise RuntimeError(f"memory plan: the forward graph returns {type(outputs).__name__}, not the flat "
                           "list the partitioner makes; this is a bug in mxcompile, please report it")
    kept = [leaf for i, leaf in enumerate(outputs)
            if i < num_fwd_outputs or not (isinstance(leaf, fx.Node) and leaf.name in recomputed)]
    # New saved graph inputs go first among the saved values: the backward reads its saved
    # placeholders in forward-output order after the saved SymInts (see the partitioner).
    kept[num_fwd_outputs:num_fwd_outputs] = writer.new_inputs
    output.args = (type(outputs)(kept),)
    fw.graph.eliminate_dead_code()
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def _fake_call(op: Any, *args: Any) -> torch.Tensor:
    value = args[0]
    mode = getattr(value, "fake_mode", None)
    if mode is None:
        return op(*args)
    with mode:
        return op(*args)


def insert_offload(fw: fx.GraphModule, bw: fx.GraphModule, names: Sequence[str], num_fwd_outputs: int) -> list[str]:
    """Wrap each saved tensor in ``names`` in offload (forward) / reload (backward) ops.
    Returns the names actually wrapped (a name the forward no longer saves is skipped)."""
    output = next(n for n in fw.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(output.args[0])
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    bw_placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    wrapped = []
    for name in names:
        node = fw_nodes.get(name)
        ph = bw_placeholders.get(name)
        positions = [i for i in range(num_fwd_outputs, len(leaves)) if leaves[i] is node]
        if node is None or ph is None or not positions:
            continue
        value = node.meta["val"]
        last = max((u for u in node.users if u.op != "output"), key=order.__getitem__, default=node)
        with fw.graph.inserting_after(last):
            moved = fw.graph.call_function(offload_ops.OFFLOAD, (node,))
        moved.meta["val"] = _fake_call(offload_ops.OFFLOAD, value)
        for i in positions:
            leaves[i] = moved
        users = [u for u in bw.graph.nodes if u in ph.users]
        if users:
            with bw.graph.inserting_before(users[0]):
                back = bw.graph.call_function(offload_ops.RELOAD, (ph, value.device))
            back.meta[PLAN_PLACED_KEY] = True  # kept after the node before it, as recomputations are
            back.meta["val"] = _fake_call(offload_ops.RELOAD, moved.meta["val"], value.device)
            ph.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        ph.meta["val"] = moved.meta["val"]
        wrapped.append(name)
    output.args = (pytree.tree_unflatten(leaves, spec),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return wrapped


def plan_report(plan: Plan, adapted: AdapterResult, *, profile: DeviceProfile) -> dict[str, Any]:
    """The JSON-friendly plan for ``report.memory_plan``."""
    problem = adapted.problem
    fractions = list(CURVE_FRACTIONS)
    budgets = [adapted.budget_for_fraction(f) for f in fractions]
    curve = budget_curve(problem, budgets, solver=CURVE_SOLVER, tie_groups=adapted.tie_groups)
    binding = problem.steps[plan.binding_step] if problem.steps else None
    return {
        "budget_bytes": plan.budget_bytes,
        "budget_fraction": adapted.fraction,
        "keep_all_peak_bytes": adapted.keep_all_peak_bytes,
        "activation_bytes": adapted.activation_bytes,
        "floor_bytes": adapted.floor_bytes,
        "min_peak_bytes": adapted.min_peak_bytes,
        "param_bytes": adapted.param_bytes,
        "input_bytes": adapted.input_bytes,
        "predicted_peak_bytes": plan.peak_bytes,
        "predicted_step_time_s": plan.step_time_s,
        "keep_all_step_time_s": plan.base_time_s,
        "recompute_time_s": plan.recompute_time_s,
        "transfer_exposed_s": plan.transfer_exposed_s,
        "binding_step": plan.binding_step,
        "binding_constraint": (
            f"peak {plan.peak_bytes} B of {plan.budget_bytes} B budget at step {plan.binding_step} "
            f"({binding.name!r}, {binding.phase})" if binding is not None else ""
        ),
        "solver": plan.solver,
        "optimal": plan.optimal,
        "status": plan.status,
        "profile": profile.name,
        "tensors": [
            {"name": d.name, "bytes": d.nbytes, "decision": d.decision, "cost_s": d.cost_s, "reason": d.reason}
            for d in plan.decisions
        ],
        "recomputed": [d.name for d in plan.decisions if d.decision == RECOMPUTE],
        "offloaded": [d.name for d in plan.decisions if d.decision == OFFLOAD],
        "budget_curve": [
            {"fraction": f, "budget_bytes": p.budget_bytes, "feasible": p.feasible,
             "step_time_s": p.step_time_s if p.feasible else None, "peak_bytes": p.peak_bytes}
            for f, p in zip(fractions, curve)
        ],
    }


def _step_bytes(adapted: AdapterResult, curve: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Modelled bytes at each step, by node name: the forward graph's, then the backward's (a
    recomputation copied into the backward may share a forward node's name)."""
    phases: dict[str, dict[str, int]] = {FORWARD: {}, BACKWARD: {}}
    for step, nbytes in zip(adapted.problem.steps, curve, strict=True):
        phases[step.phase][step.name] = nbytes
    return phases[FORWARD], phases[BACKWARD]


def _chunk_report(plan: Plan, chunks: Sequence[ChunkDecision]) -> dict[str, Any]:
    """The attention chunks' part of ``report.memory_plan``: the decisions, and the plan's
    step time with the chosen chunks (it was made with one element per call) and its extra
    time over the step without a budget: recomputation (a recomputed attention op at its
    chosen chunk), exposed transfers, and the passes that smaller chunks add."""
    chunk_extra = sum(c.extra_time_s for c in chunks if not c.recomputed)
    extra = (plan.recompute_time_s - sum(c.saved_time_s for c in chunks if c.recomputed)
             + plan.transfer_exposed_s + chunk_extra)
    predicted = plan.step_time_s - sum(c.saved_time_s for c in chunks)
    return {
        "attention_chunks": [c.as_dict() for c in chunks],
        "attention_chunk_time_s": chunk_extra,
        "predicted_step_time_s": predicted,
        "extra_time_s": extra,
        "keep_all_step_time_s": predicted - extra,  # the step without a budget, unbudgeted chunks
    }


def _record(report: Report, entry: dict[str, Any]) -> None:
    """One dynamo graph's plan: its keys at the top level (the common one-graph case), and
    every graph's plan under "graphs"."""
    graphs = list((report.memory_plan or {}).get("graphs", []))
    graphs.append(entry)
    report.memory_plan = {**entry, "graphs": graphs}


# --------------------------------------------------------------------------- the hook


def plan_and_partition(
    joint: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    config: MXConfig,
    report: Report,
    partition_fn: Partitioner,
    num_fwd_outputs: int,
    param_input_indices: Sequence[int],
    clone: Callable[[fx.GraphModule], fx.GraphModule],
    memory_model: MemoryModel = MemoryModel.OP_BY_OP,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition ``joint``; with ``config.memory_budget`` set, plan the saved activations of
    that partition and rewrite it to follow the plan (see the module docstring), modelling what
    the step allocates as ``memory_model`` says the lowering will.

    Raises:
        BudgetInfeasibleError: the budget cannot be met; the message names the smallest
            budget that can. A configuration error, never hidden by ``config.fallback``.
    """
    fw0, bw0 = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    hoisted = hoist_saved_values(fw0, num_fwd_outputs)
    counters["mxcompile"]["hoisted_saved_values"] += len(hoisted)
    if config.memory_budget is None:
        return fw0, bw0
    profile = profile_for(joint)
    adapted = build_problem(fw0, bw0, num_fwd_outputs=num_fwd_outputs, param_input_indices=param_input_indices,
                            profile=profile, budget=config.memory_budget, offload=config.offload,
                            memory_model=memory_model)
    budget = adapted.problem.budget_bytes
    target = budget
    best: tuple[int, Plan, fx.GraphModule, fx.GraphModule, AdapterResult] | None = None
    rounds = 0
    for rounds in range(1, MAX_PLAN_ROUNDS + 1):
        try:
            plan = plan_activation_memory(replace(adapted.problem, budget_bytes=target), solver=PLAN_SOLVER,
                                          time_limit_s=PLAN_TIME_LIMIT_S, tie_groups=adapted.tie_groups)
        except BudgetInfeasibleError:
            if best is None:
                raise  # the budget itself is infeasible: a configuration error for the user
            break  # a tightened target is infeasible: keep the best rewrite found
        fw, bw = clone(fw0), clone(bw0)
        apply_recompute(fw, bw, [d.name for d in plan.decisions if d.decision == RECOMPUTE], adapted,
                        num_fwd_outputs)
        realized = build_problem(fw, bw, num_fwd_outputs=num_fwd_outputs, param_input_indices=param_input_indices,
                                 profile=profile, offload=config.offload, with_min_peak=False,
                                 memory_model=memory_model)
        offload_names = {d.name for d in plan.decisions if d.decision == OFFLOAD}
        modelled = evaluate(realized.problem, {t.name: OFFLOAD if t.name in offload_names else KEEP
                                               for t in realized.problem.tensors})
        if best is None or modelled.peak_bytes < best[0]:
            best = (modelled.peak_bytes, plan, fw, bw, realized, modelled.memory_curve)
        if modelled.peak_bytes <= budget:
            break
        target -= modelled.peak_bytes - budget  # the rewrite overshot the model: plan again, tighter by the overshoot
    assert best is not None
    peak, plan, fw, bw, realized, curve = best
    changed = any(d.decision in (OFFLOAD, RECOMPUTE) for d in plan.decisions)
    # A plan that keeps every saved tensor (a budget at or above the keep-everything peak, e.g.
    # 1.0) is no plan: the graphs are the unplanned partition's and compile as such (Inductor's
    # own reordering on), so the step is the no-budget step.
    if not changed:
        fw, bw = fw0, bw0
    chunks = widen_attention_chunks((fw, bw), _step_bytes(realized, curve), budget, profile)
    entry = plan_report(plan, adapted, profile=profile)
    entry.update(budget_bytes=budget, planned_for_bytes=plan.budget_bytes, plan_rounds=rounds,
                 realized_peak_bytes=peak, realized_saved_bytes=sum(t.nbytes for t in realized.problem.tensors),
                 budget_met=peak <= budget, memory_model=memory_model.value, hoisted_saved_values=hoisted,
                 **_chunk_report(plan, chunks))
    if peak > budget:
        warnings.warn(
            f"memory plan: the rewritten graphs' modelled peak {peak} B exceeds memory_budget {budget} B after "
            f"{rounds} planning rounds; raise memory_budget to at least {peak} bytes to meet it exactly",
            stacklevel=2,
        )
    offloaded = [d.name for d in plan.decisions if d.decision == OFFLOAD]
    entry["offload_applied"] = insert_offload(fw, bw, offloaded, num_fwd_outputs) if offloaded else []
    entry["graphs_changed"] = changed
    _record(report, entry)
    if not changed:
        return fw, bw
    for gm in (fw, bw):
        gm.meta[PLANNED_GRAPH_KEY] = True
    return fw, bw


__all__ = ["apply_recompute", "insert_offload", "plan_and_partition", "plan_report", "profile_for"]
