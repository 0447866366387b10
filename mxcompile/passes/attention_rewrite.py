"""Pass: find attention in the joint (or inference) graph and put its GEMMs in MX.

Runs before gemm_rewrite, because attention in eager form is made of plain `bmm` nodes that
gemm_rewrite would otherwise convert as anonymous GEMMs, outside `config.attention`'s reach.
Every attention GEMM gets one `GemmDecision` with kind="attention" and its role in `op`
(S = Q·Kᵀ, O = P·V, dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q); 2·B·H·Tq·Tk·d FLOPs
each, so a forward is 4·B·H·Tq·Tk·d. The GEMMs this pass decides on carry
`node.meta[CLAIMED_KEY]`, which gemm_rewrite skips.

Two forms are recognised, by what they are in the graph:

fused attention ops (FUSED_PATTERNS): aten's SDPA kernels and their backward ops. On CPU,
AOTAutograd with Inductor's decompositions turns F.scaled_dot_product_attention into
`_scaled_dot_product_flash_attention_for_cpu` + `..._backward` (also for masks, GQA and
float64); CUDA graphs carry the flash / efficient / cuDNN variants; an un-decomposed
`scaled_dot_product_attention` can appear in inference graphs. The forward node is replaced
by `mxcompile::attention` and its backward node by `mxcompile::attention_backward`
(mxcompile/ops/attention.py: key-tiled, online fp32 softmax, every GEMM MX along its own
contraction axis). The pair is replaced together or not at all.

eager softmax attention (`_eager_sites`): softmax(Q·Kᵀ·scale + mask)·V written op by op, as
the GPT example's eager attention, HF transformers' eager_attention_forward (GQA through
repeat_kv, dropout p=0 traced as a clone) and SDPA's math decomposition (which torch uses when
the mask needs a gradient or dropout_p > 0) produce it. A softmax over the last axis (the
decomposed exp / amax / sum / div, or `_softmax`) is traced back through score-shaping ops
(scale, mask, casts, views) to one `bmm` (S) and forward through probability-shaping ops
(casts, views, dropout masks) to the `bmm` that takes it as left operand (O). Their backward
GEMMs are the backward `bmm`s that read a transpose of one of their operands. Each claimed bmm
is converted like gemm_rewrite would (operands quantized along the contraction axis: head_dim,
keys, queries as the roles require) or kept by `config.attention`; the softmax stays what the
model wrote (fp32 in HF and the GPT example). Here P is quantized after normalization, and
after a dropout mask when the math decomposition carries one (dropout_p > 0). Backward GEMMs
that the transpose rule does not find are left to gemm_rewrite as ordinary batched GEMMs.

config.attention: "both" converts all six GEMMs; "qk_only" converts S = Q·Kᵀ and its backward
GEMMs dQ and dK and keeps the value path O = P·V, dV and dP in high precision (for the fused
form the MX attention op runs with its value-path GEMMs unquantized); "off" keeps everything
as it is, with that reason recorded. Fused attention also stays aten's when dropout_p > 0,
when head_dim, value head_dim, the key length or (for training) the query length is not a
multiple of block_size, and for the other reasons `mxcompile.ops.attention_checks.check_attention_inputs`
gives. This pass never raises on a graph it cannot handle: it records why and moves on.
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from ..config import RECIPE_ATTENTION_REASON_PREFIX, RECIPES, AttentionChunking, AttentionMode, MXConfig, Recipe
from ..numerics import ElemFormatName
from ..ops.attention import ATTENTION, ATTENTION_BACKWARD
from ..ops.attention_checks import check_attention_inputs
from ..ops.attention_reference import default_key_tile
from ..report import CONVERTED, KEPT, GemmDecision, OperandQuantization, PassResult
from .attention_chunks import unbudgeted_chunk
from .graph_facts import (
    NodeBuilder,
    concrete_int,
    fake_value,
    graph_fake_mode,
    is_backward,
    module_name,
    nodes_depending_on,
    shape_hint,
    tangent_placeholders,
)
from .meta_keys import CLAIMED_KEY
from .mx_gemm import (
    ContractionPadding,
    contraction_padding,
    emit_mx_gemm,
    operand_dtype_reason,
    pad_along,
    selection_reason,
    size_value,
)

NAME = "attention_rewrite"
KIND = "attention"

aten = torch.ops.aten

# The six GEMMs of attention, by role.
S_QK = "S = Q·Kᵀ"
O_PV = "O = P·V"
DV = "dV = Pᵀ·dO"
DP = "dP = dO·Vᵀ"
DQ = "dQ = dS·K"
DK = "dK = dSᵀ·Q"
FORWARD_ROLES = (S_QK, O_PV)
ROLE_QUANTIZATION = {  # what each GEMM quantizes, and along which axis (its contraction axis)
    S_QK: "Q and K along head_dim",
    O_PV: "P and V along the key axis",
    DV: "P and dO along the query axis",
    DP: "dO and V along head_dim",
    DQ: "dS and K along the key axis",
    DK: "dS and Q along the query axis",
}
BACKWARD_ROLES = (DV, DP, DQ, DK)
QK_FAMILY = frozenset({S_QK, DQ, DK})  # MX under attention="qk_only"; the rest is the value path

_HIGH_PRECISION_REASON = {
    AttentionMode.OFF: "attention='off' keeps attention GEMMs in high precision",
    AttentionMode.QK_ONLY: "attention='qk_only' keeps the value path (O = P·V, dV = Pᵀ·dO, dP = dO·Vᵀ) in high precision",
}


def _attention_off_reason(config: MXConfig) -> str:
    """Why attention="off" keeps the attention GEMMs: an FP4 recipe's own default, or the setting."""
    if config.recipe is not Recipe.MXFP8 and RECIPES[config.recipe].attention is AttentionMode.OFF:
        return (f"{RECIPE_ATTENTION_REASON_PREFIX} ({config.recipe.value}'s default) keeps attention GEMMs "
                "in high precision")
    return _HIGH_PRECISION_REASON[AttentionMode.OFF]


def _mx_role(role: str, config: MXConfig) -> str | None:
    """Why config.attention keeps this role in high precision, or None when it goes to MX."""
    if config.attention is AttentionMode.OFF:
        return _attention_off_reason(config)
    if config.attention is AttentionMode.QK_ONLY and role not in QK_FAMILY:
        return _HIGH_PRECISION_REASON[config.attention]
    return None


def _graph_label(node: fx.Node, graph_name: str) -> str:
    if is_backward(node):
        return "backward"
    return "inference" if graph_name == "inference" else "forward"


def _strip_alias(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.alias.default:
        node = node.args[0]
    return node


# --------------------------------------------------------------------------------------------
# Fused attention ops


@dataclass(frozen=True)
class FusedAttentionPattern:
    """An aten fused-attention forward op, its backward op and where their arguments live.
    Argument names are those of the ops' schemas."""

    name: str
    forward: Any  # OpOverload
    backward: Any | None  # OpOverload, None for forward-only ops
    mask_arg: str | None  # name of the additive mask / bias argument, if the op takes one
    lse_output: int | None  # index of the logsumexp output; None: the op returns one tensor
    backward_extra_outputs: tuple[int, ...] = ()  # backward outputs besides dq, dk, dv


FUSED_PATTERNS: tuple[FusedAttentionPattern, ...] = (
    FusedAttentionPattern(
        "sdpa_flash_cpu", aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "attn_mask", 1),
    FusedAttentionPattern(
        "sdpa_flash", aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default, None, 1),
    FusedAttentionPattern(
        "sdpa_efficient", aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default, "attn_bias", 1, (3,)),
    FusedAttentionPattern(
        "sdpa_cudnn", aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_cudnn_attention_backward.default, "attn_bias", 1),
    FusedAttentionPattern("sdpa", aten.scaled_dot_product_attention.default, None, "attn_mask", None),
)
_BY_FORWARD = {p.forward: p for p in FUSED_PATTERNS}
_BY_BACKWARD = {p.backward: p for p in FUSED_PATTERNS if p.backward is not None}


def bound_arguments(node: fx.Node) -> dict[str, Any]:
    """node's arguments by schema name, defaults filled in (torch.fx's normalize_function)."""
    normalized = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                    normalize_to_only_use_kwargs=True)
    if normalized is None:
        raise ValueError(f"{node.format_node()}: the arguments do not bind to {node.target}'s schema")
    return dict(normalized.kwargs)


@dataclass(frozen=True)
class SequencePadding:
    """How a fused attention's sequence lengths reach multiples of block_size (mx_gemm's rule:
    keys always, since O = P·V and dQ = dS·K contract over them; queries when training, since
    dV = Pᵀ·dO and dK = dSᵀ·Q contract over them). Padded keys and values are zeros and the
    padded keys are masked (score -inf, probability 0), except under a causal mask on a square
    (query length == key length), which already hides them from every real query; padded
    queries are zeros, their gradient rows zeros, and their output rows are sliced off."""

    key: ContractionPadding
    query: ContractionPadding | None  # None: the query length is not blocked (inference)
    mask_keys: bool  # padded keys need a mask

    @property
    def active(self) -> bool:
        return self.key.padded or (self.query is not None and self.query.padded)

    def describe(self) -> str:
        parts = []
        if self.key.padded:
            masked = "masked" if self.mask_keys else "hidden by the causal mask"
            parts.append(f"{self.key.describe('key length ')}, padded keys {masked}")
        if self.query is not None and self.query.padded:
            parts.append(f"{self.query.describe('query length ')}, padded queries sliced off")
        return "; ".join(parts)


@dataclass
class FusedSite:
    pattern: FusedAttentionPattern
    forward: fx.Node
    backward: fx.Node | None = None
    duplicate_backward: bool = False
    padding: SequencePadding | None = None  # set by _fused_ineligibility


def _fused_sites(gm: fx.GraphModule) -> list[FusedSite]:
    """Every fused attention forward node, paired with the backward node that reads its
    logsumexp output."""
    sites: dict[fx.Node, FusedSite] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BY_FORWARD:
            sites[node] = FusedSite(_BY_FORWARD[node.target], node)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _BY_BACKWARD:
            continue
        lse = _strip_alias(bound_arguments(node).get("logsumexp"))
        if not (isinstance(lse, fx.Node) and lse.target is operator.getitem):
            continue
        site = sites.get(lse.args[0])
        if site is None or site.pattern.backward is not node.target:
            continue
        if site.backward is not None:
            site.duplicate_backward = True
        site.backward = node
    return list(sites.values())


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The users of node, looking through aten.alias chains."""
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and user.target is aten.alias.default:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _getitem_users(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def _fused_ineligibility(gm: fx.GraphModule, site: FusedSite, config: MXConfig) -> str | None:
    """Why this fused attention must stay aten's, or None when it can be replaced."""
    if config.attention is AttentionMode.OFF:
        return _attention_off_reason(config)
    fwd = bound_arguments(site.forward)
    q, k, v = (fake_value(fwd[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key or value has no fake tensor value"
    dropout = fwd.get("dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return f"dropout_p={dropout}: the MX attention kernel has no dropout"
    if not isinstance(fwd.get("is_causal", False), bool):
        return f"is_causal={fwd.get('is_causal')!r} is not a static bool"
    scale = fwd.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        return f"scale={scale!r} is not a static number"
    mask_node = fwd.get(site.pattern.mask_arg) if site.pattern.mask_arg else None
    mask = fake_value(mask_node)
    if mask_node is not None and not isinstance(mask, torch.Tensor):
        return "the attention mask has no fake tensor value"
    training = site.backward is not None
    for what, size in {"head_dim": q.shape[-1], "value head_dim": v.shape[-1]}.items():
        if not isinstance(size, int) and not statically_known_true(size % config.block_size == 0):
            return f"symbolic {what} {size} is not provably divisible by block_size={config.block_size}"
    padding = _sequence_padding(q, k, mask, training, bool(fwd.get("is_causal", False)), config)
    if isinstance(padding, str):
        return padding
    site.padding = padding
    padded_len = {2: _padded_hint(padding.query, q.shape[2]), -2: _padded_hint(padding.query, q.shape[2]),
                  -1: _padded_hint(padding.key, k.shape[2])}
    hinted = [torch.empty((*shape_hint(t)[:2], padded_len[2 if t is q else -1], shape_hint(t)[3]),
                          dtype=t.dtype, device="meta") for t in (q, k, v)]
    hinted_mask = None
    if mask is not None:
        mask_shape = list(shape_hint(mask))
        for axis in (-2, -1):
            if mask.ndim >= -axis and mask_shape[axis] != 1:
                mask_shape[axis] = padded_len[axis]
        hinted_mask = torch.empty(mask_shape, dtype=mask.dtype, device="meta")
    reason = check_attention_inputs(*hinted, hinted_mask, config.block_size, need_query_blocks=training)
    if reason is not None:
        return reason
    if site.duplicate_backward:
        return "more than one backward node reads this attention's logsumexp"
    # Outputs other than the attention output may only feed the backward node we replace.
    outputs = _getitem_users(site.forward) if site.pattern.lse_output is not None else {}
    for index, item in outputs.items():
        if index != 0 and any(u is not site.backward for u in _consumers(item)):
            return f"output {index} of {site.forward.target} is used outside its backward op"
    if site.backward is not None:
        for index, item in _getitem_users(site.backward).items():
            if index in site.pattern.backward_extra_outputs and _consumers(item):
                return f"backward output {index} (the mask's gradient) is used; MX attention has none"
    mismatch = _layout_mismatch(gm, site, config) if not padding.active else _undense_output(site)
    if mismatch is not None:
        return mismatch
    selected, why_not = config.module_selected(module_name(site.forward))
    if not selected:
        return why_not
    if 2 * math.prod(shape_hint(q)) * shape_hint(k)[-2] < config.min_gemm_flops:
        return f"attention GEMMs are below min_gemm_flops={config.min_gemm_flops}"
    return None


def _padded_hint(padding: ContractionPadding | None, length: Any) -> int:
    hint = concrete_int(length)
    if padding is None or not padding.padded:
        return hint
    return -(-hint // padding.block_size) * padding.block_size


def _sequence_padding(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, training: bool,
                      is_causal: bool, config: MXConfig) -> SequencePadding | str:
    """The padding of one fused attention, or why its lengths keep it in high precision."""
    key = contraction_padding(k.shape[2], config.block_size)
    query = contraction_padding(q.shape[2], config.block_size) if training else None
    for what, padding in (("key length", key), ("query length", query)):
        if padding is not None and padding.keep_reason is not None:
            return f"{what}: {padding.keep_reason}"
    square_causal = is_causal and statically_known_true(q.shape[2] == k.shape[2])
    mask_keys = key.padded and not square_causal
    if mask is not None and mask.ndim >= 1 and key.padded:
        if not statically_known_true(mask.shape[-1] == k.shape[2]):
            return (f"attn_mask {shape_hint(mask)} is not given per key (length {concrete_int(k.shape[2])}), "
                    "so the padded keys cannot be masked in it")
    if mask is not None and mask.ndim >= 2 and query is not None and query.padded:
        if not (statically_known_true(mask.shape[-2] == 1) or statically_known_true(mask.shape[-2] == q.shape[2])):
            return f"attn_mask {shape_hint(mask)} does not have the query length on its second-last axis"
    return SequencePadding(key, query, mask_keys)


def _undense_output(site: FusedSite) -> str | None:
    """Why a padded site's outputs cannot be given back the layout the graph was traced with
    (`_restore_layout` rebuilds dense layouts only), or None."""
    items = [(site.forward, _forward_output(site))]
    if site.backward is not None:
        items += [(site.backward, item) for index, item in _getitem_users(site.backward).items() if index < 3]
    for op_node, item in items:
        value = fake_value(item) if item is not None else None
        if isinstance(value, torch.Tensor) and not _is_dense(value):
            return f"output {item.name} of {op_node.target} is not dense ({_describe(value)})"
    return None


def _dense_order(value: torch.Tensor) -> list[int]:
    """value's dims from the largest stride to the smallest (by the strides' hints)."""
    strides = [concrete_int(s) or 0 for s in value.stride()]
    return sorted(range(value.ndim), key=lambda d: -strides[d])


def _is_dense(value: torch.Tensor) -> bool:
    expected = 1
    for dim in reversed(_dense_order(value)):
        size = concrete_int(value.shape[dim])
        if size != 1 and concrete_int(value.stride()[dim]) != expected:
            return False
        expected *= size
    return True


def _forward_output(site: FusedSite) -> fx.Node | None:
    if site.pattern.lse_output is None:
        return site.forward
    return _getitem_users(site.forward).get(0)


@dataclass(frozen=True)
class _OpArguments:
    """The arguments of mxcompile::attention / attention_backward for one fused site (nodes
    where the aten op had nodes)."""

    forward: tuple
    backward: tuple | None  # with the placeholders OUT and LSE for the new forward's outputs


_OUT, _LSE = object(), object()


def _batch_chunk(q_node: fx.Node, config: MXConfig) -> int:
    """Batch elements the ops' torch implementation runs at a time: one under a memory budget
    (the least scratch; the plan then widens it where the budget leaves room, see
    `attention_chunks`) or with `attention_chunking=LEAST_MEMORY`, else
    `attention_chunks.unbudgeted_chunk`. A budget of 1.0 keeps everything, so it keeps the
    unbudgeted chunk too: its step is the step without a budget."""
    query = fake_value(q_node)
    budget = config.memory_budget
    least = config.attention_chunking is AttentionChunking.LEAST_MEMORY
    if least or (budget is not None and not budget.keeps_everything) or query.ndim != 4:
        return 1
    return unbudgeted_chunk(query)


def _op_arguments(site: FusedSite, config: MXConfig) -> _OpArguments:
    fwd = bound_arguments(site.forward)
    q_node, k_node, v_node = fwd["query"], fwd["key"], fwd["value"]
    mask_node = fwd.get(site.pattern.mask_arg) if site.pattern.mask_arg else None
    width = concrete_int(fake_value(q_node).shape[-1])
    scale = float(fwd["scale"]) if fwd.get("scale") is not None else 1.0 / math.sqrt(width)
    key_tile = default_key_tile(config.block_size)
    # The op schemas take str: enum members cross the torch.library boundary as their values.
    common = (bool(fwd.get("is_causal", False)), scale, config.attention.value, config.forward_elem.value)
    tail = (config.scale_mode.value, config.block_size, key_tile, _batch_chunk(q_node, config))
    forward = (q_node, k_node, v_node, mask_node, *common, *tail)
    backward = None
    if site.backward is not None:
        grad_out, bq, bk, bv = site.backward.args[:4]
        backward = (grad_out, bq, bk, bv, mask_node, _OUT, _LSE, *common, config.grad_elem.value, *tail)
    return _OpArguments(forward, backward)


def _same_layout(new: Any, old: Any) -> bool:
    """Same shape, dtype and strides (size-1 dims may differ in stride)."""
    if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)):
        return False
    if new.ndim != old.ndim or new.dtype != old.dtype:
        return False
    # statically_known_true, never ==: a comparison of symbolic sizes would add a guard.
    if not all(statically_known_true(a == b) for a, b in zip(new.shape, old.shape)):
        return False
    return all(statically_known_true(size == 1) or statically_known_true(a == b)
               for size, a, b in zip(new.shape, new.stride(), old.stride()))


def _layout_mismatch(gm: fx.GraphModule, site: FusedSite, config: MXConfig) -> str | None:
    """Why the MX ops' outputs would not have the shapes, dtypes and strides that the nodes
    after the aten ops were traced with, or None when they would. Runs the ops' fake
    implementations on the fake inputs."""
    arguments = _op_arguments(site, config)
    fake_mode = graph_fake_mode(gm)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        out, lse = ATTENTION(*(fake_value(a) for a in arguments.forward))
        checks = [(site.forward, _forward_output(site), out)]
        if arguments.backward is not None:
            values = [out if a is _OUT else lse if a is _LSE else fake_value(a) for a in arguments.backward]
            grads = ATTENTION_BACKWARD(*values)
            items = _getitem_users(site.backward)
            checks += [(site.backward, items.get(i), grads[i]) for i in range(3) if i in items]
    for op_node, item, new in checks:
        if item is None:
            continue
        old = fake_value(item)
        if not _same_layout(new, old):
            return (f"output {item.name} of {op_node.target} is {_describe(old)}; the MX attention "
                    f"op would return {_describe(new)}")
    return None


def _describe(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    return f"{value.dtype} {shape_hint(value)} with strides {tuple(concrete_int(s) for s in value.stride())}"


def _fused_gemm_rows(site: FusedSite) -> list[tuple[fx.Node, str, int, tuple]]:
    """(node, role, FLOPs, operands) of the attention GEMMs inside a fused site."""
    fwd = bound_arguments(site.forward)
    q_node, k_node, v_node = fwd["query"], fwd["key"], fwd["value"]
    q, k, v = (shape_hint(fake_value(n)) for n in (q_node, k_node, v_node))
    batch, heads, q_len, width = q
    k_len, v_width = k[2], v[3]
    p_shape = (batch, heads, q_len, k_len)
    qk_flops = 2 * batch * heads * q_len * k_len * width
    pv_flops = 2 * batch * heads * q_len * k_len * v_width
    p_name = f"{site.forward.name}.P"

    def op(name: str, shape: tuple, axis: int) -> tuple:
        return (name, shape, axis)

    rows = [
        (site.forward, S_QK, qk_flops, (op(q_node.name, q, 3), op(k_node.name, k, 3))),
        (site.forward, O_PV, pv_flops, (op(p_name, p_shape, 3), op(v_node.name, v, 2))),
    ]
    if site.backward is not None:
        do_node = site.backward.args[0]
        do_name = do_node.name if isinstance(do_node, fx.Node) else "dO"
        ds_name = f"{site.backward.name}.dS"
        do_shape = (batch, heads, q_len, v_width)
        rows += [
            (site.backward, DV, pv_flops, (op(p_name, p_shape, 2), op(do_name, do_shape, 2))),
            (site.backward, DP, pv_flops, (op(do_name, do_shape, 3), op(v_node.name, v, 3))),
            (site.backward, DQ, qk_flops, (op(ds_name, p_shape, 3), op(k_node.name, k, 2))),
            (site.backward, DK, qk_flops, (op(ds_name, p_shape, 2), op(q_node.name, q, 2))),
        ]
    return rows


def _operand_elem(role: str, operand_index: int, config: MXConfig) -> ElemFormatName:
    """dO and dS are gradients; everything else (Q, K, V, P) is forward data."""
    gradient_operand = {DV: 1, DP: 0, DQ: 0, DK: 0}.get(role)
    return config.grad_elem if operand_index == gradient_operand else config.forward_elem


def _replace_fused(gm: fx.GraphModule, site: FusedSite, config: MXConfig) -> int:
    """Swap the aten forward (and backward) node for the mxcompile attention ops, padding the
    sequences as site.padding says; returns the number of nodes added."""
    arguments = _op_arguments(site, config)
    padding = site.padding if site.padding is not None and site.padding.active else None
    build = NodeBuilder(gm, site.forward)
    forward_args, mask = list(arguments.forward), None
    if padding is not None:
        mask = _padded_mask(build, arguments.forward[1], arguments.forward[3], padding, config.block_size)
        forward_args[:4] = [*_padded_qkv(build, arguments.forward[:3], padding, config.block_size), mask]
    new_fwd = build.call(ATTENTION, *forward_args)
    out = build.call(operator.getitem, new_fwd, 0)
    lse = build.call(operator.getitem, new_fwd, 1)
    fwd_output = _forward_output(site)
    result = out if padding is None else _unpadded(build, out, arguments.forward[0], fake_value(fwd_output))
    added = len(build.added)

    dead: list[fx.Node] = []
    if site.backward is not None:
        bbuild = NodeBuilder(gm, site.backward)
        values = [out if a is _OUT else lse if a is _LSE else a for a in arguments.backward]
        if padding is not None:
            grad_out = pad_along(bbuild, values[0], 2, config.block_size)
            values[:5] = [grad_out, *_padded_qkv(bbuild, values[1:4], padding, config.block_size), mask]
        new_bwd = bbuild.call(ATTENTION_BACKWARD, *values)
        for index, item in _getitem_users(site.backward).items():
            if index < 3:
                grad = bbuild.call(operator.getitem, new_bwd, index)
                if padding is not None:
                    grad = _unpadded(bbuild, grad, arguments.backward[1 + index], fake_value(item))
                item.replace_all_uses_with(grad)
            dead.append(item)
        added += len(bbuild.added)
        dead.append(site.backward)
    if site.pattern.lse_output is None:
        site.forward.replace_all_uses_with(result)
    else:
        for index, item in _getitem_users(site.forward).items():
            if index == 0:
                item.replace_all_uses_with(result)
            dead.append(item)
    dead.append(site.forward)
    _erase_unused(gm, dead)
    return added


def _padded_qkv(build: NodeBuilder, qkv: Any, padding: SequencePadding, block_size: int) -> list[Any]:
    """q (when its length is blocked), k and v zero-padded along the sequence axis."""
    q, k, v = qkv
    if padding.query is not None and padding.query.padded:
        q = pad_along(build, q, 2, block_size)
    if padding.key.padded:
        k, v = pad_along(build, k, 2, block_size), pad_along(build, v, 2, block_size)
    return [q, k, v]


def _padded_mask(build: NodeBuilder, key: fx.Node, mask: Any, padding: SequencePadding,
                 block_size: int) -> Any:
    """The mask for the padded sequences: the model's mask with -inf (False) for padded keys and
    0 (True) rows for padded queries, or, without one, a boolean mask of the real keys when the
    padded keys need one."""
    if mask is None:
        if not padding.mask_keys:
            return None
        keys = build.call(aten.new_ones.default, key, [size_value(build, key, 2)], dtype=torch.bool)
        return pad_along(build, keys, 0, block_size, False)
    is_bool = fake_value(mask).dtype == torch.bool
    if padding.key.padded:
        mask = pad_along(build, mask, -1, block_size, False if is_bool else -math.inf)
    value = fake_value(mask)
    if (padding.query is not None and padding.query.padded and value.ndim >= 2
            and not statically_known_true(value.shape[-2] == 1)):
        mask = pad_along(build, mask, -2, block_size, True if is_bool else 0.0)
    return mask


def _unpadded(build: NodeBuilder, padded: fx.Node, like_node: fx.Node, like: torch.Tensor) -> fx.Node:
    """padded cut back to like's sequence length (axis 2, as like_node has it), in like's
    dense layout, so that the nodes after it see the tensor they were traced with."""
    if _same_layout(fake_value(padded), like):  # this sequence was not padded
        return padded
    length = size_value(build, like_node, 2)
    sliced = build.call(aten.slice.Tensor, padded, 2, 0, length)
    order = _dense_order(like)
    inverse = [order.index(d) for d in range(like.ndim)]
    dense = build.call(aten.clone.default, build.call(aten.permute.default, sliced, order),
                       memory_format=torch.contiguous_format)
    result = build.call(aten.permute.default, dense, inverse)
    if not _same_layout(fake_value(result), like):
        raise RuntimeError(f"padded attention output {_describe(fake_value(result))} does not match "
                           f"the traced {_describe(like)}")
    return result


def _erase_unused(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Erase the given nodes, and aten.alias nodes that only they used, once nothing uses them
    (alias chains between the replaced forward and backward ops included)."""
    pending = list(nodes)
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if node.users:
                continue
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            pending.remove(node)
            pending += [a for a in inputs if a.target is aten.alias.default and a not in pending]
            progress = True
        # Aliases between a dead getitem and the erased backward op are users of the getitem.
        for node in list(pending):
            pending += [u for u in node.users if u.target is aten.alias.default and u not in pending]
    if any(n.target is not aten.alias.default for n in pending):
        raise RuntimeError(f"replaced attention nodes are still used: {[n.name for n in pending]}")


# --------------------------------------------------------------------------------------------
# Eager softmax attention

_SCORE_PATH_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.clone.default, aten.alias.default, aten._to_copy.default, aten.squeeze.dim,
    aten.unsqueeze.default, torch.ops.prims.convert_element_type.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,  # softmax scale
    aten.add.Tensor, aten.sub.Tensor, aten.where.self, aten.masked_fill.Scalar,  # masks
    aten.masked_fill.Tensor, aten.tanh.default,  # soft-capping
})
_PROB_PATH_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.clone.default, aten.alias.default, aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    aten.where.self,  # _safe_softmax's zeroing of fully masked rows
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Scalar,  # dropout mask and 1 / (1 - p)
    # dropout left whole (Inductor's fallback_random keeps torch's own random ops) and its output
    aten.native_dropout.default, operator.getitem,
})
_SEARCH_LIMIT = 64  # nodes visited (breadth first) from a softmax in either direction


def _reduces_last_axis(dims: Any, ndim: int) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, ndim - 1)


def _softmax_sites(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(scores, probabilities) of every softmax over the last axis: `_softmax`, or its
    decomposition exp(x - amax(x)) / sum(exp(x - amax(x)))."""
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_backward(node):
            continue
        value = fake_value(node)
        ndim = value.ndim if isinstance(value, torch.Tensor) else 0
        if node.target is aten._softmax.default and _reduces_last_axis([node.args[1]], ndim):
            sites.append((node.args[0], node))
            continue
        if node.target is not aten.div.Tensor:
            continue
        numerator, denominator = node.args[0], node.args[1]
        if not (isinstance(numerator, fx.Node) and isinstance(denominator, fx.Node)):
            continue
        if numerator.target is not aten.exp.default or denominator.target is not aten.sum.dim_IntList:
            continue
        if denominator.args[0] is not numerator or not _reduces_last_axis(denominator.args[1], ndim):
            continue
        shifted = numerator.args[0]
        if not (isinstance(shifted, fx.Node) and shifted.target is aten.sub.Tensor):
            continue
        scores, row_max = shifted.args[0], shifted.args[1]
        if not (isinstance(row_max, fx.Node) and row_max.target is aten.amax.default):
            continue
        if row_max.args[0] is not scores or not _reduces_last_axis(row_max.args[1], ndim):
            continue
        sites.append((scores, node))
    return sites


def _is_bmm(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.bmm.default


def _score_gemm(scores: fx.Node) -> fx.Node | None:
    """The one forward bmm that the softmax input is computed from through score-shaping ops."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    queue = collections.deque([scores])
    while queue and len(seen) < _SEARCH_LIMIT:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        if _is_bmm(node):
            if not is_backward(node):
                found.add(node)
            continue
        if node.op == "call_function" and node.target in _SCORE_PATH_OPS:
            queue.extend(node.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def _value_gemm(probabilities: fx.Node) -> fx.Node | None:
    """The one forward bmm that takes the softmax output (through probability-shaping ops) as
    its left operand."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    queue = collections.deque([probabilities])
    while queue and len(seen) < _SEARCH_LIMIT:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op != "call_function" or is_backward(user):
                continue
            if _is_bmm(user):
                if user.args[0] is node:
                    found.add(user)
            elif user.target in _PROB_PATH_OPS:
                queue.append(user)
    return found.pop() if len(found) == 1 else None


def _transposed_from(node: Any) -> fx.Node | None:
    """X when node is X with its last two axes swapped (permute / transpose, through aliases)."""
    node = _strip_alias(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    value = fake_value(node)
    ndim = value.ndim if isinstance(value, torch.Tensor) else 0
    if node.target is aten.permute.default:
        dims = [d % ndim for d in node.args[1]]
        if ndim >= 2 and dims == [*range(ndim - 2), ndim - 1, ndim - 2]:
            return _strip_alias(node.args[0])
    if node.target is aten.transpose.int and ndim >= 2:
        if {node.args[1] % ndim, node.args[2] % ndim} == {ndim - 2, ndim - 1}:
            return _strip_alias(node.args[0])
    return None


@dataclass
class EagerSite:
    """The bmm nodes of one eager attention, by role."""

    gemms: dict[str, fx.Node]


def _eager_sites(gm: fx.GraphModule) -> list[EagerSite]:
    sites = []
    claimed: set[fx.Node] = set()
    for scores, probabilities in _softmax_sites(gm):
        s_gemm, o_gemm = _score_gemm(scores), _value_gemm(probabilities)
        if s_gemm is None or o_gemm is None or s_gemm is o_gemm or {s_gemm, o_gemm} & claimed:
            continue
        gemms = {S_QK: s_gemm, O_PV: o_gemm}
        sources = {
            (0, _strip_alias(o_gemm.args[0])): DV,  # Pᵀ as left operand
            (1, _strip_alias(o_gemm.args[1])): DP,  # Vᵀ as right operand
            (0, _strip_alias(s_gemm.args[0])): DK,  # Qᵀ as left operand (computes dKᵀ)
            (1, _strip_alias(s_gemm.args[1])): DQ,  # (Kᵀ)ᵀ as right operand
        }
        for node in gm.graph.nodes:
            if not _is_bmm(node) or not is_backward(node) or node in claimed:
                continue
            roles = {sources.get((i, _transposed_from(node.args[i]))) for i in (0, 1)} - {None}
            if len(roles) == 1:
                role = roles.pop()
                if role not in gemms:
                    gemms[role] = node
        claimed.update(gemms.values())
        sites.append(EagerSite(gemms))
    return sites


def _eager_ineligibility(node: fx.Node, role: str, padding: ContractionPadding, config: MXConfig) -> str | None:
    reason = _mx_role(role, config)
    if reason is not None:
        return reason
    reason = operand_dtype_reason({"lhs": fake_value(node.args[0]), "rhs": fake_value(node.args[1])})
    if reason is not None:
        return reason
    if padding.keep_reason is not None:
        return padding.keep_reason
    return selection_reason(node, _bmm_flops(node), config)


def _bmm_flops(node: fx.Node) -> int:
    batch, m, k = shape_hint(fake_value(node.args[0]))
    return 2 * batch * m * k * shape_hint(fake_value(node.args[1]))[2]


def _convert_bmm(gm: fx.GraphModule, node: fx.Node, elems: tuple[str, str], padding: ContractionPadding,
                 config: MXConfig) -> int:
    """bmm(a, b) -> mx_mm(quantize(a, along 2), quantize(b, along 1)), zero-padded along the
    contraction when needed (mx_gemm); returns nodes added."""
    result, build = emit_mx_gemm(gm, node, node.args[0], node.args[1], (2, 1), elems, padding, config)
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return len(build.added)


# --------------------------------------------------------------------------------------------


def rewrite_attention(gm: fx.GraphModule, config: MXConfig, graph_name: str) -> PassResult:
    """Find attention in one graph, rewrite it in place; return the decisions and node counts."""
    decisions: list[GemmDecision] = []
    added = removed = 0

    for site in _fused_sites(gm):
        reason = _fused_ineligibility(gm, site, config)
        replace = reason is None
        for node, role, flops, operands in _fused_gemm_rows(site):
            role_reason = reason if reason is not None else _mx_role(role, config)
            converted = role_reason is None
            elems = tuple(_operand_elem(role, i, config) for i in range(2))
            if converted:
                padded = f"; {site.padding.describe()}" if site.padding is not None and site.padding.active else ""
                role_reason = (f"{role}: {ROLE_QUANTIZATION[role]} (MX attention op, key-tiled, "
                               f"fp32 online softmax; pattern {site.pattern.name}{padded})")
            elif replace:
                role_reason += f" (inside the MX attention op; pattern {site.pattern.name})"
            else:
                role_reason += f" (pattern {site.pattern.name})"
            decisions.append(GemmDecision(
                graph=_graph_label(node, graph_name), node=node.name, op=f"{node.target} [{role}]",
                kind=KIND, shapes=tuple(shape for _, shape, _ in operands), flops=flops,
                module=module_name(site.forward), decision=CONVERTED if converted else KEPT,
                reason=role_reason,
                operands=tuple(OperandQuantization.of(name, shape, axis, config.mx_operand_format(elem))
                               for (name, shape, axis), elem in zip(operands, elems)) if converted else (),
            ))
        if replace:
            removed += 1 + (site.backward is not None)
            added += _replace_fused(gm, site, config)

    gradients = nodes_depending_on(tangent_placeholders(gm))
    for site in _eager_sites(gm):
        for role in (*FORWARD_ROLES, *BACKWARD_ROLES):
            node = site.gemms.get(role)
            if node is None:
                continue
            lhs_node, rhs_node = node.args[0], node.args[1]
            lhs, rhs = fake_value(lhs_node), fake_value(rhs_node)
            elems = tuple(config.grad_elem if n in gradients else config.forward_elem for n in (lhs_node, rhs_node))
            padding = contraction_padding(lhs.shape[2], config.block_size)
            reason = _eager_ineligibility(node, role, padding, config)
            flops = _bmm_flops(node)
            decision = GemmDecision(
                graph=_graph_label(node, graph_name), node=node.name, op=f"{node.target} [{role}]",
                kind=KIND, shapes=(shape_hint(lhs), shape_hint(rhs)), flops=flops,
                module=module_name(node), decision=CONVERTED if reason is None else KEPT,
                reason=(f"{role}: {ROLE_QUANTIZATION[role]} ({padding.describe()}; "
                        "eager softmax attention)") if reason is None
                else f"{reason} ({role}; eager softmax attention)",  # the reason first, as the fused sites
                operands=(
                    OperandQuantization.of(lhs_node.name, shape_hint(lhs), 2, config.mx_operand_format(elems[0])),
                    OperandQuantization.of(rhs_node.name, shape_hint(rhs), 1, config.mx_operand_format(elems[1])),
                ) if reason is None else (),
            )
            decisions.append(decision)
            if reason is None:
                added += _convert_bmm(gm, node, elems, padding, config)
                removed += 1
            else:
                node.meta[CLAIMED_KEY] = role

    if added or removed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(NAME, graph_name, added, removed, tuple(decisions))
