"""Static cost estimates for FX graph nodes: bytes of a value, FLOPs, and a roofline time.

Pure functions over FX graphs whose nodes carry fake-tensor metadata (``node.meta["val"]``),
as AOTAutograd's joint and partitioned graphs do. They feed the memory planner's schedule
(:mod:`mxcompile.planner.fx_adapter`), where only the *relative* cost of steps matters: the
planner trades recompute time against memory, so an estimate that ranks ops correctly is
enough; no estimate here is a measurement.

Conventions
    * Bytes are ``numel * element_size`` of every tensor in the value (a tuple of tensors
      counts each), so fp8 data (1 byte per element) and uint8 MX scales (1 byte per block)
      are counted exactly. Symbolic sizes use their runtime hint.
    * FLOPs are counted exactly for GEMMs (``aten.mm``, ``aten.addmm``, ``aten.bmm``,
      ``mxcompile::mx_mm``): ``2 * M * N * K`` (times the batch), and for the MX attention
      ops as their GEMMs (:func:`attention_flops`). Every other op is treated as memory-bound:
      its cost is the bytes it reads and writes.
    * Aliasing ops (views, ``getitem``) move no data and cost nothing.
    * Workspace: scratch memory an op holds while it runs, beyond its output; counted for the
      MX ops: the attention ops (their key-tiled CPU implementation, run `batch_chunk` batch
      elements at a time, keeps fp32 copies of that chunk's operands, the backward most of all), ``mx_mm`` (the
      peak of its torch reference, :func:`mxcompile.ops.mx_mm_peak_bytes`: fp32 copies made
      while dequantizing each operand, then both operands in the GEMM's operand dtype;
      Inductor's decomposed form holds those two operands too) and the eager quantize op (bounded by its
      slice, :data:`mxcompile.ops.QUANTIZE_SLICE_ELEMENTS`); and for the eager ATen kernels that
      allocate beside their output (:func:`aten_scratch_bytes`: wrapped scalars, the embedding
      backward's masked copies, an integer sum's widened copy), measured with the allocator.
    * Time is the roofline ``max(flops / peak_flops[dtype], bytes / memory_bandwidth)``, where
      ``mxcompile::mx_mm`` runs at the FP8 rate on devices with FP8 GEMMs and at its operands'
      dtype (:func:`mxcompile.ops.gemm_operand_dtype`) elsewhere (CPUs dequantize first). Where
      the profile measured an MX op's own rate (``DeviceProfile.op_rates``: the CPU's
      compiled quantize runs scalar element loops, its attention op is eager torch code), the
      op takes at least its elements or FLOPs at that rate; the attention ops add the fixed
      time of their passes (one per key tile of each batch chunk, :func:`attention_passes`).
      Run by the eager lowering, an ``mx_mm`` is its torch reference, which first dequantizes
      both operands op by op: priced at the measured ``dequantize`` rate on top
      (:func:`reference_dequantize_time_s`). A recomputation is priced as its lowering runs
      it: under Inductor with pointwise chains fused (:func:`fused_run_time_s`), eagerly op by
      op (:func:`op_by_op_run_time_s`).
    * FP4 (issue 48): a packed E2M1 operand is uint8 with two elements per byte, so its bytes
      are ``numel / 2`` of the operand it holds, plus one scale byte per block (16 elements for
      NVFP4, 32 for MXFP4) and a 0-d fp32 tensor scale: counted exactly by the rule above. An
      ``mxcompile::quantize_fp4`` runs as its torch reference on every device: it takes at least
      its input elements at the profile's measured ``quantize_fp4`` rate, and holds the scratch
      of its reference (:func:`quantize_fp4_scratch_bytes`). An ``mxcompile::mx_mm_fp4``
      (``2 * M * N * K`` FLOPs, K the unpacked contraction) is priced as the lowering runs it
      (:func:`fp4_gemm_runs_packed`). In a CPU graph: an fp32 GEMM of both operands' block
      values at the fp32 rate, after dequantizing both (:func:`fp4_dequantize_time_s`, at the
      measured ``dequantize_fp4`` rate), holding the fp32 block values and products
      (:func:`fp4_gemm_peak_bytes`). In a CUDA graph: the Triton FP4 GEMM on the packed operands
      (no dequantize, no scratch), the roofline of the packed bytes it reads and of its FLOPs at
      the profile's FP4 tensor-core rate (sm100+), else ``TRITON_FP4_GEMM_DTYPE_KEY``'s datasheet
      rate (sm90). No GPU rate of that kernel is measured.
    * gemm_kernel (the node's ``GEMM_KERNEL_KEY`` record): under "dequantized" a CUDA graph runs
      an MX GEMM as a GEMM of its dequantized operands at their dtype's rate, and an FP4 GEMM as
      the fp32 GEMM of its block values, priced as in a CPU graph.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

from ..graph_meta import concrete_int, value_device
from ..numerics.formats import E2M1
from ..ops import gemm_operand_dtype, mx_mm_peak_bytes, quantize_scratch_bytes
from .profiles import (ATTENTION_PASS_RATE, ATTENTION_RATE, DEQUANTIZE_FP4_RATE, DEQUANTIZE_RATE, FP32_BYTES,
                       QUANTIZE_FP4_RATE, QUANTIZE_RATE, DeviceProfile)

FLOPS_PER_MULTIPLY_ADD = 2
MX_MM_SCHEMA_NAME = "mxcompile::mx_mm"
QUANTIZE_SCHEMA_NAME = "mxcompile::quantize"
MX_GEMM_DTYPE = "fp8"  # mxcompile::mx_mm runs at the device's (MX)FP8 tensor-core rate
ATTENTION_SCHEMA_NAME = "mxcompile::attention"
ATTENTION_BACKWARD_SCHEMA_NAME = "mxcompile::attention_backward"
MX_MM_FP4_SCHEMA_NAME = "mxcompile::mx_mm_fp4"
QUANTIZE_FP4_SCHEMA_NAME = "mxcompile::quantize_fp4"
# mxcompile::mx_mm_fp4 in a CPU graph multiplies its operands' block values in fp32
# (`lowering.lower_fp4_gemms`, `numerics.fp4_operand.fp4_gemm`).
FP4_GEMM_OPERAND_DTYPE = torch.float32
FP4_GEMM_DTYPE_KEY = "fp32"
# In a CUDA graph it runs the Triton FP4 GEMM (`lowering.runs_triton_mx_gemm(..., fp4=True)`). On
# sm100+ it multiplies E2M1 on block-scaled tcgen05, at the profile's FP4 tensor-core rate
# (FP4_TENSOR_CORE_DTYPE_KEY: the B200 profile's, twice its FP8 rate). A profile without one
# (sm90) prices it at the datasheet bf16 tensor-core rate, the MMA its sm90 loop (expand_bf16)
# issues: a lower bound of its time there, which leaves out the loop's E2M1 unpacking (untimed
# on a GPU).
FP4_TENSOR_CORE_DTYPE_KEY = "fp4"
TRITON_FP4_GEMM_DTYPE_KEY = "bf16"
# node.meta key where gemm_rewrite (passes/mx_gemm.py) records the config's GemmKernel on the MX
# and FP4 GEMM nodes and the MX quantize nodes: the CUDA lowering reads it to run the Triton
# kernels or a GEMM of the dequantized operands (`lowering.runs_triton_mx_gemm`), and the cost
# model to price the form that runs. Defined here, below the passes, which the cost model may not
# import (passes/meta_keys.py re-exports it beside the other keys).
GEMM_KERNEL_KEY = "mxcompile_gemm_kernel"
ATTENTION_FORWARD_GEMMS = 2  # S = Q K^T, O = P V
ATTENTION_BACKWARD_GEMMS = 5  # S again, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q

_aten = torch.ops.aten
_GEMM_TARGETS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default)

# torch dtype -> DeviceProfile.peak_flops key; dtypes a profile may lack fall back in order.
_DTYPE_KEYS: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: ("fp32",),
    torch.float64: ("fp64", "fp32"),
    torch.bfloat16: ("bf16",),
    torch.float16: ("fp16", "bf16"),
    torch.float8_e4m3fn: ("fp8",),
    torch.float8_e5m2: ("fp8",),
}


def value_bytes(value: Any) -> int:
    """Bytes of a node value: a tensor, or a (nested) tuple/list of tensors; 0 for non-tensors.

    Uses ``numel * element_size``, i.e. the bytes a contiguous copy occupies (what an
    allocation for this value costs), not the size of a possibly larger base storage.
    """
    if isinstance(value, torch.Tensor):
        numel = 1
        for size in value.shape:
            numel *= concrete_int(size) or 0
        return numel * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(value_bytes(v) for v in value)
    return 0


def node_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s value (``meta["val"]``); 0 when it has none."""
    return value_bytes(node.meta.get("val"))


def is_alias(node: fx.Node) -> bool:
    """Whether ``node``'s output aliases an input (a view, or ``getitem`` of a tuple): such a
    node allocates nothing and moves no data."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def alias_root(node: fx.Node) -> fx.Node:
    """The node whose output ``node`` views: back through aliases (:func:`is_alias`) to the
    first node that is not one (``node`` itself if it is not an alias)."""
    while is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# Scratch bytes of the MX attention ops per batch element, times the batch elements the CPU ops
# run at a time (their `batch_chunk` argument): fp32 copies of one element's query (heads x
# seq_q x head_dim) plus fp32 copies of one element's score tile (heads x seq_q x
# min(key_tile, seq_k)), the per-key-tile scores and probabilities. Measured with
# `measure.memory.tensor_peak_bytes` (peak minus outputs; 2026-12-07, native kernels, key tile
# 128) at (batch, heads, seq, head_dim) = (4, 4, 128, 64), (8, 4, 128, 64), (8, 2, 64, 32),
# (2, 4, 256, 64), (1, 2, 512, 64), (4, 4, 128, 32), (1, 8, 256, 64), (2, 8, 512, 64),
# (2, 4, 512, 32), (2, 2, 256, 128), (1, 4, 512, 128), (1, 2, 1024, 32), causal and not: per
# element, in query copies, forward 9.0 / 10.2 / 15.2 and backward 18.0 / 21.1 / 27.1 at most
# with the tile 1 / 2 / 4 times the query (head_dim 128 / 64 / 32); a chunk of c elements held
# at most c times one element's. Fitted as a + b * (tile / query) and rounded up, an upper bound
# at every shape measured. (One constant per op before, 23 and 33 query copies, the worst case
# of all shapes: at head_dim 64 it counted 2.3x and 1.6x the measured scratch, which with
# several elements per chunk put the small GPT's modelled peak 11% over the measured one.)
# The backward remeasured at the same shapes after it dropped its fp32 operand copies and each
# tile's P early and stopped copying one chunk's gradients (2026-12-07, issue 46; fp32
# sequence-major inputs, as HF's attention gives them): 10.0 / 12.0 / 16.1 query copies run as
# one chunk, 13.0 / 15.0 / 19.1 per element run in several (each chunk's fp32 gradients, then
# copied into the op's outputs, are three more); the forward, no longer holding one chunk's
# outputs through the next chunk's call, 8.0 / 10.1 / 14.2.
ATTENTION_WORKSPACE_COPIES: dict[str, tuple[int, int, int]] = {
    # schema name: (index of the query argument, fp32 query copies, fp32 score-tile copies)
    ATTENTION_SCHEMA_NAME: (0, 7, 2),
    ATTENTION_BACKWARD_SCHEMA_NAME: (1, 12, 2),
}


def attention_workspace_bytes(query: torch.Tensor, key_length: int, key_tile: int, chunk: int,
                              query_copies: int, tile_copies: int) -> int:
    """Scratch of an MX attention op on `query` (batch, ..., seq_q, head_dim; the dims between
    are heads) run `chunk` batch elements at a time (see ATTENTION_WORKSPACE_COPIES)."""
    dims = [max(1, concrete_int(size) or 1) for size in query.shape]
    batch, heads, seq_q, width = dims[0], math.prod(dims[1:-2]), dims[-2], dims[-1]
    tile = min(key_tile, max(1, key_length))
    per_element = FP32_BYTES * heads * seq_q * (query_copies * width + tile_copies * tile)
    return per_element * min(batch, chunk)


# Scratch of eager ATen CPU kernels, seen in torch.profiler's allocator events of the small GPT
# and Llama steps (eager lowering): a kernel given a Python number (mul(x, 0.5), ne(x, -100)) or
# dividing by a count (mean) wraps it in a 0-dim double tensor and may cast that to its own dtype
# while it runs (12 bytes measured; counted as two 8-byte scalars for every ATen op);
# the embedding backward (_unsafe_masked_index_put_accumulate) holds masked copies of its indices,
# mask and values beside its output; a sum of bools or integers first copies its input in the
# (wider) result dtype.
ATEN_NAMESPACES = ("aten", "prims")
WRAPPED_SCALARS_PER_OP = 2
WRAPPED_SCALAR_BYTES = 8  # a 0-dim double (or int64)
MASKED_INDEX_PUT_ACCUMULATE = "aten::_unsafe_masked_index_put_accumulate"
SUM_SCHEMA_NAME = "aten::sum"


def aten_scratch_bytes(node: fx.Node) -> int:
    """Scratch bytes an eager ATen kernel holds while it runs, beyond its output (see above);
    0 for any other op."""
    name = _schema_name(node)
    if name.split("::")[0] not in ATEN_NAMESPACES or is_alias(node):
        return 0
    scratch = WRAPPED_SCALARS_PER_OP * WRAPPED_SCALAR_BYTES
    if name == MASKED_INDEX_PUT_ACCUMULATE:  # (self, mask, indices, values)
        scratch += sum(value_bytes(_val(arg)) for arg in (node.args[1], *node.args[2], node.args[3]))
    elif name == SUM_SCHEMA_NAME:
        source, result = _val(node.args[0]), _val(node)
        if source is not None and result is not None and source.dtype != result.dtype:
            scratch += _numel(node.args[0]) * result.element_size()
    return scratch


def _numel(arg: Any) -> int:
    value = _val(arg)
    return 0 if value is None else value_bytes(value) // value.element_size()


# Scratch of the FP4 ops' torch references beyond their outputs, measured with
# `measure.memory.tensor_peak_bytes` (2026-12-07) on fp32 inputs of (64, 256), (256, 1024),
# (1024, 1024) and (100, 512), NVFP4 and MXFP4, along each axis: quantize_fp4 51.6-51.7 bytes per
# input element (round to nearest, 1-D blocks), 55.6-55.7 with one of 2-D blocks, stochastic
# rounding or the Hadamard transform, 59.6-59.7 with stochastic rounding and the transform;
# dequantize_fp4 9.0 bytes per element it writes (at every shape). Rounded up, per option:
QUANTIZE_FP4_SCRATCH_BYTES_PER_ELEMENT = 52
QUANTIZE_FP4_OPTION_SCRATCH_BYTES_PER_ELEMENT = 4  # each of block_2d, stochastic, the transform
DEQUANTIZE_FP4_SCRATCH_BYTES_PER_ELEMENT = 9
# Small tensors the FP4 GEMM holds in every phase (0-d scales and products, ATen's scalars): its
# measured peak was 68 bytes above the large tensors of `fp4_gemm_peak_bytes` at every shape.
FP4_GEMM_SCALAR_BYTES = 68


def quantize_fp4_scratch_bytes(numel: int, *, block_2d: bool, stochastic: bool, rht: bool) -> int:
    """Scratch bytes ``mxcompile::quantize_fp4``'s reference holds for an input of ``numel``
    elements with these options (see the measurements above)."""
    options = sum((block_2d, stochastic, rht))
    return numel * (QUANTIZE_FP4_SCRATCH_BYTES_PER_ELEMENT + options * QUANTIZE_FP4_OPTION_SCRATCH_BYTES_PER_ELEMENT)


def fp4_gemm_peak_bytes(a_numel: int, b_numel: int, out_numel: int, out_dtype: torch.dtype) -> int:
    """Peak bytes an FP4 GEMM of operands of ``a_numel`` and ``b_numel`` (unpacked) elements
    allocates while it runs, its output included: the op's reference (and the lowering's
    dequantize / fake-quantize and fp32 GEMM, `lowering.lower_fp4_gemms`) takes A's fp32 block
    values (`dequantize_fp4`, with its scratch), then B's while A's are held, then their fp32
    product and the product times the tensor scales, cast to ``out_dtype`` if that is not fp32.
    The peak is the largest phase plus ``FP4_GEMM_SCALAR_BYTES``: the op's measured peak
    exactly (at (M, K, N) = (64, 256, 1024), (256, 1024, 64), (128, 64, 128), (512, 512, 512); fp32 and
    bf16 outputs)."""
    operand_bytes = FP4_GEMM_OPERAND_DTYPE.itemsize
    dequantize = operand_bytes + DEQUANTIZE_FP4_SCRATCH_BYTES_PER_ELEMENT
    cast = out_numel * out_dtype.itemsize if out_dtype != FP4_GEMM_OPERAND_DTYPE else 0
    return FP4_GEMM_SCALAR_BYTES + max(
        dequantize * a_numel,
        operand_bytes * a_numel + dequantize * b_numel,
        operand_bytes * (a_numel + b_numel + 2 * out_numel) + cast,
    )


def _unpacked_numel(arg: Any) -> int:
    """Elements of the FP4 operand whose packed bytes (two E2M1 codes per byte) ``arg`` holds."""
    return _numel(arg) * E2M1.elements_per_byte


def workspace_bytes(node: fx.Node) -> int:
    """Scratch bytes ``node`` holds while it runs, beyond its output (see the conventions)."""
    name = _schema_name(node)
    if name == MX_MM_FP4_SCHEMA_NAME:
        if fp4_gemm_runs_packed(node):  # the Triton kernel allocates only its output
            return 0
        a, b = _fp4_gemm_operands(node)
        peak = fp4_gemm_peak_bytes(_unpacked_numel(a), _unpacked_numel(b), _numel(node),
                                   _schema_argument(node, "out_dtype"))
        return max(0, peak - node_bytes(node))
    if name == QUANTIZE_FP4_SCHEMA_NAME:
        return quantize_fp4_scratch_bytes(
            _numel(node.args[0]), block_2d=bool(_schema_argument(node, "block_2d")),
            stochastic=bool(_schema_argument(node, "stochastic")), rht=_schema_argument(node, "rht_seed") is not None)
    if name == MX_MM_SCHEMA_NAME:
        out_dtype = node.args[5] if len(node.args) > 5 else node.kwargs.get("out_dtype", torch.float32)
        peak = mx_mm_peak_bytes(*(_numel(node.args[i]) for i in range(4)), _numel(node), out_dtype,
                                value_device(node))
        return max(0, peak - node_bytes(node))
    if name == QUANTIZE_SCHEMA_NAME:
        return quantize_scratch_bytes(_numel(node.args[0]))
    if name in ATTENTION_WORKSPACE_COPIES:
        return attention_workspace_for_chunk(node, attention_batch_chunk(node))
    return aten_scratch_bytes(node)


def _attention_query_key(node: fx.Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    name = _schema_name(node)
    if name not in ATTENTION_WORKSPACE_COPIES:
        return None
    index = ATTENTION_WORKSPACE_COPIES[name][0]
    query, key = _val(node.args[index]), _val(node.args[index + 1])
    if query is None or key is None or query.ndim < 3:
        return None
    return query, key


def attention_query(node: fx.Node) -> torch.Tensor | None:
    """The query value of an MX attention op's node (forward or backward), else None."""
    operands = _attention_query_key(node)
    return None if operands is None else operands[0]


def attention_batch_chunk(node: fx.Node) -> int:
    """The `batch_chunk` argument of an MX attention op's node."""
    return int(_schema_argument(node, "batch_chunk"))


def attention_workspace_for_chunk(node: fx.Node, chunk: int) -> int:
    """Scratch of an MX attention op's node were it run `chunk` batch elements per call (0 for
    any other node): :func:`attention_workspace_bytes` with the op's copies."""
    operands = _attention_query_key(node)
    if operands is None:
        return 0
    query, key = operands
    _, query_copies, tile_copies = ATTENTION_WORKSPACE_COPIES[_schema_name(node)]
    return attention_workspace_bytes(query, concrete_int(key.shape[-2]) or 1, _schema_argument(node, "key_tile"),
                                     chunk, query_copies, tile_copies)


def _schema_argument(node: fx.Node, name: str) -> Any:
    """The value of the op argument `name` of an OpOverload node: given positionally, by
    keyword, or the schema's default."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, argument.default_value)
    raise KeyError(f"{node.target} has no argument {name!r}")


def _is_mx_mm(node: fx.Node) -> bool:
    return _schema_name(node) == MX_MM_SCHEMA_NAME


def _is_fp4_mm(node: fx.Node) -> bool:
    return _schema_name(node) == MX_MM_FP4_SCHEMA_NAME


def _fp4_gemm_operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The packed data of an ``mxcompile::mx_mm_fp4`` node: (a, a_scale, a_tensor_scale, b, ...)."""
    return node.args[0], node.args[3]


def runs_dequantized_kernel(node: fx.Node) -> bool:
    """Whether the config gave an MX or FP4 GEMM node gemm_kernel "dequantized" (its
    `GEMM_KERNEL_KEY` record): a CUDA graph then runs it as a GEMM of its dequantized operands
    (bf16 for MXFP8, fp32 block values for FP4), not as the Triton kernel."""
    from ..config import GemmKernel  # config imports the planner, which imports this module

    return node.meta.get(GEMM_KERNEL_KEY) == GemmKernel.DEQUANTIZED


def fp4_gemm_runs_packed(node: fx.Node) -> bool:
    """Whether an ``mxcompile::mx_mm_fp4`` node runs on its packed operands, as the Triton FP4
    GEMM: in a CUDA graph, with a 2-D B (`ops.mx_mm.mx_mm_fp4_cuda` runs the torch reference
    otherwise), under gemm_kernel "auto" (on every GPU) or "triton"; under "dequantized" the
    lowering runs the fp32 GEMM of its block values (`runs_dequantized_kernel`)."""
    if not _is_fp4_mm(node) or value_device(node).type != "cuda" or runs_dequantized_kernel(node):
        return False
    b = _val(_fp4_gemm_operands(node)[1])
    return b is not None and b.ndim == 2


def _val(arg: Any) -> torch.Tensor | None:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _dims(t: torch.Tensor) -> list[int]:
    return [concrete_int(s) or 0 for s in t.shape]


def _gemm_operands(node: fx.Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    if node.op != "call_function":
        return None
    if node.target in (_aten.mm.default, _aten.bmm.default):
        a, b = _val(node.args[0]), _val(node.args[1])
    elif node.target is _aten.addmm.default:
        a, b = _val(node.args[1]), _val(node.args[2])
    elif _is_mx_mm(node):
        a, b = _val(node.args[0]), _val(node.args[2])  # (a, a_scale, b, b_scale, ...)
    elif _is_fp4_mm(node):
        a, b = (_val(arg) for arg in _fp4_gemm_operands(node))
    else:
        return None
    if a is None or b is None:
        return None
    return a, b


def attention_flops(batch: int, heads: int, q_len: int, k_len: int, qk_width: int, v_width: int, *,
                    backward: bool = False) -> int:
    """FLOPs of the MX attention op's GEMMs (a causal mask is not subtracted: the CPU
    implementation computes every key tile): per head ``2 * q_len * k_len * width`` for each
    of its ``ATTENTION_FORWARD_GEMMS`` (forward) or ``ATTENTION_BACKWARD_GEMMS`` (backward)."""
    width = (qk_width + v_width) / 2
    gemms = ATTENTION_BACKWARD_GEMMS if backward else ATTENTION_FORWARD_GEMMS
    return int(FLOPS_PER_MULTIPLY_ADD * gemms * batch * heads * q_len * k_len * width)


def _schema_name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema.name if schema is not None else ""


def _attention_node_flops(node: fx.Node) -> int:
    backward = _schema_name(node) == ATTENTION_BACKWARD_SCHEMA_NAME
    offset = 1 if backward else 0  # the backward's first argument is grad_out
    q, k, v = (_val(node.args[offset + i]) for i in range(3))
    if q is None or k is None or v is None:
        return 0
    *lead, q_len, qk_width = _dims(q)
    k_len, v_width = _dims(k)[-2], _dims(v)[-1]
    batch_heads = 1
    for size in lead:
        batch_heads *= size
    return attention_flops(batch_heads, 1, q_len, k_len, qk_width, v_width, backward=backward)


def node_flops(node: fx.Node) -> int:
    """Floating-point operations of ``node``: exact ``2 * M * N * K`` (times the batch) for
    GEMMs (an FP4 GEMM's K is its packed operands' times two), :func:`attention_flops` for the
    MX attention ops, 0 for everything else (those are costed by bytes, see :func:`bytes_moved`)."""
    if _schema_name(node) in (ATTENTION_SCHEMA_NAME, ATTENTION_BACKWARD_SCHEMA_NAME):
        return _attention_node_flops(node)
    operands = _gemm_operands(node)
    if operands is None:
        return 0
    a, b = operands
    a_dims, b_dims = _dims(a), _dims(b)
    m, k = a_dims[-2], a_dims[-1]
    if _is_fp4_mm(node):
        k *= E2M1.elements_per_byte
    n = b_dims[-1]
    batch = 1
    for size in torch.broadcast_shapes(tuple(a_dims[:-2]), tuple(b_dims[:-2])):
        batch *= size
    return FLOPS_PER_MULTIPLY_ADD * batch * m * n * k


def _input_nodes(node: fx.Node) -> Iterable[fx.Node]:
    return node.all_input_nodes


def bytes_moved(node: fx.Node) -> int:
    """Bytes ``node`` reads and writes: its tensor inputs plus its output; 0 for aliases and
    for placeholders / outputs."""
    if node.op != "call_function" or is_alias(node):
        return 0
    return node_bytes(node) + sum(node_bytes(arg) for arg in _input_nodes(node))


def flops_dtype_key(node: fx.Node, profile: DeviceProfile) -> str:
    """The ``peak_flops`` key a GEMM node runs at: "fp8" for ``mxcompile::mx_mm`` (but one
    given gemm_kernel "dequantized", :func:`runs_dequantized_kernel`) and the MX attention ops
    on a device with FP8 GEMMs, else the dtype it multiplies in (an MX GEMM's dequantized
    operands, :func:`mxcompile.ops.gemm_operand_dtype`), falling back to the nearest rate the
    profile has, then "fp32". An FP4 GEMM on its packed operands (:func:`fp4_gemm_runs_packed`)
    runs at the profile's ``FP4_TENSOR_CORE_DTYPE_KEY`` rate where it has one, else at
    ``TRITON_FP4_GEMM_DTYPE_KEY``'s; otherwise at ``FP4_GEMM_DTYPE_KEY`` (fp32 block values)."""
    name = _schema_name(node)
    if name == MX_MM_FP4_SCHEMA_NAME:
        if not fp4_gemm_runs_packed(node):
            return FP4_GEMM_DTYPE_KEY
        return FP4_TENSOR_CORE_DTYPE_KEY if FP4_TENSOR_CORE_DTYPE_KEY in profile.peak_flops else TRITON_FP4_GEMM_DTYPE_KEY
    mx = ((_is_mx_mm(node) and not runs_dequantized_kernel(node))
          or name in (ATTENTION_SCHEMA_NAME, ATTENTION_BACKWARD_SCHEMA_NAME))
    if mx and profile.native_fp8_gemm:
        return MX_GEMM_DTYPE
    if _is_mx_mm(node):
        out_dtype = node.args[5] if len(node.args) > 5 else node.kwargs.get("out_dtype", torch.float32)
        dtype = gemm_operand_dtype(out_dtype, value_device(node))
    else:
        operands = _gemm_operands(node)
        value = _val(node.args[0]) if mx else (operands[0] if operands is not None else None)
        dtype = value.dtype if value is not None else torch.float32
    for key in _DTYPE_KEYS.get(dtype, ("fp32",)):
        if key in profile.peak_flops:
            return key
    return "fp32"


def node_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """Estimate of ``node``'s run time on ``profile``, in seconds: the roofline, and at least
    the op's measured rate where the profile has one (see the conventions)."""
    flops = node_flops(node)
    compute = flops / profile.flops(flops_dtype_key(node, profile)) if flops else 0.0
    memory = bytes_moved(node) / profile.memory_bandwidth
    name = _schema_name(node)
    measured = 0.0
    if name == QUANTIZE_SCHEMA_NAME and QUANTIZE_RATE in profile.op_rates:
        measured = _numel(node.args[0]) / profile.op_rates[QUANTIZE_RATE]
    elif name == QUANTIZE_FP4_SCHEMA_NAME and QUANTIZE_FP4_RATE in profile.op_rates:
        measured = _numel(node.args[0]) / profile.op_rates[QUANTIZE_FP4_RATE]
    elif name in (ATTENTION_SCHEMA_NAME, ATTENTION_BACKWARD_SCHEMA_NAME) and ATTENTION_RATE in profile.op_rates:
        measured = flops / profile.op_rates[ATTENTION_RATE] + attention_pass_time_s(node, profile)
    return max(compute, memory, measured) + fp4_dequantize_time_s(node, profile)


def fp4_dequantize_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """The time an ``mxcompile::mx_mm_fp4`` spends dequantizing its two operands to fp32 block
    values before its GEMM (wherever it does not run on its packed operands,
    :func:`fp4_gemm_runs_packed`): their elements at the profile's measured ``dequantize_fp4``
    rate, at least the bytes read and written over the memory bandwidth; 0 for any other node."""
    if not _is_fp4_mm(node) or fp4_gemm_runs_packed(node):
        return 0.0
    numel = sum(_unpacked_numel(arg) for arg in _fp4_gemm_operands(node))
    read = sum(node_bytes(arg) for arg in node.all_input_nodes)
    memory = (read + numel * FP4_GEMM_OPERAND_DTYPE.itemsize) / profile.memory_bandwidth
    rate = profile.op_rates.get(DEQUANTIZE_FP4_RATE)
    return max(memory, numel / rate if rate else 0.0)


def reference_dequantize_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """The time the torch reference of an ``mxcompile::mx_mm`` spends dequantizing its two
    operands, at the profile's measured ``dequantize`` rate; 0 for any other node or where the
    profile has no such rate (on CUDA the op runs as a Triton MX GEMM)."""
    rate = profile.op_rates.get(DEQUANTIZE_RATE)
    if not rate or not _is_mx_mm(node):
        return 0.0
    return (_numel(node.args[0]) + _numel(node.args[2])) / rate


def op_by_op_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """Estimate of ``node``'s run time as the eager lowering runs it: :func:`node_time_s`, and
    an ``mxcompile::mx_mm`` as its torch reference, which dequantizes both operands op by op
    before its GEMM (:func:`reference_dequantize_time_s`)."""
    return node_time_s(node, profile) + reference_dequantize_time_s(node, profile)


def op_by_op_run_time_s(nodes: list[fx.Node], profile: DeviceProfile) -> float:
    """Estimate of running ``nodes`` one op after another, as the eager lowering runs them: no
    fusion, each op at :func:`op_by_op_time_s`. The counterpart of :func:`fused_run_time_s`
    (Inductor)."""
    return sum(op_by_op_time_s(node, profile) for node in nodes)


def attention_passes(node: fx.Node, chunk: int | None = None) -> int:
    """Passes of an MX attention op's torch implementation: batch chunks times key tiles, with
    its own `batch_chunk` argument or `chunk`; 0 for any other node."""
    operands = _attention_query_key(node)
    if operands is None:
        return 0
    query, key = operands
    batch = concrete_int(query.shape[0]) or 1
    chunk = chunk if chunk is not None else attention_batch_chunk(node)
    key_length = concrete_int(key.shape[-2]) or 1
    return math.ceil(batch / max(1, chunk)) * math.ceil(key_length / max(1, _schema_argument(node, "key_tile")))


def attention_pass_time_s(node: fx.Node, profile: DeviceProfile, chunk: int | None = None) -> float:
    """The fixed time of an MX attention op's passes (:func:`attention_passes`) at the profile's
    measured pass rate; 0 where the profile has none (its attention runs as Triton kernels)."""
    rate = profile.op_rates.get(ATTENTION_PASS_RATE)
    return attention_passes(node, chunk) / rate if rate else 0.0


def is_pointwise(node: fx.Node) -> bool:
    """Whether ``node`` is an elementwise op (``torch.Tag.pointwise``), which Inductor fuses with
    its elementwise neighbours into one kernel."""
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def fused_into_reader(node: fx.Node) -> bool:
    """Whether Inductor never stores ``node``'s output: a pointwise op read by exactly one op, a
    pointwise one (no view between), which Inductor computes it inside (it inlines a pointwise
    producer into the kernel of its consumer). A producer read by several ops, through a view or
    by any other op (a GEMM, a reduction, a custom op, the graph's output) counts as stored: it
    may be, so the memory model stays an upper bound."""
    if not is_pointwise(node) or len(node.users) != 1:
        return False
    (reader,) = node.users
    return is_pointwise(reader)


def _fused_away(node: fx.Node, members: set[fx.Node], result: fx.Node) -> bool:
    """Whether a pointwise member's output stays inside a fused kernel: every member reading
    it (through views) is pointwise, and it is not the run's result."""
    if node is result:
        return False
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in members:
                continue
            if is_alias(user):
                stack.append(user)
            elif not is_pointwise(user):
                return False
    return True


def fused_run_time_s(nodes: list[fx.Node], profile: DeviceProfile) -> float:
    """Estimate of running ``nodes`` (in graph order, e.g. a recomputation's closure; the last
    is the result) as Inductor compiles them: chains of pointwise ops fuse into one kernel, so
    an output read only by pointwise members is never written to memory nor read back. A
    pointwise member then moves only the bytes it reads from outside its fused chain and, when
    its output leaves the chain, its output; every other node costs :func:`node_time_s`. (Each
    node priced alone counted a GELU's eight elementwise ops as eight passes over memory: a fifth
    of the 12-layer MLP's estimate at half its budget, 275 against 223 ms.)"""
    members = set(nodes)
    result = nodes[-1] if nodes else None
    fused = {node for node in nodes if is_pointwise(node) and _fused_away(node, members, result)}

    def produced_in_chain(arg: fx.Node) -> bool:
        while is_alias(arg) and arg in members and arg.args and isinstance(arg.args[0], fx.Node):
            arg = arg.args[0]
        return arg in fused

    total = 0.0
    for node in nodes:
        if not is_pointwise(node):
            total += node_time_s(node, profile)
            continue
        moved = sum(node_bytes(arg) for arg in set(node.all_input_nodes) if not produced_in_chain(arg))
        if node not in fused:
            moved += node_bytes(node)
        total += moved / profile.memory_bandwidth
    return total


def graph_time_s(graph: fx.Graph, profile: DeviceProfile) -> float:
    """Sum of :func:`node_time_s` over the graph's nodes (ops run one after another)."""
    return sum(node_time_s(node, profile) for node in graph.nodes)


# --------------------------------------------------------------------------- saved quantized operands

BF16_BYTES = 2  # what a bf16 step would save per element
# The quantize ops' format argument: MXFP8's element format ("e4m3"), FP4's block format ("nvfp4").
QUANTIZE_FORMAT_ARGUMENTS: dict[str, str] = {QUANTIZE_SCHEMA_NAME: "elem", QUANTIZE_FP4_SCHEMA_NAME: "block_format"}
_PAD = _aten.constant_pad_nd.default
QUANTIZED_DATA_OUTPUT = 0  # a quantize op's outputs: (data, scales) or, FP4, (data, scales, tensor scale)


def _producing_quantize(node: fx.Node) -> fx.Node | None:
    """The MX or FP4 quantize node ``node`` is an output of (``getitem``), else None."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    producer = node.args[0]
    return producer if _schema_name(producer) in QUANTIZE_FORMAT_ARGUMENTS else None


def saved_quantized_operands(saved: Iterable[fx.Node]) -> list[dict[str, Any]]:
    """The quantized operands among ``saved`` (a forward graph's saved values): one row per
    quantize node with an output saved, in order of first appearance, with its ``format`` (the
    op's format argument), the ``source`` operand it quantized (before the zero padding to the
    block a GEMM's contraction may add, whose ``shape`` it gives), the ``outputs`` saved (data,
    scales and, for NVFP4, the tensor scale), their ``bytes``, the ``bf16_bytes`` the source
    takes in bf16 (0 when the data is not saved, e.g. recomputed by a memory plan, while its
    scales are), and ``to_bf16``, their ratio. Packed FP4 data takes half a byte per element,
    so an NVFP4 operand (a scale byte per 16 elements, 4 bytes of tensor scale) takes
    9/32 = 0.281x its bf16 bytes and an MXFP4 one (a scale byte per 32) 17/64 = 0.266x, plus
    what padding adds along the contraction."""
    rows: dict[fx.Node, dict[str, Any]] = {}
    for node in saved:
        quantize = _producing_quantize(node) if isinstance(node, fx.Node) else None
        if quantize is None:
            continue
        if quantize not in rows:
            source = quantize.args[0]
            while isinstance(source, fx.Node) and source.target is _PAD:
                source = source.args[0]
            value = _val(source)
            rows[quantize] = {"quantize": quantize.name,
                              "format": str(_schema_argument(quantize, QUANTIZE_FORMAT_ARGUMENTS[_schema_name(quantize)])),
                              "source": source.name if isinstance(source, fx.Node) else "",
                              "shape": [] if value is None else _dims(value),
                              "outputs": [], "bytes": 0, "bf16_bytes": 0}
        row = rows[quantize]
        if node.name not in row["outputs"]:
            row["outputs"].append(node.name)
            row["bytes"] += node_bytes(node)
            if node.args[1] == QUANTIZED_DATA_OUTPUT:
                row["bf16_bytes"] = math.prod(row["shape"]) * BF16_BYTES
    for row in rows.values():
        row["to_bf16"] = row["bytes"] / row["bf16_bytes"] if row["bf16_bytes"] else None
    return list(rows.values())
