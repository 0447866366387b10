"""Grouped GEMMs (`aten._grouped_mm` with offsets): the MoE expert computation that
transformers 5 emits (`experts_implementation="grouped_mm"`, its default) for Mixtral and
Qwen-MoE style models in bf16; in other dtypes gemm_rewrite turns transformers' fallback op into
`mxcompile::grouped_mm` of the same semantics, handled here alike. Not a pass: gemm_rewrite calls
it for grouped nodes.

Two forms appear in a training graph, both with `offs` (E,) int32, the cumulative token count
per expert (data-dependent):

  rows         A (S, K) x B (E, K, N) -> (S, N): the expert forward Y_e = X_e W_e and the input
               gradient dX_e = dY_e W_eᵀ. Each token row meets one expert's weights; the
               contraction K (hidden or intermediate width) is the same for every group, so both
               operands are quantized along K as an ordinary GEMM's are (mx_gemm's padding rule).
  contraction  A (M, S) x B (S, N) -> (E, M, N): the weight gradient dW_e = dY_eᵀ X_e, which
               contracts over each expert's tokens. Blocks of 32 must not straddle two experts,
               so, as torchao's MX grouped GEMM does, each expert's token count is zero-padded to
               a multiple of block_size: the rows are scattered into a buffer of static length
               ceil((S + E (block_size - 1)) / block_size) block_size (the most the padding can
               need) at offsets where every group starts on a block boundary, and the GEMM runs
               on the padded offsets. Exact: the added rows are zeros.

The operands are MX-quantized (`mxcompile::quantize`) and dequantized (`mxcompile::dequantize`)
in the graph, and the grouped product runs on those MX values with aten's grouped kernel: the
numerics of an MX grouped GEMM, executed as an emulation (there is no MX grouped GEMM op in
mxcompile yet), which every decision row says.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..config import MXConfig
from ..numerics import ElemFormatName
from ..ops.quantize import DEQUANTIZE, QUANTIZE
from .graph_facts import NodeBuilder, concrete_int, fake_value
from .mx_gemm import ContractionPadding, pad_along, size_value

aten = torch.ops.aten
GROUPED_MM = aten._grouped_mm.default
ROWS, CONTRACTION = "rows", "contraction"
_FORMS = (ROWS, CONTRACTION)
EMULATION_NOTE = "grouped product on the dequantized MX values (no MX grouped GEMM kernel)"


@dataclass(frozen=True)
class GroupedGemm:
    """One aten._grouped_mm node: its form, operands and groups."""

    form: str
    lhs: fx.Node
    rhs: fx.Node
    offsets: fx.Node
    groups: int  # E, the number of experts

    def __post_init__(self) -> None:
        if self.form not in _FORMS:
            raise ValueError(f"form={self.form!r}; accepted: {list(_FORMS)}")

    @property
    def axes(self) -> tuple[int, int]:
        """The contraction axis of each operand."""
        return (1, 1) if self.form == ROWS else (1, 0)


def grouped_gemm(node: fx.Node) -> GroupedGemm | str:
    """node as a GroupedGemm, or why it is a form this module does not convert."""
    lhs, rhs = node.args[0], node.args[1]
    offsets = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    a, b, offs = fake_value(lhs), fake_value(rhs), fake_value(offsets)
    if not isinstance(offs, torch.Tensor):
        return "grouped GEMM without offsets (a batched GEMM): not converted"
    if bias is not None:
        return "grouped GEMM with a bias: not converted"
    groups = concrete_int(offs.shape[0])
    if a.ndim == 2 and b.ndim == 3:
        return GroupedGemm(ROWS, lhs, rhs, offsets, groups)
    if a.ndim == 2 and b.ndim == 2:
        return GroupedGemm(CONTRACTION, lhs, rhs, offsets, groups)
    return f"grouped GEMM of a {a.ndim}-D and a {b.ndim}-D operand: not converted"


def grouped_flops(gemm: GroupedGemm) -> int:
    """2 M N K summed over the groups: every row (rows form) or every contraction index
    (contraction form) belongs to exactly one group."""
    a = [concrete_int(s) or 0 for s in fake_value(gemm.lhs).shape]
    n = concrete_int(fake_value(gemm.rhs).shape[-1]) or 0
    return 2 * a[0] * a[1] * n


def describe(gemm: GroupedGemm, padding: ContractionPadding) -> str:
    """The reason text of a converted grouped GEMM."""
    groups = f"{gemm.groups} groups (experts) at offsets {gemm.offsets.name}"
    if gemm.form == ROWS:
        return (f"grouped GEMM, {groups} over the rows; operands quantized along their contraction "
                f"axis ({padding.describe()}); {EMULATION_NOTE}")
    return (f"grouped weight-gradient GEMM contracting over each group's tokens, {groups}; each "
            f"group's token count zero-padded to a multiple of block_size={padding.block_size}; "
            f"{EMULATION_NOTE}")


def _mx_values(build: NodeBuilder, operand: fx.Node, axis: int, elem: ElemFormatName, config: MXConfig) -> fx.Node:
    """operand MX-quantized along axis and dequantized back to its dtype."""
    q = build.call(QUANTIZE, operand, axis, elem.value, config.scale_mode.value,
                   config.block_size)
    data, scale = build.call(operator.getitem, q, 0), build.call(operator.getitem, q, 1)
    return build.call(DEQUANTIZE, data, scale, axis, config.block_size,
                      fake_value(operand).dtype)


def _padded_bound(build: NodeBuilder, tokens: Any, groups: int, block_size: int) -> Any:
    """ceil((S + E (block_size - 1)) / block_size) block_size: the most rows that padding every
    group's count to a multiple of block_size can need (a graph value when S is symbolic)."""
    if isinstance(tokens, int):
        return -(-(tokens + groups * (block_size - 1)) // block_size) * block_size
    most = build.call(operator.add, tokens, groups * (block_size - 1) + block_size - 1)
    return build.call(operator.mul, build.call(operator.floordiv, most, block_size), block_size)


def _group_padded(build: NodeBuilder, gemm: GroupedGemm, block_size: int) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(A, B, offsets) with every group's contraction rows moved to a block boundary."""
    ends = build.call(aten._to_copy.default, gemm.offsets, dtype=torch.int64)
    starts = build.call(aten.constant_pad_nd.default,
                        build.call(aten.slice.Tensor, ends, 0, 0, -1), [1, 0], 0.0)
    counts = build.call(aten.sub.Tensor, ends, starts)
    blocks = build.call(aten.div.Tensor_mode, build.call(aten.add.Tensor, counts, block_size - 1),
                        block_size, rounding_mode="floor")
    padded_counts = build.call(aten.mul.Tensor, blocks, block_size)
    padded_ends = build.call(aten.cumsum.default, padded_counts, 0)
    shift = build.call(aten.sub.Tensor, build.call(aten.sub.Tensor, padded_ends, padded_counts), starts)

    tokens = size_value(build, gemm.rhs, 0)
    rows = build.call(aten.arange.start, 0, tokens, dtype=torch.int64,
                      device=fake_value(gemm.rhs).device)
    last = gemm.groups - 1
    group = build.call(aten.clamp.default, build.call(aten.searchsorted.Tensor, ends, rows, right=True),
                       None, last)
    destination = build.call(aten.add.Tensor, rows, build.call(aten.index.Tensor, shift, [group]))
    # Rows past the last offset are ignored by the GEMM; zeroed, they land in padding.
    end = build.call(aten.select.int, ends, 0, last)
    valid = build.call(aten.unsqueeze.default, build.call(aten.lt.Tensor, rows, end), 1)

    bound = _padded_bound(build, tokens, gemm.groups, block_size)

    def scatter(rows_major: fx.Node) -> fx.Node:
        """(S, X) -> (bound, X) with row r at destination[r]."""
        kept = build.call(aten.where.ScalarOther, valid, rows_major, 0.0)
        width = size_value(build, rows_major, 1)
        zeros = build.call(aten.new_zeros.default, rows_major, [bound, width])
        return build.call(aten.index_copy.default, zeros, 0, destination, kept)

    lhs = build.call(aten.permute.default, scatter(build.call(aten.permute.default, gemm.lhs, [1, 0])), [1, 0])
    rhs = scatter(gemm.rhs)
    offsets = build.call(aten._to_copy.default, padded_ends, dtype=fake_value(gemm.offsets).dtype)
    return lhs, rhs, offsets


def emit_grouped_gemm(
    gm: fx.GraphModule, node: fx.Node, gemm: GroupedGemm, elems: tuple[str, str],
    padding: ContractionPadding, config: MXConfig,
) -> NodeBuilder:
    """Replace the grouped node by its MX form (module docstring); returns the builder."""
    build = NodeBuilder(gm, node)
    lhs, rhs, offsets = gemm.lhs, gemm.rhs, gemm.offsets
    if gemm.form == CONTRACTION:
        lhs, rhs, offsets = _group_padded(build, gemm, config.block_size)
    elif padding.padded:
        lhs, rhs = (pad_along(build, n, axis, config.block_size) for n, axis in zip((lhs, rhs), gemm.axes))
    operands = [_mx_values(build, n, axis, elem, config) for n, axis, elem in zip((lhs, rhs), gemm.axes, elems)]
    extra: dict[str, Any] = {}
    out_dtype = node.args[4] if len(node.args) > 4 else node.kwargs.get("out_dtype")
    if out_dtype is not None:
        extra["out_dtype"] = out_dtype
    result = build.call(node.target, *operands, offsets, **extra)
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return build
