"""The quantize ops' native CPU kernels (`quantize.cpp`): one pass over each block, the same
arithmetic as the numerics core, bit for bit.

    quantize(x, fmt, mode, block_size)            -> (fp8 data, uint8 scale bytes) or None
    fake_quantize(x, fmt, mode, block_size, dtype) -> dequantize(quantize(x)) as dtype, or None
    dequantize(data, scales, block_size, dtype)    -> data * scale as dtype, or None

Operands are contiguous and in one of the two block layouts of `ops.cpu_kernels`: 2-D (rows,
length) with blocks along each row (block_size a multiple of ROW_BLOCK_MULTIPLE, 16), or 3-D (batch, length,
width) with blocks along the middle axis; scales are (rows, length / block_size) or (batch,
length / block_size, width). None: the library could not be built (`build.library`) or the
case is not one it handles; the caller then runs another kernel.

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

import torch

from ...numerics import ElemFormat, ScaleMode
from ...numerics.formats import ELEM_FORMATS
from ...numerics.rounding import min_normal_exponent, splitter, subnormal_magic
from . import huge_pages
from .build import library

# The kernels' dtype and scale-mode codes (the enums of quantize.cpp).
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_FP8_CODE = 3
_SCALE_MODE_CODES = {ScaleMode.FLOOR: 0, ScaleMode.RCEIL: 1, ScaleMode.CEIL: 2, ScaleMode.EVEN: 3}
_FORMATS_BY_DTYPE = {fmt.dtype: fmt for fmt in ELEM_FORMATS.values()}
# Blocks along rows are whole vectors of quantize.cpp's kLanes lanes (its row entry points
# return 1 otherwise); checked here too, before the outputs are allocated.
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


@functools.cache
def _kernels() -> dict[str, ctypes._CFuncPtr] | None:
    lib = library()
    if lib is None:
        return None
    kernels = {}
    for name, argtypes in _SIGNATURES.items():
        kernel = getattr(lib, name)
        kernel.argtypes, kernel.restype = argtypes, ctypes.c_int
        kernels[name] = kernel
    return kernels


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first use)."""
    return _kernels() is not None


def _handles(x: torch.Tensor, block_size: int) -> bool:
    return (x.device.type == "cpu" and x.is_contiguous() and x.ndim in (2, 3)
            and (x.ndim == 3 or block_size % ROW_BLOCK_MULTIPLE == 0) and x.numel() > 0)


def _blocks_shape(x: torch.Tensor, block_size: int) -> list[int]:
    shape = list(x.shape)
    shape[-1 if x.ndim == 2 else 1] //= block_size
    return shape


def _quantize(x: torch.Tensor, fmt: ElemFormat, mode: ScaleMode, block_size: int,
              out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    kernels = _kernels()
    if kernels is None or not _handles(x, block_size) or x.dtype not in _DTYPE_CODES:
        return None
    out = huge_pages.empty(x.shape, out_dtype)
    scales = torch.empty(_blocks_shape(x, block_size), dtype=torch.uint8)
    out_code = _FP8_CODE if out_dtype is fmt.dtype else _DTYPE_CODES[out_dtype]
    common = (x.data_ptr(), _DTYPE_CODES[x.dtype], out.data_ptr(), out_code, scales.data_ptr())
    params = (block_size, torch.get_num_threads(), ctypes.addressof(_format(fmt, mode)))
    if x.ndim == 2:
        status = kernels["mx_quantize_rows"](*common, *x.shape, *params)
    else:
        status = kernels["mx_quantize_columns"](*common, *x.shape, *params)
    return None if status else (out, scales)


def quantize(x: torch.Tensor, fmt: ElemFormat, mode: ScaleMode,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`mxcompile::quantize` of x in its block layout (module docstring): (fp8 data in x's
    shape, scale bytes), or None."""
    return _quantize(x, fmt, mode, block_size, fmt.dtype)


def fake_quantize(x: torch.Tensor, fmt: ElemFormat, mode: ScaleMode, block_size: int,
                  dtype: torch.dtype) -> torch.Tensor | None:
    """dequantize(quantize(x)) as `dtype` (bf16, fp16 or fp32), in x's shape, or None."""
    if dtype not in _DTYPE_CODES:
        return None
    out = _quantize(x, fmt, mode, block_size, dtype)
    return None if out is None else out[0]


def dequantize(data: torch.Tensor, scales: torch.Tensor, block_size: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """fp8 `data` times its blocks' scales (uint8 scale bytes, contiguous, in the layout's
    scale shape) as `dtype` (bf16, fp16 or fp32), or None."""
    kernels = _kernels()
    fmt = _FORMATS_BY_DTYPE.get(data.dtype)
    if (kernels is None or fmt is None or dtype not in _DTYPE_CODES or not _handles(data, block_size)
            or scales.dtype != torch.uint8 or not scales.is_contiguous() or list(scales.shape) != _blocks_shape(data, block_size)):
        return None
    out = huge_pages.empty(data.shape, dtype)
    common = (data.data_ptr(), scales.data_ptr(), out.data_ptr(), _DTYPE_CODES[dtype])
    # The scale rule does not enter dequantization.
    params = (block_size, torch.get_num_threads(), ctypes.addressof(_format(fmt, ScaleMode.RCEIL)))
    if data.ndim == 2:
        status = kernels["mx_dequantize_rows"](*common, *data.shape, *params)
    else:
        status = kernels["mx_dequantize_columns"](*common, *data.shape, *params)
    return None if status else out
