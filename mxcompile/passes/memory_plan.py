"""Apply the activation-memory plan: recompute via partitioner tags, offload via custom ops.

Flow (:func:`plan_and_partition`, called by ``backend.compile_graph``'s partition step):

1. partition a copy of the rewritten joint graph as usual (min-cut);
2. build the planner's :class:`~mxcompile.planner.Problem` from that forward/backward pair
   (:mod:`mxcompile.planner.fx_adapter`) and plan it for ``config.memory_budget``;
3. tag the *joint* graph: every node a recomputed tensor replays gets
   ``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``, every kept or offloaded tensor
   ``MUST_SAVE``. ``min_cut_rematerialization_partition`` honors these tags (the same ones
   ``torch.utils.checkpoint`` selective checkpointing sets): a MUST_RECOMPUTE node gets an
   infinite edge to the sink (it runs in the backward), a MUST_SAVE node an infinite edge
   from the source (it cannot be recomputed). We set no ``ac_graph_id``: that id only makes
   the partitioner save the boundary between *different* checkpoint regions, and our
   recompute closures already end at saved tensors;
4. partition the tagged joint graph, and model the peak of *that* partition (the adapter again,
   with the planned offloads). The partitioner does not follow the plan to the byte: it
   replays a recomputed op's sibling outputs, keeps a recompute closure's intermediates alive
   in the backward, may save a cheaper neighbour. If the modelled peak overshoots the budget,
   plan again with the target lowered by the overshoot (at most ``MAX_PLAN_ROUNDS`` times)
   and keep the partition with the lowest peak;
5. for offloaded tensors, wrap the saved value in ``mxcompile::offload`` (forward, after its
   last forward use) and ``mxcompile::reload`` (backward, before its first use).

Recomputation replays the same deterministic ops on the same inputs, so gradients are
bit-identical to the unplanned step (random ops are never recomputed, see the adapter).

Offload on CUDA here is a plain ``.to("cpu", non_blocking=True)`` on the compute stream,
into pageable memory: correct, but the copy is not overlapped with compute as the planner's
model assumes (pinned buffers and a side stream are future work). On CPU the "host" is the
same memory, so an offload is a real copy that saves nothing: it exists to exercise the
mechanism.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from ..config import MXConfig
from ..cost.profiles import PROFILES, DeviceProfile, measure_cpu_profile
from ..planner import BudgetInfeasibleError, KEEP, OFFLOAD, RECOMPUTE, Plan, budget_curve, evaluate, plan_activation_memory
from ..planner.fx_adapter import AdapterResult, build_problem
from ..report import Report

HOST_DEVICE = torch.device("cpu")
PLAN_SOLVER = "auto"  # the ILP for small graphs, the heuristic for large (see mxcompile.planner)
PLAN_TIME_LIMIT_S = 5.0  # per ILP solve; the plan is part of compile time
MAX_PLAN_ROUNDS = 4  # plan, partition, check the partition's peak; re-plan tighter if it overshot
CURVE_FRACTIONS: tuple[float, ...] = (1.0, 0.75, 0.5, 0.3)  # report.memory_plan["budget_curve"]
CURVE_SOLVER = "heuristic"  # the curve is informative: the fast, monotone solver is enough
DEFAULT_GPU_PROFILE = "H100 SXM"  # for a CUDA device whose name matches no known profile

Partitioner = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


# --------------------------------------------------------------------------- offload ops


@torch.library.custom_op("mxcompile::offload", mutates_args=())
def offload_op(x: torch.Tensor) -> torch.Tensor:
    """Copy a saved activation to host memory (a new tensor, even on CPU)."""
    return x.to(HOST_DEVICE, copy=True, non_blocking=x.device.type != HOST_DEVICE.type)


@offload_op.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device=HOST_DEVICE)


@torch.library.custom_op("mxcompile::reload", mutates_args=())
def reload_op(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy an offloaded activation back to ``device`` (a new tensor)."""
    return x.to(device, copy=True)


@reload_op.register_fake
def _reload_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


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


def tag_joint(joint: fx.GraphModule, plan: Plan, adapted: AdapterResult) -> dict[str, int]:
    """Set the recompute tags of :mod:`this module <mxcompile.passes.memory_plan>` on the
    joint graph's nodes (matched by name); returns how many nodes got each tag."""
    by_name = {n.name: n for n in joint.graph.nodes if n.op == "call_function"}
    recompute = {name for d in plan.decisions if d.decision == RECOMPUTE for name in adapted.closures[d.name]}
    save = {d.name for d in plan.decisions if d.decision != RECOMPUTE} - recompute
    missing = sorted(name for name in recompute | save if name not in by_name and name in adapted.closures)
    counts = {"must_recompute": 0, "must_save": 0}
    for name in sorted(recompute):
        if name in by_name:
            by_name[name].meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            counts["must_recompute"] += 1
    for name in sorted(save):
        if name in by_name:
            by_name[name].meta["recompute"] = CheckpointPolicy.MUST_SAVE
            counts["must_save"] += 1
    if any(name in recompute for name in missing):
        raise RuntimeError(
            f"memory plan: forward nodes {missing} are not in the joint graph, so the plan cannot be "
            "applied; this is a bug in mxcompile (node names changed between partitions), please report it"
        )
    return counts


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
            moved = fw.graph.call_function(torch.ops.mxcompile.offload.default, (node,))
        moved.meta["val"] = _fake_call(torch.ops.mxcompile.offload.default, value)
        for i in positions:
            leaves[i] = moved
        users = [u for u in bw.graph.nodes if u in ph.users]
        if users:
            with bw.graph.inserting_before(users[0]):
                back = bw.graph.call_function(torch.ops.mxcompile.reload.default, (ph, value.device))
            back.meta["val"] = _fake_call(torch.ops.mxcompile.reload.default, moved.meta["val"], value.device)
            ph.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        ph.meta["val"] = moved.meta["val"]
        wrapped.append(name)
    output.args = (pytree.tree_unflatten(leaves, spec),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return wrapped


def _saved_names(fw: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    return {n.name for n in pytree.tree_leaves(output.args[0])[num_fwd_outputs:] if isinstance(n, fx.Node)}


def plan_report(plan: Plan, adapted: AdapterResult, *, profile: DeviceProfile) -> dict[str, Any]:
    """The JSON-friendly plan for ``report.memory_plan``."""
    problem = adapted.problem
    fractions = list(CURVE_FRACTIONS)
    budgets = [adapted.budget_for_fraction(f) for f in fractions]
    curve = budget_curve(problem, budgets, solver=CURVE_SOLVER)
    binding = problem.steps[plan.binding_step] if problem.steps else None
    return {
        "budget_bytes": plan.budget_bytes,
        "budget_fraction": adapted.fraction,
        "keep_all_peak_bytes": adapted.keep_all_peak_bytes,
        "activation_bytes": adapted.activation_bytes,
        "floor_bytes": adapted.floor_bytes,
        "param_bytes": adapted.param_bytes,
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


def _restore_tags(original: dict[fx.Node, Any]) -> None:
    for node, tag in original.items():
        if tag is None:
            node.meta.pop("recompute", None)
        else:
            node.meta["recompute"] = tag


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
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition ``joint``; with ``config.memory_budget`` set, plan the saved activations
    first and partition under that plan (see the module docstring).

    Raises:
        BudgetInfeasibleError: the budget cannot be met; the message names the smallest
            budget that can. A configuration error, never hidden by ``config.fallback``.
    """
    if config.memory_budget is None:
        return partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    fw0, bw0 = partition_fn(clone(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    profile = profile_for(joint)
    adapted = build_problem(fw0, bw0, num_fwd_outputs=num_fwd_outputs, param_input_indices=param_input_indices,
                            profile=profile, budget=config.memory_budget, offload=config.offload)
    budget = adapted.problem.budget_bytes
    original_tags = {n: n.meta.get("recompute") for n in joint.graph.nodes}
    target = budget
    best: tuple[int, Plan, dict[str, int], fx.GraphModule, fx.GraphModule, AdapterResult | None] | None = None
    rounds = 0
    for rounds in range(1, MAX_PLAN_ROUNDS + 1):
        try:
            plan = plan_activation_memory(replace(adapted.problem, budget_bytes=target), solver=PLAN_SOLVER,
                                          time_limit_s=PLAN_TIME_LIMIT_S)
        except BudgetInfeasibleError:
            if best is None:
                raise  # the budget itself is infeasible: a configuration error for the user
            break  # a tightened target is infeasible: keep the best partition found
        _restore_tags(original_tags)
        tags = tag_joint(joint, plan, adapted)
        fw, bw = partition_fn(clone(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        realized = build_problem(fw, bw, num_fwd_outputs=num_fwd_outputs, param_input_indices=param_input_indices,
                                 profile=profile, offload=config.offload)
        offload_names = {d.name for d in plan.decisions if d.decision == OFFLOAD}
        peak = evaluate(realized.problem, {t.name: OFFLOAD if t.name in offload_names else KEEP
                                           for t in realized.problem.tensors}).peak_bytes
        if best is None or peak < best[0]:
            best = (peak, plan, tags, fw, bw, realized)
        if peak <= budget:
            break
        target -= peak - budget  # the partition overshot the model: plan again, tighter by the overshoot
    _restore_tags(original_tags)
    assert best is not None
    peak, plan, tags, fw, bw, realized = best
    entry = plan_report(plan, adapted, profile=profile)
    entry.update(budget_bytes=budget, planned_for_bytes=plan.budget_bytes, tags=tags, plan_rounds=rounds,
                 realized_peak_bytes=peak, realized_saved_bytes=sum(t.nbytes for t in realized.problem.tensors),
                 budget_met=peak <= budget)
    if peak > budget:
        warnings.warn(
            f"memory plan: the partitioned graph's modelled peak {peak} B exceeds memory_budget {budget} B after "
            f"{rounds} planning rounds; raise memory_budget to at least {peak} bytes to meet it exactly",
            stacklevel=2,
        )
    offloaded = [d.name for d in plan.decisions if d.decision == OFFLOAD]
    entry["offload_applied"] = insert_offload(fw, bw, offloaded, num_fwd_outputs) if offloaded else []
    # What the partitioner actually saved, against the plan (it may recompute a sibling output
    # of a recomputed op, or save a cheaper neighbour): informational.
    saved_after = _saved_names(fw, num_fwd_outputs)
    planned_keep = {d.name for d in plan.decisions if d.decision in (KEEP, OFFLOAD) and d.nbytes > 0}
    recomputed = {d.name for d in plan.decisions if d.decision == RECOMPUTE}
    entry["deviations"] = sorted(
        [f"{n}: planned {RECOMPUTE}, still saved" for n in recomputed & saved_after]
        + [f"{n}: planned kept, not saved" for n in planned_keep - saved_after]
    )
    _record(report, entry)
    return fw, bw


__all__ = ["insert_offload", "plan_and_partition", "plan_report", "profile_for", "tag_joint"]
