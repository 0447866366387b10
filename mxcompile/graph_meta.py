"""What a node's metadata says about its value: the fake tensor in ``meta["val"]``, its
device, and sizes as ints.

Below both the passes and the cost model: ``mxcompile/cost/`` reads node values through this
module, so the cost model imports nothing from ``mxcompile/passes/`` (which imports the cost
model through the memory plan). ``passes/graph_facts.py`` holds the helpers only passes use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def fake_value(node: Any) -> Any:
    """``node.meta["val"]`` for an FX node (None if it has none); any other argument as is."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def value_device(node: fx.Node) -> torch.device:
    """The device of ``node``'s value; CPU for a graph traced without values (fx.symbolic_trace
    in tests). Used where the choice only affects speed: the MX GEMM's operand dtype
    (`mxcompile.ops.gemm_operand_dtype`; both choices compute the same exact products)."""
    value = fake_value(node)
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def concrete_int(value: Any) -> int | None:
    """An int for a static size, the runtime hint for a symbolic one, None if unknown."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else None
    return None


def shape_hint(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s sizes as ints (a symbolic size's runtime hint; 0 where it has none)."""
    return tuple(concrete_int(s) or 0 for s in t.shape)


__all__ = ["concrete_int", "fake_value", "shape_hint", "value_device"]
