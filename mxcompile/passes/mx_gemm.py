"""One GEMM eligibility-and-conversion helper for the rewrite passes (gemm_rewrite and the eager
form of attention_rewrite). Not a pass.

A GEMM converts to MX by quantizing each operand along its contraction axis in blocks of
`block_size` and multiplying the quantized operands (`mxcompile::mx_mm`). When the contraction
length K is not a multiple of `block_size`, both operands are zero-padded along it to the next
multiple first. This is exact: a zero neither changes the maximum of its block (so no scale
changes) nor adds anything to a dot product, so the padded MX GEMM equals the MX GEMM of the
unpadded operands with their last partial block quantized on its own. Only the contraction axis
is padded; M and N are never blocked.

The padding rule (`contraction_padding`):
  - K a multiple of block_size (provably, for symbolic K): no padding.
  - K static: pad to Kp = ceil(K / block_size) * block_size, unless Kp >= MX_GEMM_SPEEDUP * K,
    i.e. unless the padding at least doubles the GEMM's work, which is all that MX's FP8
    throughput (twice that of bf16) could save. With block_size 32 this keeps exactly the
    GEMMs with K <= 16 (a router's K = number of experts, say) and pads every K > 16.
  - K symbolic and not provably divisible (dynamic shapes: s27, s31*s46): pad at run time by
    `(-K) % block_size`, computed in the graph from the operand's size, so the compiled graph
    serves every length without a guard on K. Never kept: its length is unknown at compile time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import MXConfig, OperandFormat
from ..numerics import ElemFormatName
from ..ops.mx_mm import MX_MM, MX_MM_FP4
from ..ops.quantize import QUANTIZE, QUANTIZE_FP4
from .graph_facts import NodeBuilder, concrete_int, fake_value, module_name
from .meta_keys import GEMM_KERNEL_KEY

aten = torch.ops.aten

MX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FP8 tensor-core throughput relative to bf16 (Hopper, Blackwell): the most a conversion saves.
MX_GEMM_SPEEDUP = 2
FP4_QUANTIZE_OUTPUTS = 3  # mxcompile::quantize_fp4: data, scale bytes, tensor scale


@dataclass(frozen=True)
class ContractionPadding:
    """How a contraction length K reaches a multiple of block_size."""

    length: Any  # K: an int or a SymInt
    block_size: int
    padded: bool  # operands are zero-padded along K before quantization
    keep_reason: str | None = None  # set when padding costs more than MX saves

    def __post_init__(self) -> None:
        if self.padded and self.keep_reason is not None:
            raise ValueError("a padded contraction has no reason to be kept")

    @property
    def symbolic(self) -> bool:
        return not isinstance(self.length, int)

    def describe(self, name: str = "K=") -> str:
        """The contraction part of a decision's reason (`name` precedes the length)."""
        hint = concrete_int(self.length)
        if not self.padded:
            return f"{name}{hint}"
        if self.symbolic:
            return (f"{name}{self.length} (hint {hint}) zero-padded at run time to a multiple of "
                    f"block_size={self.block_size}")
        padded = -(-self.length // self.block_size) * self.block_size
        return f"{name}{self.length} zero-padded to {padded}"


def contraction_padding(length: Any, block_size: int) -> ContractionPadding:
    """The padding rule of this module's docstring, applied to one contraction length."""
    if statically_known_true(length % block_size == 0):
        return ContractionPadding(length, block_size, padded=False)
    if not isinstance(length, int):
        return ContractionPadding(length, block_size, padded=True)
    padded = -(-length // block_size) * block_size
    if padded >= MX_GEMM_SPEEDUP * length:
        return ContractionPadding(length, block_size, padded=False, keep_reason=(
            f"contraction length {length} pads to {padded} (block_size={block_size}): "
            f"{padded / length:.1f}x the work, at least the {MX_GEMM_SPEEDUP}x MX saves"))
    return ContractionPadding(length, block_size, padded=True)


def operand_dtype_reason(operands: dict[str, Any]) -> str | None:
    """Why an operand cannot be MX-quantized because of its dtype, or None."""
    for name, t in operands.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in MX_DTYPES:
            return (f"{name} dtype {getattr(t, 'dtype', None)} is not one of "
                    f"{[str(d) for d in MX_DTYPES]}")
    return None


def selection_reason(node: fx.Node, flops: int, config: MXConfig) -> str | None:
    """Why config's min_gemm_flops or module selection keeps this GEMM, or None."""
    if flops < config.min_gemm_flops:
        return f"{flops} FLOPs is below min_gemm_flops={config.min_gemm_flops}"
    selected, why_not = config.module_selected(module_name(node))
    return None if selected else why_not


def size_value(build: NodeBuilder, operand: fx.Node, axis: int) -> Any:
    """operand's length along axis as a graph argument: the int when static, else a
    sym_size node (read at run time)."""
    length = fake_value(operand).shape[axis]
    return length if isinstance(length, int) else build.call(aten.sym_size.int, operand, axis)


def pad_along(build: NodeBuilder, operand: fx.Node, axis: int, block_size: int, value: float = 0.0) -> fx.Node:
    """operand padded with `value` along axis to a multiple of block_size; the amount is a graph
    value when the length is symbolic, so the padding follows the run-time length."""
    ndim = fake_value(operand).ndim
    axis %= ndim
    length = size_value(build, operand, axis)
    if isinstance(length, int):
        amount: Any = -length % block_size
    else:
        amount = build.call(operator.mod, build.call(operator.neg, length), block_size)
    pad = [0, 0] * (ndim - 1 - axis) + [0, amount]
    return build.call(aten.constant_pad_nd.default, operand, pad, value)


def emit_mx_gemm(
    gm: fx.GraphModule, node: fx.Node, lhs: fx.Node, rhs: fx.Node, axes: tuple[int, int],
    elems: tuple[ElemFormatName, ElemFormatName], padding: ContractionPadding, config: MXConfig,
    formats: tuple[OperandFormat, OperandFormat] | None = None,
) -> tuple[fx.Node, NodeBuilder]:
    """Insert quantize(lhs along axes[0]), quantize(rhs along axes[1]) -> mx_mm before `node`,
    zero-padding both along the contraction first when `padding.padded`. Returns the mx_mm
    node (of node's output dtype) and the builder holding every added node.

    `formats` (one `OperandFormat` per operand, `MXConfig.operand_format`), when FP4, emits
    the FP4 ops instead (`quantize_fp4` x2 -> `mx_mm_fp4`); MXFP8 formats take `elems`."""
    if formats is not None and formats[0].is_fp4:
        return _emit_fp4_gemm(gm, node, lhs, rhs, axes, formats, padding, config)
    build = NodeBuilder(gm, node)
    quantized = []
    for operand, axis, elem in ((lhs, axes[0], elems[0]), (rhs, axes[1], elems[1])):
        if padding.padded:
            operand = pad_along(build, operand, axis, config.block_size)
        # The op schemas take str: enum members cross the torch.library boundary as their values.
        q = build.call(QUANTIZE, operand, axis, elem.value,
                       config.scale_mode.value, config.block_size)
        q.meta[GEMM_KERNEL_KEY] = config.gemm_kernel
        quantized += [build.call(operator.getitem, q, 0), build.call(operator.getitem, q, 1)]
    out_dtype = fake_value(node).dtype
    result = build.call(MX_MM, *quantized, config.block_size, out_dtype)
    result.meta[GEMM_KERNEL_KEY] = config.gemm_kernel
    return result, build


def fp4_contraction_padding(length: Any, fmt: OperandFormat) -> ContractionPadding:
    """`contraction_padding` with the FP4 format's own block (NVFP4: 16, MXFP4: 32)."""
    return contraction_padding(length, fmt.block_format.block_size)


def _emit_fp4_gemm(
    gm: fx.GraphModule, node: fx.Node, lhs: fx.Node, rhs: fx.Node, axes: tuple[int, int],
    formats: tuple[OperandFormat, OperandFormat], padding: ContractionPadding, config: MXConfig,
) -> tuple[fx.Node, NodeBuilder]:
    """`emit_mx_gemm` for FP4 operands: quantize_fp4 (data, scale bytes, tensor scale) per
    operand, then mx_mm_fp4 recording `config.gemm_kernel` as `emit_mx_gemm`'s mx_mm does. Both
    operands share one block format (the recipe's); the RHT signs (when an operand's format asks
    for them) and the draws are seeded by `config.seed`."""
    if formats[0].block_format != formats[1].block_format:
        raise ValueError(f"an FP4 GEMM takes one block format, got {formats[0].describe()} x {formats[1].describe()}")
    build = NodeBuilder(gm, node)
    quantized = []
    for operand, axis, fmt in ((lhs, axes[0], formats[0]), (rhs, axes[1], formats[1])):
        if padding.padded:
            operand = pad_along(build, operand, axis, padding.block_size)
        q = build.call(QUANTIZE_FP4, operand, axis, fmt.block_format.name, config.scale_mode.value, fmt.block_2d,
                       fmt.stochastic, config.seed, config.seed if fmt.rht else None)
        quantized += [build.call(operator.getitem, q, i) for i in range(FP4_QUANTIZE_OUTPUTS)]
    result = build.call(MX_MM_FP4, *quantized, formats[0].block_format.name, fake_value(node).dtype)
    # The lowering decides from this node alone (`lower_fp4_gemms`): unlike MXFP8's quantize
    # nodes, the FP4 quantize nodes have no Inductor form to switch to, so they carry no record.
    result.meta[GEMM_KERNEL_KEY] = config.gemm_kernel
    return result, build
