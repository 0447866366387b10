"""Batch chunks of the MX attention ops under a memory budget, chosen after the plan.

The ops' CPU implementation runs `batch_chunk` batch elements per call: its scratch grows with
the chunk (`cost.graph_costs.ATTENTION_WORKSPACE_COPIES`), and each call's key-tile passes run
a fixed list of eager ops whatever the chunk, so small chunks cost time
(`cost.graph_costs.attention_passes`; on the small GPT, one element per call added ~17 ms to a
~160 ms step). Under a budget below 1.0 the attention rewrite gives every op one element per
call, the least scratch, so that the plan starts from the smallest peak it can reach. Once the
plan is applied, :func:`widen_attention_chunks` gives each op the largest chunk, up to the
unbudgeted one, whose scratch fits the room the budget leaves at the op's own step.

Scratch lives only while its op runs, so widening one op changes the modelled bytes of its
own step and of no other: the plan's peak stays within the budget. The chunk never changes a
value (every MX block lies within one batch element and head).

:func:`largest_fitting_chunk` is the rule on plain numbers; the rest reads and writes FX nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from ..cost.graph_costs import (attention_batch_chunk, attention_pass_time_s, attention_query,
                                attention_workspace_for_chunk)
from ..cost.profiles import DeviceProfile
from ..graph_meta import concrete_int
from ..ops.attention import batch_chunk_for
from .meta_keys import PLAN_PLACED_KEY


def unbudgeted_chunk(query: torch.Tensor) -> int:
    """The chunk the ops run without a memory budget: `ops.attention.batch_chunk_for` of the
    query (batch, heads, seq, head_dim), with a dynamic size's hint."""
    batch = concrete_int(query.shape[0]) or 1
    return batch_chunk_for(batch, math.prod(concrete_int(size) or 1 for size in query.shape[1:]))


def largest_fitting_chunk(most: int, room_bytes: int, scratch_of: Callable[[int], int]) -> int:
    """The largest chunk in [1, most] whose scratch (`scratch_of`, non-decreasing in the chunk)
    is at most `room_bytes`; 1 when none fits (one element is the least the op can run)."""
    for chunk in range(most, 1, -1):
        if scratch_of(chunk) <= room_bytes:
            return chunk
    return 1


@dataclass(frozen=True)
class ChunkDecision:
    """One attention op's batch chunk under the budget and why.

    Attributes:
        node: the op's node name.
        chunk: batch elements per call, chosen.
        unbudgeted_chunk: the chunk without a budget (the most it may take).
        scratch_bytes: the op's modelled scratch at `chunk`.
        room_bytes: the budget less the step's other modelled bytes: what scratch may take.
        extra_time_s: the passes' time at `chunk` over that at `unbudgeted_chunk` (>= 0).
        saved_time_s: the passes' time at the chunk the plan modelled (one element) less that at
            `chunk` (>= 0): what widening takes off the plan's estimated step.
        recomputed: whether the op is a recomputation the plan placed in the backward.
        reason: in words.
    """

    node: str
    chunk: int
    unbudgeted_chunk: int
    scratch_bytes: int
    room_bytes: int
    extra_time_s: float
    saved_time_s: float
    recomputed: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"node": self.node, "batch_chunk": self.chunk, "unbudgeted_chunk": self.unbudgeted_chunk,
                "scratch_bytes": self.scratch_bytes, "room_bytes": self.room_bytes,
                "extra_time_s": self.extra_time_s, "saved_time_s": self.saved_time_s,
                "recomputed": self.recomputed, "reason": self.reason}


def _set_batch_chunk(node: fx.Node, chunk: int) -> None:
    names = [argument.name for argument in node.target._schema.arguments]
    index = names.index("batch_chunk")
    if index < len(node.args):
        node.args = (*node.args[:index], chunk, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, "batch_chunk": chunk}


def _reason(chunk: int, most: int, scratch: int, room: int) -> str:
    if chunk == most:
        return f"the unbudgeted chunk: its scratch, {scratch} B, fits the {room} B the budget leaves at this step"
    if chunk > 1:
        return (f"the largest chunk whose scratch, {scratch} B, fits the {room} B the budget leaves at this step "
                f"({chunk + 1} elements would not)")
    return f"one element per call: two elements' scratch would exceed the {room} B the budget leaves at this step"


def widen_attention_chunks(graphs: Sequence[fx.GraphModule], step_bytes: Sequence[Mapping[str, int]],
                           budget_bytes: int, profile: DeviceProfile) -> list[ChunkDecision]:
    """Give every MX attention op in `graphs` the largest batch chunk whose scratch fits the
    budget at its step (module docstring); rewrites the nodes' `batch_chunk` in place and
    recompiles the graphs it changed.

    Args:
        graphs: the planned forward and backward graphs.
        step_bytes: per graph, node name -> modelled bytes resident at that node's step under
            the plan, the op's own scratch included (`planner.memory.evaluate`'s memory curve).
        budget_bytes: the budget the plan was made for.
        profile: prices the passes a chunk saves or costs.
    """
    decisions = []
    for gm, bytes_at in zip(graphs, step_bytes, strict=True):
        changed = False
        for node in gm.graph.nodes:
            query = attention_query(node)
            if query is None or node.name not in bytes_at:
                continue
            current = attention_batch_chunk(node)
            most = max(current, unbudgeted_chunk(query))
            room = budget_bytes - bytes_at[node.name] + attention_workspace_for_chunk(node, current)
            chunk = max(current, largest_fitting_chunk(most, room, lambda c: attention_workspace_for_chunk(node, c)))
            scratch = attention_workspace_for_chunk(node, chunk)
            time_at = {c: attention_pass_time_s(node, profile, c) for c in {current, chunk, most}}
            decisions.append(ChunkDecision(node.name, chunk, most, scratch, room, time_at[chunk] - time_at[most],
                                           time_at[current] - time_at[chunk], bool(node.meta.get(PLAN_PLACED_KEY)),
                                           _reason(chunk, most, scratch, room)))
            if chunk != current:
                _set_batch_chunk(node, chunk)
                changed = True
        if changed:
            gm.recompile()
    return decisions


__all__ = ["ChunkDecision", "largest_fitting_chunk", "unbudgeted_chunk", "widen_attention_chunks"]
