"""Keep GEMMs whose contraction axis is a DTensor shard that cuts MX blocks.

A rank quantizes its local operand in blocks of `block_size` starting at its shard's first
element. Those are the single-process blocks only if every shard starts and ends on a
multiple of block_size. When a shard does not (uneven `torch.chunk`-style splits such as
K=65 on 2 ranks: [0, 33) and [33, 65); hand-made `DTensor.from_local` layouts), the GEMM pass,
which sees only the local length, converts on ranks whose local length happens to divide
(rank 1 above, blocks starting at column 33) and keeps on the others. These helpers carry the
global layout from the backend's example inputs (DTensors at that point) through AOTAutograd's
flattening to the joint graph's placeholders, and give the pass a reason to keep such a GEMM
on every rank:

    outer = misaligned_input_dims(example_inputs, config.block_size)        # compile_graph
    dims = misaligned_placeholders(joint, outer)                             # partition / inference
    reason = sharded_contraction_reason(operand_node, axis, dims, block_size)  # gemm_rewrite

Meant to be wired into `mxcompile.backend` and `passes.gemm_rewrite` (see the distributed
README section); `tests/distributed` exercises them directly.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from .layouts import shard_intervals

aten = torch.ops.aten

__all__ = ["misaligned_input_dims", "misaligned_placeholders", "sharded_contraction_reason"]

# Ops that keep every dimension where it is.
_SAME_DIMS = {
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    torch.ops.prims.convert_element_type.default,
}
# Ops that may merge or split dimensions: the source dimension of an axis is not tracked.
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


def misaligned_input_dims(example_inputs: Sequence[Any], block_size: int) -> dict[int, tuple[int, ...]]:
    """{input index: tensor dims} of the DTensor inputs sharded along a dim with a shard
    boundary off a multiple of block_size (the backend's example inputs, before AOTAutograd)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch built without distributed
        return {}
    found: dict[int, tuple[int, ...]] = {}
    for index, value in enumerate(example_inputs):
        if not isinstance(value, DTensor):
            continue
        dims = []
        for dim in sorted({p.dim % value.ndim for p in value.placements if isinstance(p, Shard)}):
            shards = shard_intervals(tuple(value.shape), value.device_mesh, value.placements, dim)
            if any(length and (offset % block_size or length % block_size) for offset, length in shards):
                dims.append(dim)
        if dims:
            found[index] = tuple(dims)
    return found


def misaligned_placeholders(gm: fx.GraphModule, outer_dims: Mapping[int, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The placeholders (by name) holding the local tensors of those inputs, through the
    AOTInput descriptors AOTAutograd sets on them (`SubclassGetAttrAOTInput(base, "_local_tensor")`)."""
    if not outer_dims:
        return {}
    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        if type(desc).__name__ != "SubclassGetAttrAOTInput" or getattr(desc, "attr", None) != "_local_tensor":
            continue
        index = getattr(getattr(desc, "base", None), "idx", None)
        if index in outer_dims:
            found[node.name] = outer_dims[index]
    return found


def sharded_contraction_reason(
    operand: Any, axis: int, misaligned: Mapping[str, tuple[int, ...]], block_size: int
) -> str | None:
    """Why a GEMM whose operand `operand` contracts along `axis` must stay in high precision,
    or None. Follows the operand back through transposes/permutes (mapping the axis) and
    copies; through a reshape the axis is not tracked and any misaligned dim of the source
    counts (conservative)."""
    if not misaligned or not isinstance(operand, fx.Node):
        return None
    node, dim = operand, axis
    tracked = True
    while node.op == "call_function":
        target, args = node.target, node.args
        if target in (aten.t.default, aten.transpose.int, aten.permute.default):
            if tracked:
                ndim = node.meta["val"].ndim if "val" in node.meta else 2
                dim %= ndim
                if target is aten.t.default:
                    dim = 1 - dim if ndim == 2 else dim
                elif target is aten.transpose.int:
                    a, b = (d % ndim for d in args[1:3])
                    dim = b if dim == a else a if dim == b else dim
                else:
                    dim = list(args[1])[dim] % ndim
        elif target in _RESHAPES:
            tracked = False
        elif target not in _SAME_DIMS:
            return None
        node = args[0]
        if not isinstance(node, fx.Node):
            return None
    if node.op != "placeholder" or node.name not in misaligned:
        return None
    dims = misaligned[node.name]
    if tracked and dim not in dims:
        return None
    which = f"dim {dim}" if tracked else f"a dim of {list(dims)} (through a reshape)"
    return (
        f"contraction axis is {which} of {node.name}, a DTensor shard whose boundaries are not "
        f"multiples of block_size={block_size}: local MX blocks would not be the global blocks; "
        "kept in high precision on every rank"
    )
