"""Compute each value the forward saves for the backward as soon as its inputs exist.

The partitioner lays out the forward graph in the joint graph's order. A value computed in the
joint graph's backward part, which the partitioner moves into the forward because saving it is
cheaper than saving its input, therefore lands at the forward's very end, after the loss: e.g.
the MX quantization of a GELU output along the axis its weight-gradient GEMM contracts
(``gemm_rewrite``). Its high-precision input then stays alive through the rest of the forward.
On a 12-layer ``Linear(1024, 1024)`` + GELU MLP (4096 rows, fp32) that held eleven 16 MiB GELU
outputs at the loss, 176 MiB the step need not hold: the memory planner, which models the graph
in its order, saw them, while Inductor's reordering for peak memory removed most of them.

:func:`hoist_saved_values` moves each such computation (with the views it reads that nothing
else reads) to just after the last of its inputs is produced, when that frees more than it
holds: the bytes of the inputs it reads last are at least its output's. Only the order changes,
so every value is bit-identical; random ops are never moved (their order sets the random
stream).
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch.fx as fx
import torch.utils._pytree as pytree

from ..cost.graph_costs import alias_root, is_alias, node_bytes
from ..planner.fx_adapter import is_random


def _only_saved(node: fx.Node, output: fx.Node, user_outputs: set[fx.Node]) -> bool:
    """Whether only the graph's output reads ``node``, directly or through ``getitem``, as a
    saved value (not one of ``user_outputs``)."""
    if not node.users or node in user_outputs:
        return False
    for user in node.users:
        if user is output:
            continue
        if (user.target is not operator.getitem or user in user_outputs
                or any(u is not output for u in user.users)):
            return False
    return True


def _exclusive_views(node: fx.Node) -> list[fx.Node]:
    """The views ``node`` reads that nothing else reads, transitively (in graph order)."""
    chain: list[fx.Node] = []
    stack = [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg.op == "call_function" and is_alias(arg) and len(arg.users) == 1 and arg not in chain:
                chain.append(arg)
                stack.append(arg)
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(chain, key=position.__getitem__)


def _readers(node: fx.Node, members: set[fx.Node]) -> list[fx.Node]:
    """The nodes reading ``node``'s storage: its users, through views not in ``members``."""
    readers: list[fx.Node] = []
    for user in node.users:
        readers += _readers(user, members) if is_alias(user) and user not in members else [user]
    return readers


def _freed_bytes(moved: Sequence[fx.Node], position: dict[fx.Node, int]) -> int:
    """Bytes of the storages that ``moved`` reads last (no reader after the last of ``moved``):
    moving ``moved`` earlier frees them earlier. Graph inputs are held by the caller anyway."""
    last = max(position[n] for n in moved)
    members = set(moved)
    roots = {alias_root(arg) for n in moved for arg in n.all_input_nodes if arg not in members}
    return sum(node_bytes(root) for root in roots
               if root.op == "call_function" and all(position[r] <= last for r in _readers(root, members)))


def hoist_saved_values(fw: fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    """Move each computation of the partitioned forward ``fw`` that only the backward reads (a
    saved value: an output past its first ``num_fwd_outputs``) to just after the last of its
    inputs is produced, where that frees at least what it holds (module docstring). Random and
    impure ops stay where they are. Returns the names of the moved nodes, the views they read
    excluded."""
    graph = fw.graph
    output = next(n for n in graph.nodes if n.op == "output")
    user_outputs = {n for n in pytree.tree_leaves(output.args[0])[:num_fwd_outputs] if isinstance(n, fx.Node)}
    moved_names: list[str] = []
    candidates = [n for n in graph.nodes
                  if n.op == "call_function" and not is_alias(n) and not is_random(n) and not n.is_impure()
                  and _only_saved(n, output, user_outputs)]
    while candidates:  # a move can let another one free its input: until none moves
        moved_now = [node for node in candidates if _hoist(node, output)]
        moved_names += [node.name for node in moved_now]
        candidates = [node for node in candidates if node not in moved_now] if moved_now else []
    if moved_names:
        graph.lint()
        fw.recompile()
    return moved_names


def _hoist(node: fx.Node, output: fx.Node) -> bool:
    """Move ``node`` (with the views only it reads, and its getitems) to just after the last of
    its inputs, if that frees at least its bytes; whether it moved."""
    graph = node.graph
    views = _exclusive_views(node)
    chain = [*views, node]
    members = set(chain)
    position = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [arg for n in chain for arg in n.all_input_nodes if arg not in members]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = max([*inputs, *placeholders[-1:]], key=position.__getitem__, default=None)
    if anchor is None or position[anchor] + len(views) + 1 >= position[node]:
        return False  # already right after its inputs
    if _freed_bytes(chain, position) < node_bytes(node):
        return False
    at = anchor
    for moved in [*chain, *(u for u in node.users if u is not output)]:  # the chain, then its getitems
        at.append(moved)
        at = moved
    return True


__all__ = ["hoist_saved_values"]
