"""MX numerics: formats, scales and the reference quantize / dequantize / GEMM."""

from .formats import (
    DEFAULT_BLOCK_SIZE,
    E4M3,
    E5M2,
    E8M0_BIAS,
    E8M0_NAN,
    ELEM_FORMATS,
    ElemFormat,
    ElemFormatName,
    ScaleMode,
    check_block_size,
    elem_format,
    scale_mode_named,
)
from .quantize import (
    MXTensor,
    dequantize_along,
    dequantize_mx,
    mx_matmul,
    quantize_along,
    quantize_mx,
    split_blocks,
)
from .scales import (
    bytes_from_e8m0,
    e8m0_from_bytes,
    inverse_scale_fp32_from_bytes,
    scale_bytes_from_amax,
    scale_fp32_from_bytes,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "E4M3",
    "E5M2",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ELEM_FORMATS",
    "ElemFormat",
    "ElemFormatName",
    "MXTensor",
    "ScaleMode",
    "bytes_from_e8m0",
    "check_block_size",
    "dequantize_along",
    "dequantize_mx",
    "e8m0_from_bytes",
    "elem_format",
    "inverse_scale_fp32_from_bytes",
    "mx_matmul",
    "quantize_along",
    "quantize_mx",
    "scale_bytes_from_amax",
    "scale_fp32_from_bytes",
    "scale_mode_named",
    "split_blocks",
]
