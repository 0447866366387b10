"""Pass: rewrite every eligible aten GEMM (mm, addmm, bmm, baddbmm) into MX-quantize -> MX GEMM.

Each operand is quantized along its own contraction axis, so a linear layer's three GEMMs get
the recipe's axes: Y = X Wt (X and W along K), dX = dY W (dY and W along N) and
dW = dYt X (dY and X along M, the token axis). Bias, alpha and beta are applied in high
precision after the GEMM; the output keeps its dtype. A contraction length that is not a
multiple of block_size is zero-padded (static or at run time; the rule is in mx_gemm). An
ineligible GEMM stays as it is and the reason is recorded; this pass never raises on a model
it cannot handle.

Under an FP4 recipe (config.fp4: backend="nvfp4" / "mxfp4") each linear layer's GEMM takes a
format per operand and role from `MXConfig.operand_format` (`linear_gemms` finds them) and
becomes quantize_fp4 x2 -> mx_mm_fp4, padded to the FP4 block; the recipe's high-precision
layers are kept with the rule's reason; other GEMMs are decided as under mxfp8 (docs/fp4.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..config import GemmRole, MXConfig, OperandFormat, OperandKind
from ..distributed.shard_check import sharded_contraction_reason
from ..model_layers import recipe_high_precision
from ..ops.grouped_mm import GROUPED_MM as ANY_DTYPE_GROUPED_MM
from ..report import CONVERTED, KEPT, GemmDecision, OperandQuantization, PassResult
from .graph_facts import (
    NodeBuilder,
    concrete_int,
    fake_value,
    graph_info,
    is_backward,
    module_name,
    nodes_depending_on,
    shape_hint,
    tangent_placeholders,
)
from .meta_keys import CLAIMED_KEY, GROUPED_ORIGIN_KEY
from .grouped_gemm import CONTRACTION, GROUPED_MM, ROWS, describe, emit_grouped_gemm, grouped_flops, grouped_gemm
from .mx_gemm import (
    ContractionPadding,
    contraction_padding,
    emit_mx_gemm,
    fp4_contraction_padding,
    operand_dtype_reason,
    selection_reason,
)

NAME = "gemm_rewrite"

aten = torch.ops.aten

# Ops through which a GEMM's output still "is" a weight gradient on its way to the graph output.
_VIEW_LIKE = {
    aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.clone.default, aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
}
# Ops that sum gradient contributions: the gradient of a weight shared by two modules (an
# lm_head tied to the token embedding) is the sum of each use's weight gradient.
_GRAD_ACCUMULATE = {aten.add.Tensor}


@dataclass(frozen=True)
class GemmPattern:
    """An aten GEMM: where its operands are and along which axis each one contracts."""

    lhs_arg: int
    rhs_arg: int
    lhs_contraction_axis: int
    rhs_contraction_axis: int
    has_bias: bool


GEMM_PATTERNS: dict = {
    aten.mm.default: GemmPattern(0, 1, 1, 0, has_bias=False),
    aten.bmm.default: GemmPattern(0, 1, 2, 1, has_bias=False),
    aten.addmm.default: GemmPattern(1, 2, 1, 0, has_bias=True),
    aten.baddbmm.default: GemmPattern(1, 2, 2, 1, has_bias=True),
}


def _weight_grad_outputs(gm: fx.GraphModule) -> set[fx.Node]:
    """Output-graph nodes that are gradients of parameters (joint graphs only)."""
    info = graph_info(gm)
    if info.kind != "joint":
        return set()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(output.args[0])
    grads = flat[info.num_fwd_outputs:]
    return {
        g for i, g in enumerate(grads) if isinstance(g, fx.Node) and i in info.param_input_indices
    }


def _flows_to(node: fx.Node, targets: set[fx.Node]) -> bool:
    stack = [node]
    while stack:
        current = stack.pop()
        if current in targets:
            return True
        stack.extend(u for u in current.users
                     if u.op == "call_function" and (u.target in _VIEW_LIKE or u.target in _GRAD_ACCUMULATE))
    return False


def _gemm_kind(node: fx.Node, weight_grads: set[fx.Node]) -> str:
    if not is_backward(node):
        return "output"
    return "weight_grad" if _flows_to(node, weight_grads) else "input_grad"


def _gemm_flops(lhs: torch.Tensor, rhs: torch.Tensor, pattern: GemmPattern) -> int:
    batch = 1
    for size in lhs.shape[:-2]:
        batch *= concrete_int(size) or 0
    m, k = (concrete_int(s) or 0 for s in lhs.shape[-2:])
    n = concrete_int(rhs.shape[-1]) or 0
    return 2 * batch * m * n * k


def _ineligibility(
    node: fx.Node, lhs: torch.Tensor, rhs: torch.Tensor, pattern: GemmPattern, flops: int,
    kind: str, padding: ContractionPadding, config: MXConfig,
) -> str | None:
    """Why this GEMM must stay in high precision, or None when it can be converted."""
    reason = operand_dtype_reason({"lhs": lhs, "rhs": rhs})
    if reason is not None:
        return reason
    misaligned = dict(graph_info(node.graph.owning_module).misaligned_shards)
    for arg, axis in ((pattern.lhs_arg, pattern.lhs_contraction_axis),
                      (pattern.rhs_arg, pattern.rhs_contraction_axis)):
        reason = sharded_contraction_reason(node.args[arg], axis, misaligned, config.block_size)
        if reason is not None:
            return reason
    if padding.keep_reason is not None:
        return padding.keep_reason
    reason = selection_reason(node, flops, config)
    if reason is not None:
        return reason
    if kind == "weight_grad" and config.hp_weight_grad:
        return "hp_weight_grad=True keeps weight-gradient GEMMs in high precision"
    return None


def _rewrite(
    gm: fx.GraphModule, node: fx.Node, pattern: GemmPattern, elems: tuple[str, str],
    padding: ContractionPadding, config: MXConfig, formats: tuple[OperandFormat, OperandFormat] | None = None,
) -> NodeBuilder:
    result, build = emit_mx_gemm(
        gm, node, node.args[pattern.lhs_arg], node.args[pattern.rhs_arg],
        (pattern.lhs_contraction_axis, pattern.rhs_contraction_axis), elems, padding, config, formats)
    if pattern.has_bias:
        out_dtype = fake_value(node).dtype
        alpha = node.kwargs.get("alpha", 1)
        beta = node.kwargs.get("beta", 1)
        result = build.call(torch.ops.prims.convert_element_type.default, result, torch.float32)
        if alpha != 1:
            result = build.call(aten.mul.Tensor, result, alpha)
        bias = node.args[0]
        if beta != 1:
            bias = build.call(aten.mul.Tensor, bias, beta)
        result = build.call(aten.add.Tensor, result, bias)
        result = build.call(torch.ops.prims.convert_element_type.default, result, out_dtype)
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return build


# transformers' MoE fallback ops (fp32 experts under torch.compile, transformers/integrations/moe.py):
# custom ops whose loops compute exactly aten._grouped_mm with int32 cumulative offsets, the op
# transformers itself calls for bf16 experts. They are rewritten into mxcompile::grouped_mm nodes
# of the same semantics in any dtype (the forward: one rows-form GEMM; the backward: dX in rows
# form, dW in contraction form), which the grouped-GEMM conversion below then decides on like
# aten._grouped_mm.
_FALLBACK_GROUPED = "transformers.grouped_mm_fallback.default"
_FALLBACK_GROUPED_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def _lower_fallback_grouped(gm: fx.GraphModule) -> int:
    """Replace transformers' fallback grouped-GEMM ops by the mxcompile::grouped_mm nodes they compute,
    each tagged (GROUPED_ORIGIN_KEY) with the op it came from; returns how many ops were replaced."""
    count = 0
    for node in list(gm.graph.nodes):
        target = str(node.target) if node.op == "call_function" else ""
        if target not in (_FALLBACK_GROUPED, _FALLBACK_GROUPED_BACKWARD):
            continue
        build = NodeBuilder(gm, node)
        if target == _FALLBACK_GROUPED:
            x, weight, offsets = node.args
            results = [build.call(ANY_DTYPE_GROUPED_MM, x, weight, offsets)]
            node.replace_all_uses_with(results[0])
        else:
            x, weight, offsets, grad_out = node.args
            grad_x = build.call(ANY_DTYPE_GROUPED_MM, grad_out, build.call(aten.transpose.int, weight, -2, -1), offsets)
            grad_weight = build.call(ANY_DTYPE_GROUPED_MM, build.call(aten.t.default, x), grad_out, offsets)
            results = [grad_x, grad_weight]
            for user in list(node.users):
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
        for result in results:
            result.meta[GROUPED_ORIGIN_KEY] = target
        gm.graph.erase_node(node)
        count += 1
    return count


def _graph_label(node: fx.Node, graph_name: str) -> str:
    return "backward" if is_backward(node) else ("inference" if graph_name == "inference" else "forward")


def _grouped_decision(
    gm: fx.GraphModule, node: fx.Node, kind: str, gradients: set[fx.Node], graph_name: str,
    config: MXConfig,
) -> tuple[GemmDecision, int]:
    """Decide on (and convert) one aten._grouped_mm; returns the row and the nodes added."""
    gemm = grouped_gemm(node)
    lhs, rhs = fake_value(node.args[0]), fake_value(node.args[1])
    row = dict(graph=_graph_label(node, graph_name), node=node.name, op=str(node.target),
               shapes=(shape_hint(lhs), shape_hint(rhs)), module=module_name(node))
    if isinstance(gemm, str):
        flops = 2 * math.prod(shape_hint(lhs)) * shape_hint(rhs)[-1]
        return GemmDecision(kind=kind, flops=flops, decision=KEPT, reason=gemm, **row), 0
    kind = "weight_grad" if gemm.form == CONTRACTION else kind
    row["op"] += f" [{gemm.groups} groups]"
    if GROUPED_ORIGIN_KEY in node.meta:
        row["op"] += f" (from {node.meta[GROUPED_ORIGIN_KEY]})"
    flops = grouped_flops(gemm)
    elems = tuple(config.grad_elem if n in gradients else config.forward_elem for n in (gemm.lhs, gemm.rhs))
    length = lhs.shape[gemm.axes[0]]
    padding = (contraction_padding(length, config.block_size) if gemm.form == ROWS
               else ContractionPadding(length, config.block_size, padded=True))
    reason = operand_dtype_reason({"lhs": lhs, "rhs": rhs}) or padding.keep_reason
    reason = reason or selection_reason(node, flops, config)
    if reason is None and kind == "weight_grad" and config.hp_weight_grad:
        reason = "hp_weight_grad=True keeps weight-gradient GEMMs in high precision"
    if reason is not None:
        return GemmDecision(kind=kind, flops=flops, decision=KEPT, reason=reason, **row), 0
    operands = tuple(OperandQuantization.of(n.name, shape_hint(fake_value(n)), axis, config.mx_operand_format(elem))
                     for n, axis, elem in zip((gemm.lhs, gemm.rhs), gemm.axes, elems))
    build = emit_grouped_gemm(gm, node, gemm, elems, padding, config)
    return GemmDecision(kind=kind, flops=flops, decision=CONVERTED, reason=describe(gemm, padding),
                        operands=operands, **row), len(build.added)


# ---------------------------------------------------------------------------------------------
# FP4 recipes: which GEMMs are a linear layer's, in which role, and each operand's kind. Under
# an FP4 recipe (config.fp4) a linear layer's three GEMMs take the recipe's formats
# (MXConfig.operand_format: one table for every recipe); every other GEMM (attention, which
# attention_rewrite claims first, and GEMMs of two activations) is decided as under mxfp8.


@dataclass(frozen=True)
class LinearGemm:
    """A GEMM of a linear layer: its role and what each operand (lhs, rhs) is."""

    role: GemmRole
    operands: tuple[OperandKind, OperandKind]


def _parameter_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders[i] for i in graph_info(gm).param_input_indices if i < len(placeholders)}


def _is_parameter(node: Any, parameters: set[fx.Node]) -> bool:
    """Whether a GEMM operand is a parameter, through views, transposes and casts."""
    while isinstance(node, fx.Node):
        if node in parameters:
            return True
        if node.op != "call_function" or node.target not in _VIEW_LIKE:
            return False
        node = node.args[0]
    return False


def linear_gemms(gm: fx.GraphModule, weight_grads: set[fx.Node],
                 gradients: set[fx.Node]) -> tuple[dict[fx.Node, LinearGemm], list[str]]:
    """The linear layers' GEMMs of a graph (output and input-gradient GEMMs: one operand a
    parameter; weight-gradient GEMMs: the output a parameter's gradient) and the linear
    layers' module names in forward order."""
    parameters = _parameter_nodes(gm)
    found: dict[fx.Node, LinearGemm] = {}
    order: list[str] = []
    for node in gm.graph.nodes:
        pattern = GEMM_PATTERNS.get(node.target) if node.op == "call_function" else None
        if pattern is None or CLAIMED_KEY in node.meta:
            continue
        kind = _gemm_kind(node, weight_grads)
        operands = (node.args[pattern.lhs_arg], node.args[pattern.rhs_arg])
        weights = tuple(_is_parameter(n, parameters) for n in operands)
        if kind != GemmRole.WEIGHT_GRAD.value and not any(weights):
            continue
        kinds = tuple(OperandKind.WEIGHT if weight and kind != GemmRole.WEIGHT_GRAD.value
                      else OperandKind.GRADIENT if n in gradients else OperandKind.ACTIVATION
                      for n, weight in zip(operands, weights))
        found[node] = LinearGemm(GemmRole(kind), kinds)  # type: ignore[arg-type]
        module = module_name(node)
        if kind == GemmRole.OUTPUT.value and module not in order:
            order.append(module)
    return found, order


def _fp4_formats(linear: LinearGemm, node: fx.Node, config: MXConfig) -> tuple[OperandFormat, OperandFormat]:
    """The recipe's format of each operand; 2-D weight blocks only for a 2-D weight operand."""
    pattern = GEMM_PATTERNS[node.target]
    formats = []
    for kind, arg in zip(linear.operands, (pattern.lhs_arg, pattern.rhs_arg)):
        fmt = config.operand_format(linear.role, kind)
        if fmt.block_2d and fake_value(node.args[arg]).ndim != 2:
            fmt = dataclasses.replace(fmt, block_2d=False)
        formats.append(fmt)
    return formats[0], formats[1]


def rewrite_gemms(gm: fx.GraphModule, config: MXConfig, graph_name: str) -> PassResult:
    """Rewrite the GEMMs of one graph in place; return the decisions and node counts."""
    _lower_fallback_grouped(gm)
    weight_grads = _weight_grad_outputs(gm)
    gradients = nodes_depending_on(tangent_placeholders(gm))
    fp4 = config.fp4
    linear, linear_order = linear_gemms(gm, weight_grads, gradients) if fp4 is not None else ({}, [])
    high_precision = recipe_high_precision(config, linear_order)
    decisions: list[GemmDecision] = []
    added = removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or CLAIMED_KEY in node.meta:  # attention_rewrite decided
            continue
        if node.target in (GROUPED_MM, ANY_DTYPE_GROUPED_MM):
            decision, count = _grouped_decision(gm, node, _gemm_kind(node, weight_grads), gradients,
                                                graph_name, config)
            decisions.append(decision)
            added += count
            removed += decision.decision == CONVERTED
            continue
        pattern = GEMM_PATTERNS.get(node.target)
        if pattern is None:
            continue
        lhs_node, rhs_node = node.args[pattern.lhs_arg], node.args[pattern.rhs_arg]
        lhs, rhs = fake_value(lhs_node), fake_value(rhs_node)
        kind = _gemm_kind(node, weight_grads)
        flops = _gemm_flops(lhs, rhs, pattern)
        module = module_name(node)
        elems = tuple(
            config.grad_elem if operand in gradients else config.forward_elem
            for operand in (lhs_node, rhs_node)
        )
        formats = _fp4_formats(linear[node], node, config) if node in linear else None
        if formats is None:
            padding = contraction_padding(lhs.shape[pattern.lhs_contraction_axis], config.block_size)
            operand_formats = tuple(config.mx_operand_format(elem) for elem in elems)
        else:
            padding = fp4_contraction_padding(lhs.shape[pattern.lhs_contraction_axis], formats[0])
            operand_formats = formats
        reason = _ineligibility(node, lhs, rhs, pattern, flops, kind, padding, config)
        if reason is None and formats is not None and module in high_precision:
            reason = high_precision[module]
        operands = (
            OperandQuantization.of(lhs_node.name, shape_hint(lhs), pattern.lhs_contraction_axis, operand_formats[0]),
            OperandQuantization.of(rhs_node.name, shape_hint(rhs), pattern.rhs_contraction_axis, operand_formats[1]),
        )
        graph = _graph_label(node, graph_name)
        if reason is None:
            reason = f"operands quantized along their contraction axis ({padding.describe()})"
            if formats is not None:
                reason = (f"{formats[0].block_format.name} linear-layer GEMM ({kind}: {' x '.join(f.describe() for f in formats)}); "
                          + reason)
            elif fp4 is not None:
                reason += f"; not a linear layer's GEMM: MXFP8 under the {fp4.recipe.value} recipe"
            decision = CONVERTED
        else:
            decision = KEPT
        decisions.append(GemmDecision(
            graph=graph, node=node.name, op=str(node.target), kind=kind,
            shapes=(shape_hint(lhs), shape_hint(rhs)), flops=flops, module=module,
            decision=decision, reason=reason, operands=operands if decision == CONVERTED else (),
        ))
        if decision == CONVERTED:
            build = _rewrite(gm, node, pattern, elems, padding, config, formats)
            added += len(build.added)
            removed += 1
    if added:
        gm.graph.lint()
        gm.recompile()
    return PassResult(NAME, graph_name, added, removed, tuple(decisions))
