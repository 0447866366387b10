"""Lowering of rewritten forward / backward / inference graphs.

Every MX GEMM that does not run a Triton GEMM kernel (`runs_triton_mx_gemm`: all of them on
CPU) becomes a high-precision GEMM of its exactly dequantized operands (`lower_mx_gemms`; the
FP4 GEMMs: `lower_fp4_gemms`). On CPU the quantize ops (`mxcompile.ops.CPU_KERNEL_OPS`) then
stay opaque: Inductor runs them as fallback kernels, whose CPU kernels are native
(`mxcompile.ops.native`, built once per machine) or else compiled graphs shared by every shape
(`mxcompile.ops.cpu_kernels`), so Inductor does not generate and compile a quantize loop body
per GEMM operand. On CUDA the ops whose CUDA kernel is a Triton one
(`mxcompile.ops.CUDA_KERNEL_OPS`) stay opaque, and the others are decomposed into their
Inductor forms, which Inductor fuses into its Triton kernels. The FP4 ops have no Inductor
form and stay opaque on every device (on CUDA, `mx_mm_fp4`'s kernel is the Triton FP4 GEMM).
The graph then goes to Inductor's inner compiler.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters, dynamo_timed
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.replace_random import replace_random_passes
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .ops import CPU_KERNEL_OPS, CUDA_KERNEL_OPS, DECOMPOSITIONS
from .ops.mx_mm import MX_MM, MX_MM_FP4, gemm_operand_dtype
from .config import GemmKernel
from .numerics.fp4_operand import fp4_gemm
from .ops.quantize import (
    DEQUANTIZE,
    DEQUANTIZE_FP4,
    FAKE_QUANTIZE,
    FAKE_QUANTIZE_FP4,
    QUANTIZE,
    QUANTIZE_FP4,
    dequantize_for_inductor,
    fake_quantize_with_casts,
    quantize_with_casts,
)
from .graph_meta import value_device
from .passes.meta_keys import GEMM_KERNEL_KEY, PLANNED_GRAPH_KEY, PLAN_PLACED_KEY
from .triton_templates import has_mx_tensor_cores

MX_OPS = frozenset(DECOMPOSITIONS)
_log = logging.getLogger("mxcompile")

# Inductor recomputes a pointwise producer inside every consumer unless it counts as heavy. An
# MX operand is read four times (amax and apply along each of two axes), so a GELU (erf, which
# Inductor's CPU heuristic does not count as heavy) was recomputed four times per element
# (measured on CPU when the quantization was inlined there; CUDA graphs still inline it).
# Pointwise nodes with more ops than this, read more than once, are stored instead. Plain
# casts and views stay fused.
REALIZE_OPCOUNT_THRESHOLD = 50
# Key of torch._dynamo.utils.compilation_time_metrics for the decomposition (see backend.py).
DECOMPOSE_TIMER = "mxcompile.decompose_mx_ops"
# node.meta key the lowering sets on every node of a planned graph it hands to Inductor: the
# node's position in the planned order (see `PinRecomputation`).
PLANNED_POSITION_KEY = "mxcompile_planned_position"


def _matmul(a, b, out_dtype):
    return torch.matmul(a, b).to(out_dtype)


def _fp4_matmul(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor, b_decode: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The FP4 GEMM on block values (`numerics.fp4_operand.fp4_gemm`)."""
    return fp4_gemm(a, a_decode, b, b_decode, out_dtype)



# Multiplying by one is exact (every float, signed zeros, infinities; NaNs stay NaNs).
EXACT_IDENTITY_FACTOR = 1.0


def _product_not_fused_with_bias(product: torch.Tensor) -> torch.Tensor:
    """``product`` unchanged, in a form Inductor's post-grad pattern ``add(mm(a, b), bias) ->
    addmm(bias, a, b)`` does not match.

    That pattern fires only when the GEMM's output has no other user, and addmm rounds
    differently (the bias enters the GEMM's accumulation): 1.57M of 4.19M elements of
    ``gelu(x @ w + b)`` (4096x1024, fp32) differed when the forward stopped saving ``x @ w``.
    So a memory plan that recomputes a GEMM output (the forward no longer saves it) changed
    the forward's values, and the gradients by up to 3.4e-3 (relative) on a 12-layer MLP.
    The multiplication fuses into the add's kernel (no extra pass over memory); it is applied
    only where the GEMM feeds an add alone (:func:`_only_feeds_an_add`), where that holds."""
    return product * EXACT_IDENTITY_FACTOR


def _only_feeds_an_add(node: fx.Node) -> bool:
    """Whether ``node``'s only user, through same-value dtype casts, is an ``aten.add``: the
    case in which Inductor's addmm pattern can fuse them."""
    while len(node.users) == 1:
        (node,) = node.users
        if node.target is torch.ops.aten.add.Tensor:
            return True
        if node.target is not torch.ops.prims.convert_element_type.default:
            return False
    return False


# The functions lower_mx_gemms puts in graphs; decompose_mx_ops traces them into aten ops.
_LOWERING_HELPERS = (fake_quantize_with_casts, quantize_with_casts,
                     dequantize_for_inductor, _matmul, _product_not_fused_with_bias, _fp4_matmul)


def _producing_quantize(data: fx.Node, scale: fx.Node) -> fx.Node | None:
    """The mxcompile::quantize node whose (data, scale) outputs these are, if in this graph."""
    if not all(isinstance(n, fx.Node) and n.target is operator.getitem for n in (data, scale)):
        return None
    producer = data.args[0]
    if producer is scale.args[0] and producer.target is QUANTIZE and (data.args[1], scale.args[1]) == (0, 1):
        return producer
    return None


def runs_triton_mx_gemm(kernel: GemmKernel, device: torch.device, *, fp4: bool = False) -> bool:
    """Whether a compiled graph on `device` runs its MX GEMMs (`fp4`: its FP4 GEMMs,
    `mxcompile::mx_mm_fp4`) with the Triton GEMM kernel, the op's CUDA kernel; else with a GEMM
    of the exactly dequantized operands (`lower_mx_gemms`, `lower_fp4_gemms`). Both are exact.

    CPU graphs never do (no Triton: Inductor's CPU code). On CUDA, "auto" takes the form that
    issues fewer instructions per product, compiled ahead of time without a GPU (a static
    proxy; `benchmarks/gpu_session.sh` times both forms on a GPU):
      * MXFP8: the Triton MX GEMM where the GPU has MX tensor cores (sm100+: block-scaled
        `tcgen05.mma`); below them cuBLAS on operands dequantized exactly to bf16. On sm90 the
        Triton kernel's loop there (expand_bf16) issues 0.52x the instructions per product of
        Triton's tl.dot_scaled upcast but 4.9x a bf16 `tl.dot` GEMM's with the same tiles
        (`gemm_comparison` in benchmarks/results/kernel_static.json, 2026-12-07), and on an H200
        a training step with the Triton MX GEMM (then tl.dot_scaled) ran 5.37x bf16 against
        1.27x dequantized (2026-12-04, docs/benchmarks.md).
      * FP4: the Triton FP4 GEMM on every GPU: sm100+ multiplies E2M1 on block-scaled
        `tcgen05.mma`, below it the expand_bf16 loop on bf16 tensor cores (wgmma on sm90). The
        dequantized form is an fp32 GEMM (`mx_mm_fp4_reference`: a bf16 product would be
        rounded before the tensor scales apply), off the tensor cores with TF32 off (torch's
        default): at least one FFMA per 32 products per warp, 0.031 instructions per product,
        against expand_bf16's 0.0037 (MXFP4) and 0.0043 (NVFP4) compiled for sm90
        (docs/fp4.md, 2026-12-07)."""
    if torch.device(device).type != "cuda":
        return False
    if kernel is GemmKernel.AUTO:
        return fp4 or has_mx_tensor_cores(device)
    return kernel is GemmKernel.TRITON


def _runs_dequantized(node: fx.Node) -> bool:
    """For an mx_mm or mx_mm_fp4 node, or a quantize node of an MX GEMM: not the Triton kernels."""
    device = value_device(node.args[0])  # an input's: a quantize node's value is a tuple
    kernel = node.meta.get(GEMM_KERNEL_KEY, GemmKernel.AUTO)
    return not runs_triton_mx_gemm(kernel, device, fp4=node.target is MX_MM_FP4)


def lower_cuda_quantizes(gm: fx.GraphModule) -> int:
    """Point each mxcompile::quantize node of a CUDA graph whose MX GEMM runs dequantized
    (`runs_triton_mx_gemm`) at `quantize_with_casts`, for Inductor to fuse into its kernels
    instead of calling the Triton quantize kernel through the op (whose Python dispatch costs
    ~200 us of host time per call on an H200 host, more than the kernel's ~67 us). These are the
    quantizations the forward keeps for the backward (the GEMMs' own operands are
    fake-quantized by `lower_mx_gemms`). Returns the count."""
    count = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is QUANTIZE and value_device(node.args[0]).type == "cuda"
                and GEMM_KERNEL_KEY in node.meta and _runs_dequantized(node)):
            node.target = quantize_with_casts
            count += 1
    if count:
        gm.recompile()
    return count


def _operand(gm: fx.GraphModule, device: torch.device, args: tuple, cuda_form: Callable,
             cpu_op: torch._ops.OpOverload) -> fx.Node:
    """A node computing one dequantized GEMM operand: on CUDA the Inductor form `cuda_form`,
    which `decompose_mx_ops` traces and Inductor fuses into its kernels; on CPU the op
    `cpu_op`, which stays opaque (its CPU kernels: `ops.native`, else `ops.cpu_kernels`), with
    its fake value where its inputs have theirs."""
    if device.type == "cuda":
        return gm.graph.call_function(cuda_form, args)
    node = gm.graph.call_function(cpu_op, args)
    if all("val" in n.meta for n in node.all_input_nodes):  # a traced graph (fx.symbolic_trace has none)
        node.meta["val"] = cpu_op(*fx.node.map_arg(args, lambda n: n.meta["val"]))
    return node


def _replace_gemm(gm: fx.GraphModule, node: fx.Node, product: fx.Node) -> None:
    """`product` (the lowered GEMM) in place of the MX GEMM `node`, with its fake value: a GEMM
    this product feeds directly is lowered next and reads its operand's value."""
    if "val" in node.meta:
        product.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(product)
    gm.graph.erase_node(node)


def _producing_fp4_quantize(data: fx.Node, scale: fx.Node, tensor_scale: fx.Node) -> fx.Node | None:
    """The mxcompile::quantize_fp4 node whose three outputs these are, if in this graph."""
    outputs = (data, scale, tensor_scale)
    if not all(isinstance(n, fx.Node) and n.target is operator.getitem for n in outputs):
        return None
    producer = data.args[0]
    if producer.target is QUANTIZE_FP4 and all(n.args == (producer, i) for i, n in enumerate(outputs)):
        return producer
    return None


def lower_fp4_gemms(gm: fx.GraphModule) -> int:
    """Rewrite each mxcompile::mx_mm_fp4 that runs dequantized (`runs_triton_mx_gemm`: all of
    them on CPU; on CUDA only those whose node records gemm_kernel "dequantized": the others
    stay, their CUDA kernel the Triton FP4 GEMM) into the FP4 GEMM of their operands' block
    values: an operand quantized in this graph is fake-quantized from its source
    (`mxcompile::fake_quantize_fp4`: the same draws, transform and rounding, no packing), one
    that arrives packed (saved by the forward) is dequantized (`mxcompile::dequantize_fp4`).
    The ops stay opaque. Returns the count."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not MX_MM_FP4 or not _runs_dequantized(node):
            continue
        a, a_scale, a_decode, b, b_scale, b_decode, block_format, out_dtype = node.args
        with gm.graph.inserting_before(node):
            operands = []
            for data, scale, decode, axis in ((a, a_scale, a_decode, -1), (b, b_scale, b_decode, -2)):
                producer = _producing_fp4_quantize(data, scale, decode)
                if producer is not None:
                    args = (*producer.args, torch.float32)
                    fake = gm.graph.call_function(FAKE_QUANTIZE_FP4, args)
                    values = gm.graph.call_function(operator.getitem, (fake, 0))
                    decode = gm.graph.call_function(operator.getitem, (fake, 1))
                    if "val" in producer.meta:
                        fake.meta["val"] = FAKE_QUANTIZE_FP4(*fx.node.map_arg(args, lambda n: n.meta["val"]))
                        values.meta["val"], decode.meta["val"] = fake.meta["val"]
                else:
                    args = (data, scale, axis % data.meta["val"].ndim, block_format, torch.float32)
                    values = gm.graph.call_function(DEQUANTIZE_FP4, args)
                    if "val" in data.meta:
                        values.meta["val"] = DEQUANTIZE_FP4(*fx.node.map_arg(args, lambda n: n.meta["val"]))
                operands += [values, decode]
            product = gm.graph.call_function(_fp4_matmul, (*operands, out_dtype))
        _replace_gemm(gm, node, product)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def lower_mx_gemms(gm: fx.GraphModule) -> int:
    """Rewrite each mxcompile::mx_mm that runs dequantized (`runs_triton_mx_gemm`: all of them
    on CPU) into a high-precision matmul of its dequantized operands.

    An operand quantized in this same graph is fake-quantized straight from its high-precision
    source (bit-identical values, no fp8 round trip: on CPU by `mxcompile::fake_quantize`, in
    fp32 arithmetic, `numerics.rounding`; on CUDA with the fp8 cast, `fake_quantize_with_casts`);
    an operand that arrives as fp8 (saved by the forward for the backward) is dequantized.
    Returns the count."""
    count = 0
    cuda_kernels: list[str] = []  # the gemm_kernel setting of each one lowered in a CUDA graph
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not MX_MM or not _runs_dequantized(node):
            continue
        if value_device(node).type == "cuda":
            cuda_kernels.append(node.meta.get(GEMM_KERNEL_KEY, GemmKernel.AUTO).value)
        a, a_scale, b, b_scale, block_size, out_dtype = node.args
        device = value_device(node)
        operand_dtype = gemm_operand_dtype(out_dtype, device)
        with gm.graph.inserting_before(node):
            operands = []
            for data, scale, axis in ((a, a_scale, -1), (b, b_scale, -2)):
                producer = _producing_quantize(data, scale)
                if producer is not None:
                    args = (*producer.args, operand_dtype)
                    operands.append(_operand(gm, device, args, fake_quantize_with_casts, FAKE_QUANTIZE))
                else:
                    args = (data, scale, axis % data.meta["val"].ndim, block_size, operand_dtype)
                    operands.append(_operand(gm, device, args, dequantize_for_inductor, DEQUANTIZE))
            product = gm.graph.call_function(_matmul, (*operands, out_dtype))
            if _only_feeds_an_add(node):  # with more users the GEMM's output is stored: no addmm fusion
                product = gm.graph.call_function(_product_not_fused_with_bias, (product,))
        _replace_gemm(gm, node, product)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    if cuda_kernels:
        _log.info("mxcompile: %d MX GEMM(s) of a CUDA graph run as cuBLAS GEMMs of their exactly dequantized "
                  "operands (gemm_kernel %s; 'auto' takes the Triton MX GEMM only on GPUs with MX tensor "
                  "cores, sm100+)", len(cuda_kernels), sorted(set(cuda_kernels)))
    return count


def has_mx_ops(gm: fx.GraphModule, ops: frozenset = MX_OPS) -> bool:
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


def _needs_decomposition(node: fx.Node, table: dict) -> bool:
    """Whether Inductor needs this node in other ops: an op of the decomposition table, a
    CompositeImplicitAutograd op (a pass may insert aten.reshape), or a lowering helper."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target in table or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), "CompositeImplicitAutograd")
    return target in _LOWERING_HELPERS


def _signature(value: Any) -> Any:
    """A hashable description of one traced input or constant argument (trace-cache key)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, tuple(map(str, value.shape)),
                tuple(map(str, value.stride())), value.storage_offset())
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", type(value).__name__, str(value))
    return ("const", type(value).__name__, repr(value))


@dataclass(frozen=True)
class _Input:
    """Stands for the index-th input node of a node being traced alone."""

    index: int


def _own_values(values: Any, fake_mode: Any) -> Any:
    """`values` with each tensor replaced by an alias of it: a new tensor object with the same
    sizes, strides and storage offset.

    make_fx binds a traced function's inputs to its placeholders by tensor identity, so two
    inputs that are one tensor object are both traced as the last one bound. Two graph nodes
    can carry one fake value object: every splice of a reused trace copies the trace's own
    values (fx `node_copy` copies meta), and the memory plan shares a value between a saved
    node and its reload. Then a trace that reads both nodes read only one of them: on a fused
    qkv + rotary + SDPA block, the backward's `cat([dq, dk, dv])` was traced as
    `cat([dk, dk, dv])`, and the query rows of the qkv weight's gradient were silently
    replaced by the key rows' (issue 35)."""
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return pytree.tree_map_only(torch.Tensor, torch.ops.aten.alias.default, values)


class _NodeDecomposer:
    """Replaces single nodes of `gm` by their traces under `table`: each node's function is
    traced alone (make_fx, on its inputs' fake values) and the trace spliced in its place.
    Traces are reused between nodes with the same target and input signature (repeated layers).
    Every traced input and every spliced node has a fake value object of its own
    (`_own_values`)."""

    def __init__(self, gm: fx.GraphModule, table: dict, fake_mode: Any):
        self.gm, self.table, self.fake_mode = gm, table, fake_mode
        self.traces: dict[Any, fx.GraphModule] = {}
        self.constants = 0

    def _trace(self, node: fx.Node, inputs: list[fx.Node]) -> fx.GraphModule:
        values = _own_values([n.meta["val"] for n in inputs], self.fake_mode)
        position = {n: _Input(i) for i, n in enumerate(inputs)}
        structure = fx.node.map_arg((node.args, node.kwargs), position.__getitem__)
        key = (node.target, tuple(_signature(v) for v in values),
               repr(fx.node.map_aggregate(structure, lambda v: v if isinstance(v, _Input) else _signature(v))))
        if key not in self.traces:
            target = node.target  # make_fx applies the table (a decomposition may decline)

            def run(*args: Any) -> Any:
                call_args, call_kwargs = fx.node.map_aggregate(
                    structure, lambda v: args[v.index] if isinstance(v, _Input) else v)
                return target(*call_args, **call_kwargs)

            trace = make_fx(run, decomposition_table=self.table, tracing_mode="real")
            with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext():
                self.traces[key] = trace(*values)
        return self.traces[key]

    def replace(self, node: fx.Node) -> None:
        inputs: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.append(n) if n not in inputs else None)
        trace = self._trace(node, inputs)
        graph = self.gm.graph
        placeholders = [n for n in trace.graph.nodes if n.op == "placeholder"]
        env: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
        result: Any = None
        with graph.inserting_before(node):
            for sub in trace.graph.nodes:
                if sub.op == "placeholder":
                    continue
                if sub.op == "output":
                    result = fx.node.map_arg(sub.args[0], env.__getitem__)
                elif sub.op == "get_attr":  # a constant the definition creates
                    name = f"_mx_decomposed_constant{self.constants}"
                    self.constants += 1
                    setattr(self.gm, name, getattr(trace, sub.target))
                    env[sub] = graph.get_attr(name)
                    env[sub].meta.update(sub.meta)
                else:
                    env[sub] = graph.node_copy(sub, env.__getitem__)
                    if "val" in sub.meta:  # not the trace's value object, shared by its other splices
                        env[sub].meta["val"] = _own_values(sub.meta["val"], self.fake_mode)
        if isinstance(result, (tuple, list)):  # a multi-output op: its users are getitems
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise RuntimeError(f"mxcompile lowering: {node.format_node()} is used by "
                                       f"{user.format_node()}, not by a getitem of one of its outputs")
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(result)
        graph.erase_node(node)


def decompose_mx_ops(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, opaque: frozenset = frozenset()
) -> fx.GraphModule:
    """Replace the mxcompile ops of `gm` by the aten ops of their definitions, in place; the ops
    in `opaque` stay as they are (on CUDA: those with a Triton CUDA kernel).

    Only the nodes that need it are traced (the MX ops, the helpers `lower_mx_gemms` inserts,
    and ops a pass inserted in a form Inductor does not take), one at a time, each spliced into
    the graph in place of its node: the rest of the graph, already in Inductor's form from
    AOTAutograd, is not traced again. Nodes need their fake values (meta["val"])."""
    lowered = lower_mx_gemms(gm)
    counters["mxcompile"]["dequantized_mx_gemms"] += lowered
    lowered += lower_fp4_gemms(gm)
    lowered += lower_cuda_quantizes(gm)
    if not lowered and not has_mx_ops(gm, MX_OPS - opaque):
        return gm
    table = {**select_decomp_table(), **{op: f for op, f in DECOMPOSITIONS.items() if op not in opaque}}
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:  # real inputs (a graph traced outside AOTAutograd): give it one fake mode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        FakeTensorProp(gm, fake_mode).propagate(*example_inputs)
    decomposer = _NodeDecomposer(gm, table, fake_mode)
    for node in [n for n in gm.graph.nodes if _needs_decomposition(n, table)]:
        decomposer.replace(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def use_inductor_random(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Replace aten random ops (`aten.rand` of dropout's decomposition, `randn`, `randint`) by
    Inductor's seeded random prims, as the default backend's joint-graph passes do before the
    partition; Inductor's lowering accepts no other form ("should have been handled in
    replace_random.py"). Per graph rather than on the joint graph: a random op is never
    recomputed in the backward (the partitioner and the memory planner ban it), so each draw
    lives in exactly one graph. Honours `torch._inductor.config.fallback_random`. Returns the
    count of replacements."""
    fake_mode = detect_fake_mode(example_inputs)
    with V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext():
        count = replace_random_passes(gm)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def mark_planned_order(gm: fx.GraphModule, recomputed: dict[fx.Node, bool]) -> int:
    """Give every call_function node of the planned graph ``gm`` its position in the graph's
    order (``PLANNED_POSITION_KEY``) and whether the plan placed it (``PLAN_PLACED_KEY``: it
    recomputes a tensor, or reloads an offloaded one).

    ``recomputed`` holds the flags of the nodes before `decompose_mx_ops`: a node spliced in
    since takes the flag of the nodes it replaced (those removed between its surviving
    neighbours); where they disagree it counts as recomputation, which only keeps it after the
    last node planned before it. Returns the number of nodes flagged as recomputation."""
    survivors = [n for n in gm.graph.nodes if n.op == "call_function"]
    alive = set(survivors)
    before = list(recomputed)
    index = {n: i for i, n in enumerate(before)}
    last = -1  # index in `before` of the last surviving original node seen
    pending: list[fx.Node] = []

    def settle(upto: int) -> None:
        removed = {recomputed[n] for n in before[last + 1:upto] if n not in alive}
        for node in pending:
            node.meta[PLAN_PLACED_KEY] = any(removed) if removed else False
        pending.clear()

    for position, node in enumerate(survivors):
        node.meta[PLANNED_POSITION_KEY] = position
        if node in index:
            settle(index[node])
            last = index[node]
            node.meta[PLAN_PLACED_KEY] = recomputed[node]
        else:
            pending.append(node)
    settle(len(before))
    return sum(bool(node.meta[PLAN_PLACED_KEY]) for node in survivors)


try:  # torch's interface for scheduler passes that the FX graph cache can key on
    from torch._inductor.custom_graph_pass import CustomSchedulerPass as _SchedulerPass
except ImportError:  # pragma: no cover - older torch: the pass is never installed
    _SchedulerPass = object  # type: ignore[assignment,misc]


class PinRecomputation(_SchedulerPass):  # type: ignore[misc,valid-type]
    """An Inductor scheduler pass (``_post_fusion_custom_pass``) for planned graphs: each
    kernel that recomputes (or reloads) a tensor for the memory plan gets an ordering-only dependency
    (a fake ``WeakDep``, which does not extend any buffer's life) on the latest kernel that the
    plan placed before the recomputation. Inductor's peak-memory reordering then still orders
    the rest of the graph, but can no longer hoist a recomputation earlier than planned (where
    it would hold the recomputed tensor, and whatever its closure keeps, across the nodes in
    between; Inductor's own estimate does not see the scratch of the opaque ops there).

    Positions and flags come from the FX nodes each kernel was lowered from (its ``origins``,
    marked by `mark_planned_order`). A dependency that would close a cycle through fusion is
    not added."""

    def __call__(self, nodes: list[Any]) -> list[Any]:
        pin_after_planned_anchors(nodes)
        return nodes

    def uuid(self) -> Any:
        import hashlib
        import inspect

        source = "".join(inspect.getsource(f) for f in (PinRecomputation, pin_after_planned_anchors, _add_ordering_dep,
                                                        _origin_positions, mark_planned_order))
        return hashlib.sha256(source.encode()).hexdigest()


def _origin_positions(snode: Any) -> tuple[list[int], list[int]]:
    """(positions of the plain, of the recomputing) planned FX nodes a scheduler node came from."""
    plain: list[int] = []
    recompute: list[int] = []
    for sub in snode.get_nodes():
        for origin in getattr(getattr(sub, "node", None), "origins", ()) or ():
            position = origin.meta.get(PLANNED_POSITION_KEY)
            if position is not None:
                (recompute if origin.meta.get(PLAN_PLACED_KEY) else plain).append(position)
    return plain, recompute


def _add_ordering_dep(snode: Any, dep: Any) -> None:
    """Add the ordering-only ``dep`` to the scheduler node ``snode``. A fused node does not take
    ``add_fake_dep`` (NotImplementedError in torch 2.13): its unmet dependencies are its own
    set (the union of its parts'), which the peak-memory reordering reads, so the dependency
    goes there and into its read set, as ``add_fake_dep`` does for the other kinds."""
    try:
        snode.add_fake_dep(dep)
    except NotImplementedError:
        snode.read_writes = snode.read_writes.with_read(dep)
        snode.unmet_dependencies.add(dep)


def pin_after_planned_anchors(nodes: list[Any]) -> int:
    """Add the ordering dependencies of `PinRecomputation` to the scheduler ``nodes``; returns
    how many were added."""
    from torch._inductor.dependencies import WeakDep

    anchors: list[tuple[int, Any]] = []  # (last planned position, node) of kernels that recompute nothing
    pinned: list[tuple[int, Any]] = []  # (first recomputing position, node)
    for snode in nodes:
        plain, recompute = _origin_positions(snode)
        if recompute:
            pinned.append((min(recompute), snode))
        elif plain and list(snode.get_buffer_names()):
            anchors.append((max(plain), snode))
    anchors.sort(key=lambda item: item[0])
    positions = [p for p, _ in anchors]
    added = 0
    for first, snode in pinned:
        at = bisect.bisect_left(positions, first) - 1
        if at < 0:
            continue
        anchor = anchors[at][1]
        own = {n.get_name() for n in snode.get_nodes()}
        if own & set(getattr(anchor, "ancestors", ())):  # the anchor already depends on this kernel
            continue
        buffer = next(iter(anchor.get_buffer_names()))
        _add_ordering_dep(snode, WeakDep(buffer, mutating_buf=next(iter(snode.get_buffer_names()), snode.get_name()),
                                         is_fake=True))
        added += 1
    counters["mxcompile"]["pinned_recomputations"] += added
    return added


def inductor_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """CUDA graphs keep the ops of CUDA_KERNEL_OPS opaque (their CUDA kernels run the Triton
    kernels), CPU graphs those of CPU_KERNEL_OPS (their CPU kernels are compiled graphs); the
    other MX ops are decomposed for Inductor."""
    from torch._inductor.compile_fx import compile_fx_inner

    opaque = CUDA_KERNEL_OPS if _on_cuda(example_inputs) else CPU_KERNEL_OPS
    # A graph whose memory was planned is reordered by Inductor for peak memory, as any graph
    # (issue 37: on a 12 x Linear(1024)+GELU MLP, 4096 rows, the planned order unreordered gave
    # a resident step peak of 260 MiB at budget 0.5, reordered 160 MiB; tiny GPT at 0.5, batch 4 /
    # 8 / 16: tensor peaks 11-18% lower reordered). Every node the plan placed (recomputation,
    # reload) stays after the node the plan put before it (`PinRecomputation`): before issue 37
    # Inductor, unpinned, moved recomputation earlier than planned (tiny GPT at 0.5: 5.36 MB
    # reordered against 4.76 MB not). On 2026-12-06's code pinned and unpinned orders measured
    # the same on the tiny GPT, and the pins cost 4 MiB of 209 on the MLP at 0.3: kept as a guard.
    # Planned graphs, and every CPU graph, free each buffer at its last use, as the plan's model
    # does: Inductor's buffer reuse keeps a dead buffer allocated until a later buffer of the
    # same size takes it over, and checks only against its own peak estimate, which does not see
    # the buffers and scratch of the opaque ops in between. On the small GPT at half the
    # activation budget a 2 MiB MLP gradient of one layer was held across the next attention
    # backward (32743432 B against a budget of 32424448 B). Without a budget on CPU, the
    # fake-quantized GEMM operands of the backward waited for their reuse across the attention
    # backward: tensor peaks of one step, reuse on / off, small Llama 72.9 / 62.6 MiB, small GPT
    # 69.7 / 65.6, 12-layer MLP 303.6 / 289.5; step time unchanged (paired medians over 21
    # rounds -2.5% to +2.5%, quartiles across zero; 2026-12-07). CUDA graphs without a plan keep
    # Inductor's default (not measured: no GPU).
    planned = bool(gm.meta.get(PLANNED_GRAPH_KEY))
    flags = {n: bool(n.meta.get(PLAN_PLACED_KEY)) for n in gm.graph.nodes if n.op == "call_function"}
    with dynamo_timed(DECOMPOSE_TIMER):
        gm = decompose_mx_ops(gm, example_inputs, opaque=opaque)
    use_inductor_random(gm, example_inputs)
    patches: dict[str, Any] = {"realize_opcount_threshold": REALIZE_OPCOUNT_THRESHOLD}
    if planned or not _on_cuda(example_inputs):
        patches["allow_buffer_reuse"] = False
    if planned:
        if mark_planned_order(gm, flags) and _SchedulerPass is not object:
            patches["_post_fusion_custom_pass"] = PinRecomputation()
    with inductor_config.patch(**patches):
        return compile_fx_inner(gm, example_inputs)


def eager_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Runs the rewritten graph op by op (for `explain` and debugging): no Inductor.

    The graph is generated with the boxed calling convention (it takes the argument list and
    clears it), so that, as in Inductor's code, each input is freed after its last use: the
    backward then releases saved activations as it goes, as the memory planner assumes."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
