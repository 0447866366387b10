"""Parameter placeholders of a joint graph whose inputs include tensor subclasses (DTensor).

AOTAutograd hands the partition function `static_lifetime_input_indices` counted over the
*outer* inputs of the dynamo graph (a DTensor parameter is one input), while the joint graph's
primals are the flattened inner pieces (a DTensor becomes its `_local_tensor` plus an opaque
`device_mesh` input). With tensor parallelism the indices therefore point at the wrong primals,
and the joint graph's gradient outputs (one per flattened primal) are misread: the GEMM pass
labels some weight-gradient GEMMs `input_grad` (seen in torch 2.13 with the TP GPT: 6 of 9
weight gradients found). `param_placeholder_indices` maps the outer indices through each
placeholder's AOTInput descriptor (`node.meta["desc"]`) to flattened primal positions.

`mxcompile.backend.compile_graph` uses it in its partition function, and with
`static_input_indices` (the dynamo graph's parameters and buffers) in its inference compiler.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch import nn

_TANGENT_PREFIX = "tangents"
_SUBCLASS_TENSOR_ATTRS = ("_local_tensor",)  # the inner tensor of a DTensor that carries data

__all__ = ["param_placeholder_indices", "static_input_indices"]


def _outer_index(desc: object) -> tuple[int | None, bool]:
    """(outer input index, whether the placeholder is the data-carrying piece) of a desc."""
    is_data = True
    while type(desc).__name__ == "SubclassGetAttrAOTInput":
        is_data = is_data and getattr(desc, "attr", None) in _SUBCLASS_TENSOR_ATTRS
        desc = getattr(desc, "base")
    return getattr(desc, "idx", None), is_data


def param_placeholder_indices(joint: fx.GraphModule, static_indices: Sequence[int]) -> tuple[int, ...]:
    """Positions among the joint graph's primal placeholders of the parameters and buffers
    whose outer input indices are `static_indices`. Without descriptors (older torch, or no
    subclass inputs) the indices are returned unchanged."""
    primals = [n for n in joint.graph.nodes
               if n.op == "placeholder" and not n.name.startswith(_TANGENT_PREFIX)]
    descs = [n.meta.get("desc") for n in primals]
    if any(d is None for d in descs):
        return tuple(static_indices)
    if not any(type(d).__name__ == "SubclassGetAttrAOTInput" for d in descs):
        return tuple(static_indices)
    static = set(static_indices)
    found = []
    for position, desc in enumerate(descs):
        outer, is_data = _outer_index(desc)
        if is_data and outer in static:
            found.append(position)
    return tuple(found)


def static_input_indices(example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """Outer input indices of a dynamo graph's parameters and buffers (what AOTAutograd calls
    its static-lifetime inputs): nn.Parameters, and tensors dynamo marked static."""
    return tuple(i for i, value in enumerate(example_inputs)
                 if isinstance(value, nn.Parameter) or getattr(value, "_dynamo_static_input_type", None) is not None)
