"""The quantize ops' native CPU kernels (`quantize.cpp`): one pass over each block, the same
arithmetic as the numerics core, bit for bit.

    quantize(x, axis, fmt, mode, block_size)             -> (fp8 data, uint8 scale bytes) or None
    fake_quantize(x, axis, fmt, mode, block_size, dtype) -> dequantize(quantize(x)) as dtype, or None
    dequantize(data, scales, axis, block_size, dtype)    -> data * scale as dtype, or None

Operands are contiguous, of any shape; blocks run along `axis`. The kernels see them in one of
the two block layouts of `ops.cpu_kernels`, taken from the shape with no view made: blocks
along the last axis (the product of the sizes after `axis` is 1) as (rows, length) when
block_size is a multiple of ROW_BLOCK_MULTIPLE (16); blocks along another axis, and last-axis
blocks of other sizes, as (batch, length, width), width the product of the sizes after `axis`.
Data and results keep the operand's shape, scale bytes have `numerics.scales_shape`. None: the
library could not be built (`build.library`) or the case is not one it handles; the caller
then runs another kernel.

Why native code: Inductor's generated loops for these ops read each block twice (amax, then
the elements), reduce every 32-element block horizontally in a generic form, and each call of
a compiled graph paid ~0.27 ms of Python (guards, the compiled function's wrapper); the GEMM
operands of a d512 GPT's step spent ~0.2 s in them (issue 15). Here a block is read once; the
ops run 1.5-3x faster, and the kernels are built once per machine (~4 s on 2 cores, in the
background: `build.build_in_background`) instead of one Inductor compile (~3 s) per kind of
operand.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from ...numerics import ElemFormat, ScaleMode, scales_shape
from ...numerics.formats import ELEM_FORMATS
from ...numerics.rounding import min_normal_exponent, splitter, subnormal_magic
from . import huge_pages
from .build import library

# The kernels' dtype and scale-mode codes (the enums of quantize.cpp).
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_FP8_CODE = 3
_SCALE_MODE_CODES = {ScaleMode.FLOOR: 0, ScaleMode.RCEIL: 1, ScaleMode.CEIL: 2, ScaleMode.EVEN: 3}
_FORMATS_BY_DTYPE = {fmt.dtype: fmt for fmt in ELEM_FORMATS.values()}
# The row kernels take blocks of whole vectors of quantize.cpp's kLanes lanes (their entry
# points return 1 otherwise); last-axis blocks of other sizes go to the column kernels.
ROW_BLOCK_MULTIPLE = 16


class _MXFormat(ctypes.Structure):
    """quantize.cpp's MXFormat: the element format's numbers and the scale rule."""

    _fields_ = [
        ("scale_mode", ctypes.c_int32),
        ("emax", ctypes.c_int32),
        ("mantissa_bits", ctypes.c_int32),
        ("exponent_bias", ctypes.c_int32),
        ("nan_byte", ctypes.c_int32),
        ("max_normal", ctypes.c_float),
        ("reciprocal_max", ctypes.c_float),
        ("splitter", ctypes.c_float),
        ("magic", ctypes.c_float),
        ("min_normal", ctypes.c_float),
    ]


@functools.cache
def _format(fmt: ElemFormat, mode: ScaleMode) -> _MXFormat:
    """The constants of `numerics.rounding` and `numerics.scales` for this format and rule."""
    emin = min_normal_exponent(fmt)
    return _MXFormat(
        scale_mode=_SCALE_MODE_CODES[mode],
        emax=fmt.emax,
        mantissa_bits=fmt.mantissa_bits,
        exponent_bias=1 - emin,
        nan_byte=fmt.nan_byte,
        max_normal=fmt.max_normal,
        reciprocal_max=fmt.reciprocal_max_fp32,
        splitter=splitter(fmt),
        magic=subnormal_magic(fmt),
        min_normal=2.0**emin,
    )


_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_SIGNATURES = {
    # x, in dtype, out, out dtype, scales, rows, length, block size, threads, format
    "mx_quantize_rows": (_PTR, _I32, _PTR, _I32, _PTR, _I64, _I64, _I64, _I32, _PTR),
    # x, in dtype, out, out dtype, scales, batch, length, width, block size, threads, format
    "mx_quantize_columns": (_PTR, _I32, _PTR, _I32, _PTR, _I64, _I64, _I64, _I64, _I32, _PTR),
    # data, scales, out, out dtype, rows, length, block size, threads, format
    "mx_dequantize_rows": (_PTR, _PTR, _PTR, _I32, _I64, _I64, _I64, _I32, _PTR),
    # data, scales, out, out dtype, batch, length, width, block size, threads, format
    "mx_dequantize_columns": (_PTR, _PTR, _PTR, _I32, _I64, _I64, _I64, _I64, _I32, _PTR),
}


def bind_kernels(lib: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:
    """The entry points of a build of quantize.cpp with their signatures (the loaded library's,
    or another build's: benchmarks/native_ab.py)."""
    kernels = {}
    for name, argtypes in _SIGNATURES.items():
        kernel = getattr(lib, name)
        kernel.argtypes, kernel.restype = argtypes, ctypes.c_int
        kernels[name] = kernel
    return kernels


@functools.cache
def _kernels() -> dict[str, ctypes._CFuncPtr] | None:
    lib = library()
    return None if lib is None else bind_kernels(lib)


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first use)."""
    return _kernels() is not None


def _kernel_dims(x: torch.Tensor, axis: int, block_size: int) -> tuple[bool, tuple[int, ...]] | None:
    """Which layout's kernel runs x's blocks along `axis` (True: the column layout) and its
    dims, (rows, length) or (batch, length, width); None where no kernel runs on x."""
    if x.device.type != "cpu" or not x.is_contiguous() or x.numel() == 0 or x.ndim == 0:
        return None
    shape = x.shape
    length = shape[axis]
    if length % block_size:
        return None
    width = math.prod(shape[axis + 1:])
    if width == 1 and block_size % ROW_BLOCK_MULTIPLE == 0:
        return False, (x.numel() // length, length)
    # Any other axis; and the last one for blocks of other sizes, as columns of width 1.
    return True, (x.numel() // (length * width), length, width)


def _quantize(x: torch.Tensor, axis: int, fmt: ElemFormat, mode: ScaleMode, block_size: int,
              out_dtype: torch.dtype, with_scales: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    kernels = _kernels()
    axis %= max(x.ndim, 1)
    dims = _kernel_dims(x, axis, block_size) if kernels is not None and x.dtype in _DTYPE_CODES else None
    if dims is None:
        return None
    columns, sizes = dims
    out = huge_pages.empty(x.shape, out_dtype)
    scales = torch.empty(scales_shape(x.shape, axis, block_size), dtype=torch.uint8) if with_scales else None
    out_code = _FP8_CODE if out_dtype is fmt.dtype else _DTYPE_CODES[out_dtype]
    kernel = kernels["mx_quantize_columns" if columns else "mx_quantize_rows"]
    status = kernel(x.data_ptr(), _DTYPE_CODES[x.dtype], out.data_ptr(), out_code,
                    None if scales is None else scales.data_ptr(), *sizes, block_size,
                    torch.get_num_threads(), ctypes.addressof(_format(fmt, mode)))
    return None if status else (out, scales)


def quantize(x: torch.Tensor, axis: int, fmt: ElemFormat, mode: ScaleMode,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`mxcompile::quantize` of contiguous x along axis: (fp8 data in x's shape, scale bytes in
    `scales_shape`), or None."""
    return _quantize(x, axis, fmt, mode, block_size, fmt.dtype, with_scales=True)


def fake_quantize(x: torch.Tensor, axis: int, fmt: ElemFormat, mode: ScaleMode, block_size: int,
                  dtype: torch.dtype) -> torch.Tensor | None:
    """dequantize(quantize(x)) along axis as `dtype` (bf16, fp16 or fp32), in x's shape, or
    None. No scale bytes are stored."""
    if dtype not in _DTYPE_CODES:
        return None
    out = _quantize(x, axis, fmt, mode, block_size, dtype, with_scales=False)
    return None if out is None else out[0]


def dequantize(data: torch.Tensor, scales: torch.Tensor, axis: int, block_size: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """Contiguous fp8 `data` times its blocks' scales along axis (uint8 scale bytes,
    contiguous, in `scales_shape`) as `dtype` (bf16, fp16 or fp32), or None."""
    kernels = _kernels()
    fmt = _FORMATS_BY_DTYPE.get(data.dtype)
    if kernels is None or fmt is None or dtype not in _DTYPE_CODES:
        return None
    axis %= max(data.ndim, 1)
    dims = _kernel_dims(data, axis, block_size)
    if (dims is None or scales.dtype != torch.uint8 or not scales.is_contiguous()
            or list(scales.shape) != scales_shape(data.shape, axis, block_size)):
        return None
    columns, sizes = dims
    out = huge_pages.empty(data.shape, dtype)
    kernel = kernels["mx_dequantize_columns" if columns else "mx_dequantize_rows"]
    # The scale rule does not enter dequantization.
    status = kernel(data.data_ptr(), scales.data_ptr(), out.data_ptr(), _DTYPE_CODES[dtype], *sizes, block_size,
                    torch.get_num_threads(), ctypes.addressof(_format(fmt, ScaleMode.RCEIL)))
    return None if status else out
