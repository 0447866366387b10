"""Facts about a joint, forward, backward or inference FX graph that several passes read.

Not a pass: helpers to read node metadata (fake values, module names, forward/backward tags)
and to insert nodes with their fake values, so that every node a pass adds carries
`meta["val"]` as the partitioner and Inductor require.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from torch._guards import detect_fake_mode

from ..graph_meta import concrete_int, fake_value, shape_hint, value_device  # re-exported for the passes
from .meta_keys import GRAPH_INFO_KEY


# Dynamo roots module paths at the compiled callable: L['self'], L['fn'], or, when a module is
# reached through a wrapper's positional arguments, L['args'][0].
_DYNAMO_ROOT = re.compile(r"^L\['(?:args'\]\[\d+|[^']*')\]\.?")
_INDEX = re.compile(r"\[(?:'([^']*)'|(\d+))\]")
# How dynamo reaches a child module that it does not reach by attribute (PEFT's wrappers, whose
# __getattr__ forwards to the wrapped model): L['self'].__dict__['_modules']['base_model'].
_MODULES_DICT = re.compile(r"\.(?:__dict__\['_modules'\]|_modules)(?=\[)")


@dataclass(frozen=True)
class GraphInfo:
    """What the backend knows about a graph before the passes run (stored in gm.meta)."""

    kind: str  # "joint" or "inference"
    num_fwd_outputs: int = 0
    param_input_indices: tuple[int, ...] = ()  # placeholders that are parameters or buffers
    # placeholders (by name) whose dims (the tuple) are DTensor shards cutting MX blocks
    misaligned_shards: tuple[tuple[str, tuple[int, ...]], ...] = ()


def graph_info(gm: fx.GraphModule) -> GraphInfo:
    return gm.meta.get(GRAPH_INFO_KEY) or GraphInfo(kind="inference")


def graph_fake_mode(gm: fx.GraphModule):
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def clean_module_path(dynamo_path: str) -> str:
    """"L['self'].layers[0].attn" -> "layers.0.attn" (the name users see in named_modules);
    "L['self'].__dict__['_modules']['base_model'].model" -> "base_model.model"."""
    path = _DYNAMO_ROOT.sub("", _MODULES_DICT.sub("", dynamo_path))
    path = _INDEX.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.lstrip(".")


def module_name(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return clean_module_path(path)


def graph_module_names(gm: fx.GraphModule) -> set[str]:
    """Every module name (named_modules form) that a node of gm was traced in, ancestors included."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
            names.add(clean_module_path(path))
    names.discard("")
    return names


def is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def nodes_depending_on(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """All nodes reachable from `roots` through users (the roots included)."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.users)
    return seen


def tangent_placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]


# "recompute" and "ac_graph_id": the activation-checkpointing tags (torch.utils.checkpoint traced as
# a higher-order op, torchtitan's policies); without them on its MX nodes a checkpointed GEMM's
# output would be saved for the backward instead of recomputed, and checkpointing would save nothing.
_COPIED_META = ("partitioner_tag", "nn_module_stack", "fwd_nn_module_stack", "stack_trace",
                "seq_nr", "source_fn_stack", "fwd_source_fn_stack", "autograd_backward",
                "recompute", "ac_graph_id")


class NodeBuilder:
    """Inserts call_function nodes before an anchor, computing each node's fake value and
    copying the anchor's provenance metadata (forward/backward tag, module stack)."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node):
        self.graph = gm.graph
        self.anchor = anchor
        self.fake_mode = graph_fake_mode(gm)
        self.added: list[fx.Node] = []

    def call(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args = fx.node.map_aggregate(args, fake_value)  # nodes inside lists too
        fake_kwargs = fx.node.map_aggregate(kwargs, fake_value)
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        else:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        for key in _COPIED_META:
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        self.added.append(node)
        return node
