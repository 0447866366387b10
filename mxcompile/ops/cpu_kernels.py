"""The CPU kernels of the quantize ops.

    mxcompile::quantize       `quantize_cpu`       (x -> fp8 data, uint8 scale bytes)
    mxcompile::dequantize     `dequantize_cpu`     (data, scale bytes -> dtype)
    mxcompile::fake_quantize  `fake_quantize_cpu`  (x -> dequantize(quantize(x)) as dtype)

Each runs, in this order of preference, with the same values:
  1. the native kernels (`ops.native`: C++ built once per machine, one pass over each block),
     for every operand size;
  2. where those are not built (no usable C++ compiler): the ops' Inductor forms compiled once
     with dynamic sizes, described below;
  3. otherwise the torch reference.

Each Inductor form runs one compiled graph per (element format, scale mode, block size, block layout,
dtypes): the op's Inductor form (`ops.quantize`, bit-identical to the numerics core) on a
contiguous view of the operand's blocks, with the block grid's sizes dynamic, so one graph
serves every shape. The graphs are saved under the Inductor cache directory and later
processes load them (`ops.precompiled`). An operand of COMPILE_MIN_NUMEL elements or more
compiles the graph it needs; one of COMPILED_MIN_NUMEL or more runs a graph already at hand;
the others run the torch reference: the same values.

Why the CPU lowering keeps these ops opaque rather than inlining their Inductor forms into each
graph: Inductor then generated and compiled a quantize loop body per GEMM operand, specialized
to its shape (the demo GPT's first step: 3.1x Inductor's cold compile time, 232 bodies of
about 100 nodes); with the compiled kernels each form is compiled once (issue 15). The
attention ops' CPU rounding (`attention_reference`) runs `compiled_rounding` too.

Block layouts (the operand made contiguous first, or taken in its own memory order if it is
the transpose of a contiguous tensor, e.g. a linear layer's weight as the GEMM sees it):
ROWS for blocks along the last axis, viewed (rows, length); COLUMNS for blocks along another
axis, viewed (outer, length, inner), inner the product of the sizes after the axis.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..numerics import ElemFormat, ScaleMode, dequantize_along, elem_format, fake_quantize_along, scales_shape
from ..numerics.quantize import check_quantizable
from ..numerics import scale_mode_named
from . import native
from .precompiled import Precompiled, source_key
from .quantize import (
    _in_memory_order,
    _quantize_arithmetic,
    dequantize_op,
    dequantize_reference,
    fake_quantize_op,
    fake_quantize_reference,
    in_layout_of,
    inductor_realized,
    quantize_op,
    quantize_reference,
)

# Compiled, a rounding is one fused loop (13-15x faster than the ~15 eager elementwise passes of
# the reference from 2**18 elements on the 2-core CPU, 2-3x at 2**12-2**16). Smaller operands
# stay eager (the values are the same either way). A lower bound speeds up the steps of toy
# models (the demo's tiny GPT in one process: 30.9 ms per step at 2**16, 17.9 ms at 2**12) but
# compiles more graphs first (the demo's whole run 40.6 s at 2**16, 54.1 s at 2**12, the test
# suite 11 -> 15 min): kept at 2**16, where real models' operands lie.
COMPILED_MIN_NUMEL = 1 << 16
# Compiling a graph costs about 3 s on a cold cache (2-core CPU) and saves about 0.5 ms per
# call of an operand of 2**16 elements: worth it for a long run, not for a short one. So only
# operands of COMPILE_MIN_NUMEL elements or more compile the graph they need; smaller ones
# (from COMPILED_MIN_NUMEL) run a graph that is at hand (compiled for a larger operand of the
# same kind, or saved by an earlier process) and the reference otherwise. The demo's tiny GPT
# (operands of at most 2**17 elements) compiled six graphs for a few logits-gradient and
# attention-tile operands: its first MX step took 29.7 s, 10.1-10.5 s without them
# (Inductor's: 6.2-7.0 s), its median step about the same (46-52 ms against 47 ms, noisy); the
# d512 benchmark models' operands all have 2**18 elements or more.
COMPILE_MIN_NUMEL = 1 << 18


class BlockLayout(enum.Enum):
    """Where the blocks of a compiled graph's input lie."""

    ROWS = "rows"  # (rows, length): blocks of consecutive elements along each row
    COLUMNS = "columns"  # (batch, length, width): blocks along the middle axis, in memory order


def runs_compiled(x: torch.Tensor) -> bool:
    """Whether the kernels run a compiled graph on `x`: a large CPU operand, outside any
    tracing (torch.compile cannot run under a Python dispatch mode, e.g. a FLOP counter or a
    memory recorder, nor be entered while Dynamo or FX traces)."""
    return (
        x.device.type == "cpu"
        and x.numel() >= COMPILED_MIN_NUMEL
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
        and not is_fx_symbolic_tracing()  # make_fx of real tensors: Dynamo refuses to compile inside it
    )


@functools.cache
def _source_key() -> str:
    """The source the graphs are traced from: the numerics core, the Inductor forms of the
    quantize ops and this module."""
    from .. import numerics

    here = Path(__file__).parent
    return source_key([*Path(numerics.__file__).parent.glob("*.py"), here / "quantize.py", Path(__file__)])


def _blocks(x: torch.Tensor, layout: BlockLayout, block_size: int) -> torch.Tensor:
    """The (rows, blocks, block_size) view of a ROWS operand, the (batch * blocks, block_size,
    width) view of a COLUMNS one; for scales (block_size 1): one entry per block."""
    if layout is BlockLayout.ROWS:
        return x.view(x.shape[0], x.shape[1] // block_size, block_size)
    return x.view(-1, block_size, x.shape[2])


# The blocked views' block axis and dynamic dims (the block grid's sizes) per layout. Not
# `dynamic=True`: that would make the block size symbolic too, and Inductor's loops over blocks
# of unknown length do not vectorize (7-10x slower).
_BLOCK_AXIS = {BlockLayout.ROWS: 2, BlockLayout.COLUMNS: 1}
_DYNAMIC_DIMS = {BlockLayout.ROWS: (0, 1), BlockLayout.COLUMNS: (0, 2)}


def _precompiled(fn: Callable[..., object], name: str, layout: BlockLayout, *params: object) -> Precompiled:
    key = repr((*params, layout.value, _source_key()))
    return Precompiled(fn, name=f"{name}-{layout.value}", key=key, dynamic_dims=_DYNAMIC_DIMS[layout],
                       globals_=globals())


def _run(compiled: Precompiled, *blocks: torch.Tensor):
    """compiled(*blocks), or None where the operand is too small to compile the graph and none
    is at hand (COMPILE_MIN_NUMEL)."""
    if blocks[0].numel() < COMPILE_MIN_NUMEL and not compiled.available(*blocks):
        return None
    # Grad mode and the input's dispatch keys are part of the graph's guards. The ops'
    # torch.library kernels run below ADInplaceOrView when called through the op and above it
    # when called directly (the attention forward's autograd backward): without one fixed
    # state Dynamo traced a second graph per input dtype in every process.
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        return compiled(*blocks)


@functools.cache
def compiled_rounding(
    fmt: ElemFormat, mode: ScaleMode, block_size: int, layout: BlockLayout, out_dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """`fake_quantize_along` compiled, without autograd, for a contiguous input in `layout`
    (the length a multiple of block_size), its result as `out_dtype`; None where the operand
    is too small to compile the graph and none is at hand (COMPILE_MIN_NUMEL).

    The compiled graph takes its input split into blocks and stores each block's scale once
    (`ops.quantize.inductor_realized`). Inductor then computes the scales in a vectorized loop
    over blocks rather than as a chain of scalar operations in every element vector of the
    block, and writes the blocked shape itself, where 2-D rows of dynamic length cost an extra
    copy (ROWS: 0.86 -> 0.36 ns per element at 2**21 elements, 2-core CPU)."""
    block_axis = _BLOCK_AXIS[layout]

    def blocks_rounded(blocks: torch.Tensor) -> torch.Tensor:
        rounded = fake_quantize_along(blocks, block_axis, fmt, mode, block_size, materialize=inductor_realized)
        return rounded.to(out_dtype)

    compiled = _precompiled(blocks_rounded, "rounding", layout, fmt.name, mode.value, block_size, str(out_dtype))

    def rounded(x: torch.Tensor) -> torch.Tensor | None:
        out = _run(compiled, _blocks(x, layout, block_size))
        return None if out is None else out.view(x.shape)

    return rounded


@functools.cache
def compiled_quantize(
    fmt: ElemFormat, mode: ScaleMode, block_size: int, layout: BlockLayout
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """`ops.quantize`'s Inductor form compiled for a contiguous input in `layout`: (fp8 data in
    the input's shape, uint8 scale bytes: (rows, blocks) for ROWS, (batch, blocks, width) for
    COLUMNS); None as for `compiled_rounding`."""
    block_axis = _BLOCK_AXIS[layout]

    def blocks_quantized(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_arithmetic(blocks, block_axis, fmt.name, mode.value, block_size)

    compiled = _precompiled(blocks_quantized, "quantize", layout, fmt.name, mode.value, block_size)

    def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = _run(compiled, _blocks(x, layout, block_size))
        if out is None:
            return None
        data, scale = out
        return data.view(x.shape), scale.view(scales_shape(x.shape, 1, block_size))

    return quantized


@functools.cache
def compiled_dequantize(
    block_size: int, layout: BlockLayout, out_dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`dequantize_along` compiled (its scales stored once per block) for contiguous data in
    `layout` and its contiguous scale bytes, the result as `out_dtype`; None as for
    `compiled_rounding`."""
    block_axis = _BLOCK_AXIS[layout]

    def blocks_dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_along(data, scale, block_axis, block_size, out_dtype, materialize=inductor_realized)

    compiled = _precompiled(blocks_dequantized, "dequantize", layout, block_size, str(out_dtype))

    def dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        out = _run(compiled, _blocks(data, layout, block_size), _blocks(scale, layout, 1))
        return None if out is None else out.view(data.shape)

    return dequantized


def _layout_view(x: torch.Tensor, axis: int) -> tuple[BlockLayout, torch.Tensor]:
    """Contiguous x as the 2-D ROWS view (blocks along its last axis) or the 3-D COLUMNS view
    (batch, length along axis, width)."""
    inner = math.prod(x.shape[axis + 1:])
    if inner == 1:
        return BlockLayout.ROWS, x.view(-1, x.shape[axis])
    return BlockLayout.COLUMNS, x.view(-1, x.shape[axis], inner)


def _quantized(x: torch.Tensor, axis: int, elem: str, scale_mode: str,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native or else the compiled quantize of contiguous x (or a copy) in x's shape:
    (data, scale bytes), or None (neither runs on this operand)."""
    fmt, mode = elem_format(elem), scale_mode_named(scale_mode)
    x = x.contiguous()
    out = native.quantize(x, axis, fmt, mode, block_size)
    if out is not None or not runs_compiled(x):
        return out
    layout, view = _layout_view(x, axis)
    out = compiled_quantize(fmt, mode, block_size, layout)(view)
    if out is None:
        return None
    return out[0].view(x.shape), out[1].view(scales_shape(x.shape, axis, block_size))


def _rounded(x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The native or else the compiled rounding of contiguous x (or a copy) in x's shape, as
    `dtype`, or None."""
    fmt, mode = elem_format(elem), scale_mode_named(scale_mode)
    x = x.contiguous()
    out = native.fake_quantize(x, axis, fmt, mode, block_size, dtype)
    if out is not None or not runs_compiled(x):
        return out
    layout, view = _layout_view(x, axis)
    out = compiled_rounding(fmt, mode, block_size, layout, dtype)(view)
    return None if out is None else out.view(x.shape)


def quantize_cpu(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxcompile::quantize` on CPU (see the module docstring); the outputs in the fake
    implementation's layouts."""
    axis = check_quantizable(x, axis, block_size)
    out = _in_memory_order(_quantized, x, axis, elem, scale_mode, block_size)
    if out is None:
        return quantize_reference(x, axis, elem, scale_mode, block_size)
    return in_layout_of(x, out[0]), out[1].contiguous()


def dequantize_cpu(
    data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`mxcompile::dequantize` on CPU (see the module docstring): a contiguous result."""
    axis %= data.ndim
    data, scale = data.contiguous(), scale.contiguous()
    out = native.dequantize(data, scale, axis, block_size, dtype)
    if out is not None:
        return out
    if runs_compiled(data):
        layout, view = _layout_view(data, axis)
        out = compiled_dequantize(block_size, layout, dtype)(view, _layout_view(scale, axis)[1])
    if out is None:
        return dequantize_reference(data, scale, axis, block_size, dtype)
    return out.view(data.shape)


def fake_quantized(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """dequantize(quantize(x)) as `dtype` by the native or the compiled rounding, for a CPU
    operand: contiguous, or the transpose of a contiguous tensor where x is one (rounded in its
    memory order), whatever x's own strides; None where neither runs on it (the caller then
    takes the reference)."""
    return _in_memory_order(_rounded, x, axis, elem, scale_mode, block_size, dtype)


def fake_quantize_cpu(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`mxcompile::fake_quantize` on CPU (see the module docstring); the result in x's layout."""
    axis = check_quantizable(x, axis, block_size)
    out = fake_quantized(x, axis, elem, scale_mode, block_size, dtype)
    if out is None:
        return fake_quantize_reference(x, axis, elem, scale_mode, block_size, dtype)
    return in_layout_of(x, out)


quantize_op.register_kernel("cpu")(quantize_cpu)
dequantize_op.register_kernel("cpu")(dequantize_cpu)
fake_quantize_op.register_kernel("cpu")(fake_quantize_cpu)
