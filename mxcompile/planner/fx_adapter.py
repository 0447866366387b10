"""Build a planner :class:`~mxcompile.planner.Problem` from AOTAutograd's partitioned graphs.

Input: the forward and backward graphs that ``min_cut_rematerialization_partition`` produced
from the (rewritten) joint graph. We read the *partitioned* graphs rather than the joint
graph because the partition decides what is saved (the forward's outputs beyond the user
outputs) and in which order each phase runs; the planner's decisions are then applied back
to the joint graph by :mod:`mxcompile.passes.memory_plan` (tags the partitioner honors).
Node names are preserved by the partitioner, so a forward node, a backward placeholder and
the joint node share one name.

Schedule
    Every ``call_function`` node of the forward graph, in order, then every one of the
    backward graph; each with a roofline time estimate (:mod:`mxcompile.cost.graph_costs`).

Saved tensors (the decision variables)
    The forward's outputs beyond the user outputs, except parameters (alive anyway) and
    non-tensors (SymInts). A saved *view of a parameter* (e.g. ``t(weight)``) is listed with
    0 bytes (it shares the parameter's storage). Saved views of one storage (q, k and v cut
    from one GEMM output by ``split``) take one decision and count the whole storage: it is
    freed only when the last of them is. Saved outputs of one op with several (a quantize op's
    data, scales and tensor scale) take one decision too, and their recomputation replays the
    op once: its time is counted on the first of them. A saved graph input that is not a parameter
    (e.g. token ids) is held by the caller: 0 bytes, not recomputable.
    ``produced_at`` / ``last_forward_use`` are forward step indices (0 for inputs);
    ``first_backward_use`` / ``last_backward_use`` are the backward steps reading its
    placeholder. Recomputing a tensor replays its forward *closure*: the producer and every
    forward node back to the nearest saved tensors or graph inputs (``recompute_inputs``);
    its cost is the closure's estimated time as the lowering runs it (:meth:`MemoryModel.run_time_s`:
    under Inductor with its pointwise chains fused, :func:`~mxcompile.cost.graph_costs.fused_run_time_s`;
    op by op with each MX GEMM as its torch reference,
    :func:`~mxcompile.cost.graph_costs.op_by_op_run_time_s`), and its ``recompute_work_bytes`` the peak bytes
    of the closure's intermediates during the replay (each freed after its last use inside
    the closure) beyond the tensor itself. A closure with a random op (``native_dropout``,
    ``rand*``, ``bernoulli``...) is not recomputable.

Baseline (bytes at each step that are not decisions)
    parameters and the caller's inputs (every step), each op's workspace (its step only,
    :func:`~mxcompile.cost.graph_costs.workspace_bytes`), transient activations that are not
    saved (from their producer to their last use, aliases extending their base), the user
    outputs (to the end of the step: the caller holds them through the backward), tangents
    (from the start of the backward to its end: autograd holds them until the backward
    returns), and gradients (from production to the end of the step, i.e. grads are set to
    None between steps). Optimizer state lives outside the step: it adds the same bytes to
    every step, so it shifts the peak without changing any decision; add it to a byte budget
    yourself if you want it counted (a fractional budget is relative and needs nothing).

What allocates (:class:`MemoryModel`)
    Run op by op (the eager lowering), every op stores its output. Inductor computes a pointwise
    op read by one pointwise op inside that op's kernel and never stores it
    (:func:`~mxcompile.cost.graph_costs.fused_into_reader`): such a node allocates nothing, and
    what it reads is read where its reader runs. A model that stores these overestimated the
    12-layer MLP's keep-everything step by half (each GELU's intermediates), so a fraction of
    its activation memory was a fraction of bytes that never exist.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..cost.graph_costs import (alias_root, fused_into_reader, fused_run_time_s, is_alias, node_bytes, node_time_s,
                                op_by_op_run_time_s, op_by_op_time_s, workspace_bytes)
from ..cost.profiles import DeviceProfile
from .budget import MemoryBudget
from .heuristic import HeuristicPlanner
from .memory import evaluate
from .problem import BACKWARD, FORWARD, KEEP, Problem, SavedTensor, Step

# Placeholder budget while measuring the keep-everything peak; replaced before planning.
_UNBOUNDED_BUDGET = 2**62

_RANDOM_OP_PREFIXES = ("aten::native_dropout", "aten::rand", "aten::bernoulli", "aten::normal",
                       "aten::uniform", "aten::exponential", "aten::multinomial", "aten::poisson",
                       "rngprims::", "prims::inductor_random", "prims::philox")


class MemoryModel(enum.Enum):
    """How the lowering that runs a step executes it: which ops store their outputs, and so how
    its ops and recomputations are timed."""

    # every op stores its output, and runs alone (the eager lowering; MX GEMMs as their reference)
    OP_BY_OP = "op_by_op"
    # not a pointwise op read by one pointwise op; pointwise chains run fused (Inductor)
    FUSED_POINTWISE = "fused_pointwise"

    def step_time_s(self, node: fx.Node, profile: DeviceProfile) -> float:
        """The estimated time of one op of the step."""
        if self is MemoryModel.OP_BY_OP:
            return op_by_op_time_s(node, profile)
        return node_time_s(node, profile)

    def run_time_s(self, nodes: list[fx.Node], profile: DeviceProfile) -> float:
        """The estimated time of running ``nodes`` (a recomputation's closure, in graph order)."""
        if self is MemoryModel.OP_BY_OP:
            return op_by_op_run_time_s(nodes, profile)
        return fused_run_time_s(nodes, profile)


def fused_nodes(nodes: Sequence[fx.Node], model: MemoryModel) -> frozenset[fx.Node]:
    """The nodes of ``nodes`` that ``model`` computes inside their reader's kernel."""
    if model is MemoryModel.OP_BY_OP:
        return frozenset()
    return frozenset(n for n in nodes if fused_into_reader(n))


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (recomputing it would not give the same value)."""
    if node.op != "call_function":
        return False
    target = node.target
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return True
    schema = getattr(target, "_schema", None)
    name = schema.name if schema is not None else getattr(target, "__name__", "")
    return any(name.startswith(prefix) for prefix in _RANDOM_OP_PREFIXES)


@dataclass(frozen=True)
class AdapterResult:
    """A :class:`Problem` plus what is needed to apply its plan to the graphs.

    Attributes:
        problem: the planning problem (its budget already resolved to bytes).
        closures: saved tensor name -> names of the forward nodes a recompute replays
            (the producer included).
        keep_all_peak_bytes: predicted peak when every saved tensor is kept.
        floor_bytes: the largest baseline (non-decision bytes) over the steps.
        min_peak_bytes: the lowest peak the planner reaches (every tensor it can free
            freed, :meth:`HeuristicPlanner.min_peak`); it is at least the floor, plus what
            must be resident where the peak is (e.g. the inputs of the op running there).
        activation_bytes: ``keep_all_peak_bytes - min_peak_bytes``: the activation memory
            a plan can take off the peak; a fractional budget scales this, as torch's
            ``activation_memory_budget`` scales the range between its most aggressive
            recompute and its default partition.
        param_bytes: parameter bytes (part of every step's baseline).
        input_bytes: parameters and the caller's inputs: the bytes alive before the step
            starts (a measured step peak adds to them).
        tie_groups: saved views of one storage (e.g. q, k and v cut from one qkv GEMM
            output): the storage is freed only when all of them are, so they take one
            decision (pass to the solvers) and share one lifetime.
        fraction: the fractional budget asked for, or None for a byte budget.
    """

    problem: Problem
    closures: dict[str, tuple[str, ...]]
    keep_all_peak_bytes: int
    floor_bytes: int
    min_peak_bytes: int
    activation_bytes: int
    param_bytes: int
    input_bytes: int
    tie_groups: tuple[tuple[str, ...], ...] = ()
    fraction: float | None = None
    notes: tuple[str, ...] = field(default=())

    def budget_for_fraction(self, fraction: float) -> int:
        """Bytes of a fractional budget: ``min_peak + fraction * activation_bytes`` (rounded
        up), so 1.0 is exactly the keep-everything peak and 0.0 the lowest reachable one."""
        return max(1, math.ceil(self.min_peak_bytes + fraction * self.activation_bytes))


def _saved_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> list[Any]:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    return pytree.tree_leaves(output.args[0])[num_fwd_outputs:]


def _use_steps(node: fx.Node, step_of: dict[fx.Node, int], fused: frozenset[fx.Node] = frozenset(), *,
               through_views: bool = True) -> set[int]:
    """Steps reading ``node``'s storage: its users and, ``through_views``, the users of its
    views. A user in ``fused`` runs inside its reader's kernel, wherever that runs: both its
    own step (the earliest a rewrite may have to supply the value, as in graph order) and its
    readers' steps (the latest the value is read) count."""
    steps: set[int] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user in step_of:
                steps.add(step_of[user])
                if user in fused or (through_views and is_alias(user)):
                    stack.append(user)
    return steps


def _add_interval(baseline: list[int], lo: int, hi: int, nbytes: int) -> None:
    for t in range(max(lo, 0), hi + 1):
        baseline[t] += nbytes


def _liveness(
    nodes: Sequence[fx.Node],
    step_of: dict[fx.Node, int],
    *,
    excluded: set[fx.Node],
    end_step: dict[fx.Node, int],
    fused: frozenset[fx.Node] = frozenset(),
) -> list[tuple[int, int, int]]:
    """(first step, last step, bytes) of every allocating node in ``nodes``, aliases
    extending their root's lifetime; ``end_step`` forces a later end (outputs). Nodes in
    ``fused`` allocate nothing; what they read is read where their readers run."""
    intervals = []
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        root = alias_root(node)
        for step in _use_steps(node, step_of, fused, through_views=False):  # views are their own nodes here
            last_use[root] = max(last_use.get(root, -1), step)
        if node in end_step:
            last_use[root] = max(last_use.get(root, -1), end_step[node])
    for node in nodes:
        if node in excluded or node in fused or is_alias(node) or node.op != "call_function":
            continue
        start = step_of[node]
        intervals.append((start, max(start, last_use.get(node, start)), node_bytes(node)))
    return intervals


def build_problem(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    param_input_indices: Sequence[int],
    profile: DeviceProfile,
    budget: MemoryBudget | None = None,
    offload: bool = False,
    with_min_peak: bool = True,
    memory_model: MemoryModel = MemoryModel.OP_BY_OP,
) -> AdapterResult:
    """The planning problem of one partitioned training step (see the module docstring).

    Args:
        fw, bw: the partitioned forward and backward graphs (nodes with ``meta["val"]``).
        num_fwd_outputs: the forward's user outputs (the rest are saved for the backward).
        param_input_indices: forward placeholder indices of parameters and buffers.
        profile: the device whose rates time the steps and whose host link an offload uses.
        budget: bytes or a fraction in (0, 1] of the activation headroom (see
            :meth:`AdapterResult.budget_for_fraction`), or None (keep-everything peak).
        offload: allow the "offload" decision (the profile's host-link bandwidth).
        with_min_peak: find ``min_peak_bytes`` (a heuristic run); without it, it is the
            floor (enough for checking a graph's peak, not for fractional budgets).
        memory_model: which ops store their outputs (the lowering that will run the step).
    """
    fw_nodes = [n for n in fw.graph.nodes if n.op == "call_function"]
    bw_nodes = [n for n in bw.graph.nodes if n.op == "call_function"]
    if not fw_nodes or not bw_nodes:
        raise ValueError(
            f"cannot plan a step with {len(fw_nodes)} forward and {len(bw_nodes)} backward ops: the "
            "memory planner needs both phases (is this an inference graph?); unset memory_budget for it"
        )
    n_fwd = len(fw_nodes)
    steps = [Step(n.name, FORWARD, memory_model.step_time_s(n, profile)) for n in fw_nodes]
    steps += [Step(n.name, BACKWARD, memory_model.step_time_s(n, profile)) for n in bw_nodes]
    n_steps = len(steps)
    fw_step = {n: i for i, n in enumerate(fw_nodes)}
    bw_step = {n: n_fwd + i for i, n in enumerate(bw_nodes)}
    fused = fused_nodes([*fw_nodes, *bw_nodes], memory_model)

    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i] for i in param_input_indices if i < len(placeholders)}
    param_bytes = sum(node_bytes(p) for p in params)
    caller_inputs = [p for p in placeholders if p not in params]
    caller_bytes = sum(node_bytes(p) for p in caller_inputs)
    output = next(n for n in fw.graph.nodes if n.op == "output")
    user_outputs = [n for n in pytree.tree_leaves(output.args[0])[:num_fwd_outputs] if isinstance(n, fx.Node)]
    saved = [n for n in _saved_nodes(fw, num_fwd_outputs)
             if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) and n not in params]
    saved_set = set(saved)
    bw_placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}

    # Baseline: parameters and caller inputs, transients, user outputs, tangents, gradients.
    # The caller holds the user outputs through the backward (`loss.backward()`), and autograd
    # holds the tangents until the backward returns: both count to the end of the step. A saved
    # tensor in the storage of a user output is counted there (deciding about it frees nothing).
    baseline = [param_bytes + caller_bytes] * n_steps
    held_by_caller = {alias_root(n) for n in user_outputs}
    step_end = {n: n_steps - 1 for n in user_outputs}
    counted_as_saved = {n for n in saved_set if alias_root(n) not in held_by_caller}
    for lo, hi, nbytes in _liveness(fw_nodes, fw_step, excluded=counted_as_saved, end_step=step_end, fused=fused):
        _add_interval(baseline, lo, hi, nbytes)
    bw_output = next(n for n in bw.graph.nodes if n.op == "output")
    grads = {n: n_steps - 1 for n in pytree.tree_leaves(bw_output.args[0]) if isinstance(n, fx.Node)}
    for lo, hi, nbytes in _liveness(bw_nodes, bw_step, excluded=set(), end_step=grads, fused=fused):
        _add_interval(baseline, lo, hi, nbytes)
    for step, node in enumerate([*fw_nodes, *bw_nodes]):
        baseline[step] += workspace_bytes(node)
    for name, ph in bw_placeholders.items():
        if name.startswith("tangents"):
            _add_interval(baseline, n_fwd, n_steps - 1, node_bytes(ph))

    resident = [p.name for p in placeholders if p not in saved_set]
    tensors: list[SavedTensor] = []
    closures: dict[str, tuple[str, ...]] = {}
    for node in saved:
        root = alias_root(node)
        is_input = node.op == "placeholder"
        nbytes = 0 if (root in params or root.op == "placeholder" or root in held_by_caller) else node_bytes(node)
        produced = fw_step.get(node, 0)
        fw_uses = _use_steps(node, fw_step, fused)
        ph = bw_placeholders.get(node.name)
        bw_uses = sorted(_use_steps(ph, bw_step, fused)) if ph is not None else []
        closure, inputs, random = ([], [], False) if is_input else _closure(node, saved_set, fw_step)
        closures[node.name] = tuple(n.name for n in closure)
        tensors.append(SavedTensor(
            name=node.name,
            nbytes=nbytes,
            produced_at=produced,
            last_forward_use=max([produced, *fw_uses]),
            first_backward_use=bw_uses[0] if bw_uses else n_fwd,
            last_backward_use=bw_uses[-1] if bw_uses else n_fwd,
            recompute_cost_s=memory_model.run_time_s(closure, profile),
            recompute_inputs=tuple(i.name for i in inputs),
            recomputable=not (is_input or random),
            offloadable=nbytes > 0,
            recompute_work_bytes=max(0, replay_peak_bytes(closure) - node_bytes(node)),
        ))
    held = [(n, t) for n, t in zip(saved, tensors) if t.nbytes > 0]
    siblings = _output_groups([n for n, _ in held])
    ties = _merged_groups([*_storage_groups([n for n, _ in held]), *siblings])
    tensors = _count_whole_storages(_replayed_once(tensors, siblings), [n for n, _ in held])
    tensors = _share_lifetimes(tensors, ties)
    problem = Problem(
        steps=tuple(steps),
        tensors=tuple(tensors),
        baseline_bytes=tuple(baseline),
        budget_bytes=_UNBOUNDED_BUDGET,
        resident_inputs=tuple(resident),
        host_link_bandwidth=profile.host_link_bandwidth if offload else None,
    )
    keep_all = evaluate(problem, {t.name: KEEP for t in tensors})
    floor = max(baseline)
    min_peak = HeuristicPlanner(problem, tie_groups=ties).min_peak().peak_bytes if with_min_peak else floor
    result = AdapterResult(
        problem=problem,
        closures=closures,
        keep_all_peak_bytes=keep_all.peak_bytes,
        floor_bytes=floor,
        min_peak_bytes=min_peak,
        activation_bytes=max(0, keep_all.peak_bytes - min_peak),
        param_bytes=param_bytes,
        input_bytes=param_bytes + caller_bytes,
        tie_groups=ties,
    )
    if budget is None:
        budget_bytes, fraction = keep_all.peak_bytes, None
    elif budget.fraction is not None:
        budget_bytes, fraction = result.budget_for_fraction(budget.fraction), budget.fraction
    else:
        budget_bytes, fraction = budget.bytes, None
    return replace(result, problem=replace(problem, budget_bytes=max(1, budget_bytes)), fraction=fraction)


def _storage_root(node: fx.Node) -> fx.Node:
    """The node owning ``node``'s storage: through views, and through ``getitem`` of a view op
    that returns a list (``split``, ``unbind``, ``chunk``: every piece views its input), but
    not through ``getitem`` of an op with several outputs of its own (each output is its own
    storage)."""
    while is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        if node.target is operator.getitem and not is_alias(node.args[0]):
            break
        node = node.args[0]
    return node


def _by_storage(saved: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """The saved nodes grouped by the node owning their storage (:func:`_storage_root`)."""
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for node in saved:
        by_root.setdefault(_storage_root(node), []).append(node)
    return by_root


def _storage_groups(saved: Sequence[fx.Node]) -> tuple[tuple[str, ...], ...]:
    """Names of saved tensors sharing one storage, for every storage held by two or more."""
    return tuple(tuple(n.name for n in views) for views in _by_storage(saved).values() if len(views) > 1)


def _output_groups(saved: Sequence[fx.Node]) -> tuple[tuple[str, ...], ...]:
    """Names of saved outputs of one op with several outputs (``getitem`` of an op that is not a
    view: a quantize op's data, scales and tensor scale; an attention op's output and row
    statistics), for every op with two or more of them saved. Recomputing any of them replays
    the whole op, so they take one decision (see :func:`_replayed_once`)."""
    by_op: dict[fx.Node, list[fx.Node]] = {}
    for node in saved:
        if (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
                and not is_alias(node.args[0])):
            by_op.setdefault(node.args[0], []).append(node)
    return tuple(tuple(n.name for n in outputs) for outputs in by_op.values() if len(outputs) > 1)


def _replayed_once(tensors: list[SavedTensor], groups: Sequence[Sequence[str]]) -> list[SavedTensor]:
    """The outputs of one op recomputed together replay it once (the rewrite copies a closure
    once per step, :func:`mxcompile.passes.memory_plan.apply_recompute`): its time and its
    intermediates stay on the first of them, the others cost nothing more."""
    index = {t.name: i for i, t in enumerate(tensors)}
    priced = list(tensors)
    for group in groups:
        for name in group[1:]:
            priced[index[name]] = replace(priced[index[name]], recompute_cost_s=0.0, recompute_work_bytes=0)
    return priced


def _merged_groups(groups: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """``groups`` with every two that share a name merged (a saved view of a saved output ties
    to its storage and, through it, to the op's other outputs), in order of first appearance."""
    merged: list[list[str]] = []
    for group in groups:
        overlapping = [i for i, m in enumerate(merged) if set(m) & set(group)]
        if not overlapping:
            merged.append(list(dict.fromkeys(group)))
            continue
        first = merged[overlapping[0]]
        for name in [n for i in overlapping[1:] for n in merged[i]] + list(group):
            if name not in first:
                first.append(name)
        merged = [m for i, m in enumerate(merged) if i not in overlapping[1:]]
    return tuple(tuple(m) for m in merged)


def _count_whole_storages(tensors: list[SavedTensor], held: Sequence[fx.Node]) -> list[SavedTensor]:
    """A saved view keeps its whole storage alive, not only the bytes it shows: where the saved
    views of one storage (``held``, the saved nodes with bytes of their own) add up to less than
    it (e.g. q and k saved, v not, all cut from one qkv GEMM output by ``split``), the rest is
    counted on the first of them. Views that overlap stay counted once each (an upper bound)."""
    index = {t.name: i for i, t in enumerate(tensors)}
    counted = list(tensors)
    for root, views in _by_storage(held).items():
        missing = node_bytes(root) - sum(node_bytes(view) for view in views)
        if missing > 0:
            first = index[views[0].name]
            counted[first] = replace(counted[first], nbytes=counted[first].nbytes + missing)
    return counted


def _share_lifetimes(tensors: list[SavedTensor], groups: Sequence[Sequence[str]]) -> list[SavedTensor]:
    """Give the members of each group the union of their lifetimes (first production and
    backward use, last forward and backward use): their storage lives that long."""
    index = {t.name: i for i, t in enumerate(tensors)}
    shared = list(tensors)
    for group in groups:
        members = [tensors[index[name]] for name in group]
        union = dict(
            produced_at=min(t.produced_at for t in members),
            last_forward_use=max(t.last_forward_use for t in members),
            first_backward_use=min(t.first_backward_use for t in members),
            last_backward_use=max(t.last_backward_use for t in members),
        )
        for name in group:
            shared[index[name]] = replace(tensors[index[name]], **union)
    return shared


def replay_peak_bytes(closure: Sequence[fx.Node]) -> int:
    """Peak bytes held while running ``closure`` (forward nodes in graph order) on its own:
    each allocating node adds its bytes (and its workspace while it runs), and is freed after
    the last closure node reading it or a view of it, except the last node (the result)."""
    members = set(closure)
    position = {n: i for i, n in enumerate(closure)}
    last_read: dict[fx.Node, int] = {}
    for node in closure:
        for arg in node.all_input_nodes:
            root = alias_root(arg)
            if root in members:
                last_read[root] = max(last_read.get(root, -1), position[node])
    frees: dict[int, int] = {}
    for root, index in last_read.items():
        if root is not alias_root(closure[-1]) and not is_alias(root):
            frees[index] = frees.get(index, 0) + node_bytes(root)
    live = peak = 0
    for index, node in enumerate(closure):
        if not is_alias(node):
            live += node_bytes(node)
        peak = max(peak, live + workspace_bytes(node))
        live -= frees.get(index, 0)
    return peak


def _closure(
    node: fx.Node, saved: set[fx.Node], fw_step: dict[fx.Node, int]
) -> tuple[list[fx.Node], list[fx.Node], bool]:
    """Forward nodes that recomputing ``node`` replays (in graph order), the saved tensors /
    graph inputs it starts from, and whether any replayed node is random."""
    members: set[fx.Node] = set()
    inputs: list[fx.Node] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if current in members:
            continue
        members.add(current)
        for arg in current.all_input_nodes:
            if arg.op == "placeholder" or arg in saved:
                if arg not in inputs:
                    inputs.append(arg)
            elif arg in fw_step and arg not in members:
                stack.append(arg)
    ordered = sorted(members, key=lambda n: fw_step[n])
    inputs.sort(key=lambda n: (fw_step.get(n, -1), n.name))
    return ordered, inputs, any(is_random(n) for n in ordered)
