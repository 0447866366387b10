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
    0 bytes (it shares the parameter's storage). A saved graph input that is not a parameter
    (e.g. token ids) is held by the caller: 0 bytes, not recomputable.
    ``produced_at`` / ``last_forward_use`` are forward step indices (0 for inputs);
    ``first_backward_use`` / ``last_backward_use`` are the backward steps reading its
    placeholder. Recomputing a tensor replays its forward *closure*: the producer and every
    forward node back to the nearest saved tensors or graph inputs (``recompute_inputs``);
    its cost is the closure's estimated time. A closure with a random op
    (``native_dropout``, ``rand*``, ``bernoulli``...) is not recomputable.

Baseline (bytes at each step that are not decisions)
    parameters and the caller's inputs (every step), transient activations that are not
    saved (from their producer to their last use, aliases extending their base), the user
    outputs (to the end of the forward), tangents (from the start of the backward to their
    last use), and gradients (from production to the end of the step, i.e. grads are set to
    None between steps). Optimizer state lives outside the step: it adds the same bytes to
    every step, so it shifts the peak without changing any decision; add it to a byte budget
    yourself if you want it counted (a fractional budget is relative and needs nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..cost.graph_costs import is_alias, node_bytes, node_time_s
from ..cost.profiles import DeviceProfile
from .memory import evaluate
from .problem import BACKWARD, FORWARD, KEEP, Problem, SavedTensor, Step

# Placeholder budget while measuring the keep-everything peak; replaced before planning.
_UNBOUNDED_BUDGET = 2**62

_RANDOM_OP_PREFIXES = ("aten::native_dropout", "aten::rand", "aten::bernoulli", "aten::normal",
                       "aten::uniform", "aten::exponential", "aten::multinomial", "aten::poisson",
                       "rngprims::", "prims::inductor_random", "prims::philox")


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
        activation_bytes: ``keep_all_peak_bytes - floor_bytes``, the headroom the saved
            activations add to the peak; a fractional budget scales this.
        param_bytes: parameter bytes (part of every step's baseline).
        fraction: the fractional budget asked for, or None for a byte budget.
    """

    problem: Problem
    closures: dict[str, tuple[str, ...]]
    keep_all_peak_bytes: int
    floor_bytes: int
    activation_bytes: int
    param_bytes: int
    fraction: float | None = None
    notes: tuple[str, ...] = field(default=())

    def budget_for_fraction(self, fraction: float) -> int:
        """Bytes of a fractional budget: ``floor + fraction * activation headroom`` (rounded
        up), so 1.0 is exactly the keep-everything peak."""
        return max(1, math.ceil(self.floor_bytes + fraction * self.activation_bytes))


def _saved_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> list[Any]:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    return pytree.tree_leaves(output.args[0])[num_fwd_outputs:]


def _alias_root(node: fx.Node) -> fx.Node:
    while is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _add_interval(baseline: list[int], lo: int, hi: int, nbytes: int) -> None:
    for t in range(max(lo, 0), hi + 1):
        baseline[t] += nbytes


def _liveness(
    nodes: Sequence[fx.Node],
    step_of: dict[fx.Node, int],
    *,
    excluded: set[fx.Node],
    end_step: dict[fx.Node, int],
) -> list[tuple[int, int, int]]:
    """(first step, last step, bytes) of every allocating node in ``nodes``, aliases
    extending their root's lifetime; ``end_step`` forces a later end (outputs)."""
    intervals = []
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        root = _alias_root(node)
        for user in node.users:
            if user in step_of:
                last_use[root] = max(last_use.get(root, -1), step_of[user])
        if node in end_step:
            last_use[root] = max(last_use.get(root, -1), end_step[node])
    for node in nodes:
        if node in excluded or is_alias(node) or node.op != "call_function":
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
    budget: int | float | None = None,
    offload: bool = False,
) -> AdapterResult:
    """The planning problem of one partitioned training step (see the module docstring).

    Args:
        fw, bw: the partitioned forward and backward graphs (nodes with ``meta["val"]``).
        num_fwd_outputs: the forward's user outputs (the rest are saved for the backward).
        param_input_indices: forward placeholder indices of parameters and buffers.
        profile: the device whose rates time the steps and whose host link an offload uses.
        budget: bytes (int), a fraction in (0, 1] of the activation headroom (float, see
            :meth:`AdapterResult.budget_for_fraction`), or None (keep-everything peak).
        offload: allow the "offload" decision (the profile's host-link bandwidth).
    """
    fw_nodes = [n for n in fw.graph.nodes if n.op == "call_function"]
    bw_nodes = [n for n in bw.graph.nodes if n.op == "call_function"]
    if not fw_nodes or not bw_nodes:
        raise ValueError(
            f"cannot plan a step with {len(fw_nodes)} forward and {len(bw_nodes)} backward ops: the "
            "memory planner needs both phases (is this an inference graph?); unset memory_budget for it"
        )
    n_fwd = len(fw_nodes)
    steps = [Step(n.name, FORWARD, node_time_s(n, profile)) for n in fw_nodes]
    steps += [Step(n.name, BACKWARD, node_time_s(n, profile)) for n in bw_nodes]
    n_steps = len(steps)
    fw_step = {n: i for i, n in enumerate(fw_nodes)}
    bw_step = {n: n_fwd + i for i, n in enumerate(bw_nodes)}

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
    baseline = [param_bytes + caller_bytes] * n_steps
    forward_end = {n: n_fwd - 1 for n in user_outputs}
    for lo, hi, nbytes in _liveness(fw_nodes, fw_step, excluded=saved_set, end_step=forward_end):
        _add_interval(baseline, lo, hi, nbytes)
    bw_output = next(n for n in bw.graph.nodes if n.op == "output")
    grads = {n: n_steps - 1 for n in pytree.tree_leaves(bw_output.args[0]) if isinstance(n, fx.Node)}
    for lo, hi, nbytes in _liveness(bw_nodes, bw_step, excluded=set(), end_step=grads):
        _add_interval(baseline, lo, hi, nbytes)
    for name, ph in bw_placeholders.items():
        if name.startswith("tangents"):
            uses = [bw_step[u] for u in ph.users if u in bw_step]
            _add_interval(baseline, n_fwd, max(uses, default=n_fwd), node_bytes(ph))

    resident = [p.name for p in placeholders if p not in saved_set]
    tensors: list[SavedTensor] = []
    closures: dict[str, tuple[str, ...]] = {}
    for node in saved:
        root = _alias_root(node)
        is_input = node.op == "placeholder"
        nbytes = 0 if (root in params or root.op == "placeholder") else node_bytes(node)
        produced = fw_step.get(node, 0)
        fw_uses = [fw_step[u] for u in node.users if u in fw_step]
        ph = bw_placeholders.get(node.name)
        bw_uses = sorted(bw_step[u] for u in ph.users if u in bw_step) if ph is not None else []
        closure, inputs, random = ([], [], False) if is_input else _closure(node, saved_set, fw_step)
        closures[node.name] = tuple(n.name for n in closure)
        tensors.append(SavedTensor(
            name=node.name,
            nbytes=nbytes,
            produced_at=produced,
            last_forward_use=max([produced, *fw_uses]),
            first_backward_use=bw_uses[0] if bw_uses else n_fwd,
            last_backward_use=bw_uses[-1] if bw_uses else n_fwd,
            recompute_cost_s=sum(node_time_s(n, profile) for n in closure),
            recompute_inputs=tuple(i.name for i in inputs),
            recomputable=not (is_input or random),
            offloadable=nbytes > 0,
        ))
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
    result = AdapterResult(
        problem=problem,
        closures=closures,
        keep_all_peak_bytes=keep_all.peak_bytes,
        floor_bytes=floor,
        activation_bytes=max(0, keep_all.peak_bytes - floor),
        param_bytes=param_bytes,
    )
    if budget is None:
        budget_bytes, fraction = keep_all.peak_bytes, None
    elif isinstance(budget, float):
        budget_bytes, fraction = result.budget_for_fraction(budget), budget
    else:
        budget_bytes, fraction = int(budget), None
    return replace(result, problem=replace(problem, budget_bytes=max(1, budget_bytes)), fraction=fraction)


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
