"""MX GEMM kernel with fused epilogues: C = epilogue(A @ B) where A (M, K) is MX-quantized along
K (scales (M, K / SCALE_BLOCK)) and B (K, N) is MX-quantized along K (scales (K / SCALE_BLOCK, N)).

Three main-loop paths (`GEMM_PATHS`), selected by the `MAIN_LOOP` constexpr:
  * "dot_scaled": `tl.dot_scaled`, native block-scaled MMA on sm100+ (`tcgen05.mma ...
    block_scale`); below sm100 Triton emulates it (upcasts the operands to bf16 in the main
    loop). Needs SCALE_BLOCK == 32.
  * "expand_bf16", for Hopper: the FP8 tiles, loaded into shared memory by the pipelined K loop
    (`cp.async`), are expanded exactly to bf16 one scale block of K at a time (each element
    times 2**(scale - 127) in bf16, `expand_bf16`) and multiplied by a bf16 `tl.dot` (`wgmma`
    on sm90) accumulating in fp32; NaN blocks (scale byte 255) make their rows and columns of
    C NaN after the loop. Per scale block rather than per K tile: compiled for sm90, a whole
    tile's expansion holds one scale per element in registers and spills at 128x128 tiles.
  * "fp8_per_block": one FP8 `tl.dot` per SCALE_BLOCK-wide slice of K, accumulated in fp32,
    with both scales (a row vector and a column vector) applied to that slice's fp32 product.

The kernel is `kernels/mx_gemm.py`; this module holds its launcher and reference.
`tl.constexpr`s: the operand element formats (A_ELEM, B_ELEM), the epilogue (EPILOGUE, the ops
in order), the element format / scale mode / cast of the optional MX-quantized output
(OUT_ELEM, OUT_SCALE_MODE, CAST), MAIN_LOOP, USE_TMA, STORE_C, QUANTIZE_OUT, SCALE_BLOCK, tiles.

Epilogue ops (applied in the order given, in fp32, before the cast to the output dtype):
  bias       acc + bias[n]                     (bias: (N,))
  gelu_tanh  GELU, tanh approximation          (torch.nn.functional.gelu(approximate="tanh"))
  gelu_erf   GELU, exact erf form              (torch.nn.functional.gelu(approximate="none"))
  silu       acc * sigmoid(acc)
  mul        acc * mul[m, n]                   (SwiGLU gate product: silu(x Wg) * (x Wu))
  residual   acc + residual[m, n]
After the cast, QUANTIZE_OUT MX-quantizes the (cast) output along its last axis, bit-exactly as
`mxcompile.numerics.quantize_along(c, 1, ...)` would quantize the stored C.

TMA (`USE_TMA`, dot_scaled path): the FP8 operand tiles are read through host-side tensor
descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`), so the tensor memory
accelerator copies whole tiles into shared memory (the way the Triton block-scaled matmul
tutorial feeds sm100's block-scaled MMA); the scales keep pointer loads (a tile's scales are
BLOCK_K / 32 bytes wide, under TMA's 16-byte minimum box width). `tma_unsupported` gives the
layouts a descriptor cannot describe; `mx_mm_triton` uses TMA on sm100+ where it can.

Reference: `mx_mm_reference` (numerics-core dequantize, fp32 matmul, torch epilogue).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..numerics.formats import elem_format, scale_mode_named
from ..numerics.quantize import dequantize_along
from .common import check_cast
from .configs import autotuned, interpreter_mx_mm_config, mx_mm_autotune_configs, tma_boxes
from .loader import kernel_module

# The main-loop paths (the kernel's MAIN_LOOP values); see the module docstring.
GEMM_PATHS: tuple[str, ...] = ("dot_scaled", "expand_bf16", "fp8_per_block")
# The paths that can read their operand tiles through TMA descriptors (whole K tiles).
TMA_PATHS: tuple[str, ...] = ("dot_scaled",)
EPILOGUE_OPS: tuple[str, ...] = ("bias", "gelu_tanh", "gelu_erf", "silu", "mul", "residual")
ACTIVATIONS = ("gelu_tanh", "gelu_erf", "silu")
# A TMA descriptor's base address and every stride but the innermost (which must be 1) are
# multiples of 16 bytes (CUDA's cuTensorMapEncodeTiled; Triton's TensorDescriptor checks it).
TMA_ALIGNMENT_BYTES = 16
# A quiet NaN's bf16 bits.
BF16_QUIET_NAN_BITS = 0x7FC0


@dataclass(frozen=True)
class MXMMKey:
    """The constexpr specialisation of the MX GEMM kernel (Triton compiles one kernel per
    value); validated on construction."""

    a_elem: str = "e4m3"
    b_elem: str = "e4m3"
    epilogue: tuple[str, ...] = ()
    out_elem: str = "e4m3"  # format of the optional MX-quantized output
    out_scale_mode: str = "rceil"
    cast: str = "software"

    def __post_init__(self) -> None:
        elem_format(self.a_elem, argument="a_elem")
        elem_format(self.b_elem, argument="b_elem")
        check_epilogue(self.epilogue)
        elem_format(self.out_elem, argument="out_elem")
        scale_mode_named(self.out_scale_mode, argument="out_scale_mode")
        check_cast(self.cast)

    def meta(self) -> dict[str, str]:
        """The kernel's constexpr meta-parameters for this specialisation."""
        return {
            "A_ELEM": elem_format(self.a_elem).name,
            "B_ELEM": elem_format(self.b_elem).name,
            "EPILOGUE": ",".join(check_epilogue(self.epilogue)),
            "OUT_ELEM": elem_format(self.out_elem).name,
            "OUT_SCALE_MODE": scale_mode_named(self.out_scale_mode).value,
            "CAST": self.cast,
        }


def check_epilogue(epilogue: tuple[str, ...] | list[str] | str | None) -> tuple[str, ...]:
    """Normalise an epilogue spec ("bias,silu", a sequence of names, or None) to a tuple."""
    if epilogue is None:
        return ()
    if isinstance(epilogue, str):
        epilogue = [op.strip() for op in epilogue.split(",") if op.strip()]
    ops = tuple(epilogue)
    for op in ops:
        if op not in EPILOGUE_OPS:
            raise ValueError(f"epilogue op {op!r} is not supported; accepted: {list(EPILOGUE_OPS)}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"epilogue {list(ops)} repeats an op; each op may appear once")
    return ops


def _b_descriptor_transposed(b: torch.Tensor) -> bool:
    """Whether B's TMA descriptor covers its memory as (N, K): B (K, N) is contiguous along K
    (the transpose of a row-major (N, K) tensor, as a linear layer's weight is)."""
    return b.stride(0) == 1 and b.shape[0] > 1


def tma_unsupported(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the FP8 operands A (M, K) and B (K, N) cannot be read through TMA descriptors, or
    None: each needs a unit stride along one axis and the other stride, in bytes, and its
    address aligned to TMA_ALIGNMENT_BYTES."""
    b_memory = b.t() if _b_descriptor_transposed(b) else b
    for name, t in (("a", a), ("b", b_memory)):
        if t.stride(1) != 1:
            return f"{name} has strides {tuple(t.stride())}: TMA needs one axis contiguous"
        if (t.stride(0) * t.element_size()) % TMA_ALIGNMENT_BYTES or t.data_ptr() % TMA_ALIGNMENT_BYTES:
            return (f"{name}'s row stride ({t.stride(0)} elements) or address is not a multiple of "
                    f"{TMA_ALIGNMENT_BYTES} bytes")
    return None


def _descriptors(a: torch.Tensor, b: torch.Tensor, tiles: dict[str, int]) -> tuple[Any, Any, bool]:
    """(A's descriptor, B's descriptor, whether B's covers (N, K)), boxes sized to `tiles`
    (autotuned launches resize them per config: `configs.set_tma_boxes`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    transposed = _b_descriptor_transposed(b)
    a_box, b_box = tma_boxes(tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"], transposed)
    b_memory = b.t() if transposed else b
    return TensorDescriptor.from_tensor(a, a_box), TensorDescriptor.from_tensor(b_memory, b_box), transposed


@functools.cache
def _autotuned(block_size: int, tma: bool, path: str) -> Any:
    configs = [
        c
        for c in mx_mm_autotune_configs(tma, path)
        if c.kwargs["BLOCK_K"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]
    if not configs:
        raise ValueError(f"no MX GEMM tile config fits block_size={block_size}")
    kernel = kernel_module("mx_gemm", interpret=False).mx_mm_kernel
    specialisation = [*MXMMKey().meta(), "MAIN_LOOP", "USE_TMA", "B_DESC_TRANSPOSED", "STORE_C",
                      "QUANTIZE_OUT"]
    return autotuned(kernel, configs, ["M", "N", "K", *specialisation])


@contextlib.contextmanager
def interpreter_bf16_arithmetic() -> Iterator[None]:
    """Within it, the Triton interpreter's `tl.dot` and `*` take bf16 operands as their values.

    Triton 3.9's interpreter keeps bf16 tensors as their uint16 bit patterns and multiplies
    them (np.matmul, np.multiply) as they are: a bf16 `tl.dot` computes products of integers
    (seen on this machine: a 16x16 product off by 3e10), and so does a bf16 `*`. Here each bf16
    operand is widened to its exact fp32 value (its bits shifted up 16): the dot then
    accumulates in fp32, as a bf16 tensor-core MMA does, and a product is rounded back to bf16
    to nearest even, as the GPU's bf16 multiply rounds. The expand_bf16 main loop and the bf16
    reference GEMM need it; their launchers apply it around interpreted launches."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot, create_fmul = InterpreterBuilder.create_dot, InterpreterBuilder.create_fmul

    def widened(handle: TensorHandle) -> TensorHandle:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return TensorHandle(bits.view(np.float32), tl.float32)

    def dot(self: Any, a: TensorHandle, b: TensorHandle, d: TensorHandle, *args: Any) -> TensorHandle:
        return create_dot(self, widened(a), widened(b), d, *args)

    def multiply(self: Any, lhs: TensorHandle, rhs: TensorHandle) -> TensorHandle:
        if lhs.dtype.scalar != tl.bfloat16:
            return create_fmul(self, lhs, rhs)
        product = (widened(lhs).data * widened(rhs).data).astype(np.float32)
        bits = product.view(np.uint32)
        nearest_even = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        bits16 = np.where(np.isnan(product), np.uint32(BF16_QUIET_NAN_BITS), nearest_even).astype(np.uint16)
        return TensorHandle(bits16, tl.bfloat16)

    InterpreterBuilder.create_dot, InterpreterBuilder.create_fmul = dot, multiply
    try:
        yield
    finally:
        InterpreterBuilder.create_dot, InterpreterBuilder.create_fmul = create_dot, create_fmul


def mx_mm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    block_size: int,
    out_dtype: torch.dtype,
    key: MXMMKey,
    path: str,
    use_tma: bool = False,
    store_c: bool = True,
    quantize_out: bool = False,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Thin launcher: allocate outputs, pick the kernel, launch. No validation (see __init__)
    beyond `path`, one of GEMM_PATHS.

    Returns (c or None, quantized data or None, quantized scales or None).
    """
    import triton

    if path not in GEMM_PATHS:
        raise ValueError(f"path={path!r}: the MX GEMM's main loops are {list(GEMM_PATHS)}")
    m, k = a.shape
    n = b.shape[1]
    device = a.device
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    c = torch.empty((m, n), dtype=out_dtype, device=device) if store_c else None
    # Without C, the kernel still reads C's dtype from c_ptr: pass a 1-element dummy of it.
    c_arg = c if c is not None else torch.empty(1, dtype=out_dtype, device=device)
    q_data = q_scale = None
    if quantize_out:
        q_data = torch.empty((m, n), dtype=elem_format(key.out_elem).dtype, device=device)
        q_scale = torch.empty((m, n // block_size), dtype=torch.uint8, device=device)

    def strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
        return tuple(t.stride()) if t is not None else (0,) * ndim

    # Fixed tiles (given, or the interpreter's), or None: the autotuner picks them.
    fixed_tiles = None if tiles is None and not interpret else {"GROUP_M": 8, **(tiles or interpreter_mx_mm_config())}
    a_desc = b_desc = dummy
    b_transposed = False
    if use_tma:  # boxes of the first config until the autotuner sizes them to each config's tiles
        box_tiles = fixed_tiles or mx_mm_autotune_configs()[0].kwargs
        a_desc, b_desc, b_transposed = _descriptors(a, b, box_tiles)
    args = (
        a, a_scale, b, b_scale, c_arg,
        bias if bias is not None else dummy,
        mul if mul is not None else dummy,
        residual if residual is not None else dummy,
        q_data.view(torch.uint8) if q_data is not None else dummy,
        q_scale if q_scale is not None else dummy,
        a_desc, b_desc,
        m, n, k,
        *a.stride(), *a_scale.stride(), *b.stride(), *b_scale.stride(),
        *(c.stride() if c is not None else (0, 0)),
        *strides(bias, 1), *strides(mul, 2), *strides(residual, 2),
    )  # fmt: skip
    meta = {
        **key.meta(),
        "MAIN_LOOP": path,
        "USE_TMA": use_tma,
        "B_DESC_TRANSPOSED": b_transposed,
        "STORE_C": store_c,
        "QUANTIZE_OUT": quantize_out,
        "SCALE_BLOCK": block_size,
    }

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if m == 0 or n == 0:  # nothing to compute; Triton rejects an empty grid
        return c, q_data, q_scale
    if fixed_tiles is None:
        kernel = _autotuned(block_size, use_tma, path)
    else:
        kernel = kernel_module("mx_gemm", interpret=interpret).mx_mm_kernel
        meta.update(fixed_tiles)
    if wrap is not None:
        kernel = wrap(kernel)
    with interpreter_bf16_arithmetic() if interpret and path == "expand_bf16" else contextlib.nullcontext():
        kernel[grid](*args, **meta)
    return c, q_data, q_scale


def bf16_mm_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> torch.Tensor:
    """C = A @ B (bf16 out) by `bf16_mm_kernel`, the plain bf16 GEMM the MX GEMM's compiled code
    is compared with: A (M, K), B (K, N) bf16. Not autotuned: `tiles` as given, else the
    interpreter's (`interpreter_mx_mm_config`)."""
    import triton

    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"bf16_mm_launch needs bf16 A (M, K) and B (K, N), got {a.dtype} {tuple(a.shape)}, "
                         f"{b.dtype} {tuple(b.shape)}")
    if tiles is None and not interpret:
        raise ValueError("the bf16 reference GEMM is not autotuned: pass tiles={'BLOCK_M', 'BLOCK_N', 'BLOCK_K'}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    meta = {"GROUP_M": 8, **(tiles or interpreter_mx_mm_config())}
    kernel = kernel_module("mx_gemm", interpret=interpret).bf16_mm_kernel
    if wrap is not None:
        kernel = wrap(kernel)
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    with interpreter_bf16_arithmetic() if interpret else contextlib.nullcontext():
        kernel[grid](a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(), **meta)
    return c


def apply_epilogue_reference(
    acc: torch.Tensor,
    epilogue: tuple[str, ...],
    *,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The epilogue ops in torch, in fp32, in the given order."""
    for op in epilogue:
        if op == "bias":
            acc = acc + bias.float()
        elif op == "gelu_tanh":
            acc = F.gelu(acc, approximate="tanh")
        elif op == "gelu_erf":
            acc = F.gelu(acc, approximate="none")
        elif op == "silu":
            acc = F.silu(acc)
        elif op == "mul":
            acc = acc * mul.float()
        elif op == "residual":
            acc = acc + residual.float()
        else:
            raise ValueError(f"unknown epilogue op {op!r}")
    return acc


def mx_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.float32,
    epilogue: tuple[str, ...] | str | None = (),
    *,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of the MX GEMM kernel: numerics-core dequantize (exact, fp32),
    fp32 matmul, the epilogue in fp32, cast to out_dtype."""
    a_hp = dequantize_along(a, a_scale, 1, block_size, torch.float32)
    b_hp = dequantize_along(b, b_scale, 0, block_size, torch.float32)
    acc = apply_epilogue_reference(
        a_hp @ b_hp, check_epilogue(epilogue), bias=bias, mul=mul, residual=residual
    )
    return acc.to(out_dtype)
