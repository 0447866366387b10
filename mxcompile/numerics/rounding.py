"""FP8 rounding in fp32 arithmetic, and the quantize-dequantize ("fake quantize") that the CPU
MX GEMM uses for operands produced in the same graph.

`round_to_element(v, fmt)` returns exactly `v.to(fmt.dtype).to(torch.float32)` for every finite
|v| <= fmt.max_normal (signed zeros included) and NaN for NaN, but with fp32 adds and integer
bit operations only, which Inductor vectorizes; the fp8 conversions it replaces run element by
element in Inductor's CPU code. Adding C = 1.5 * 2**(q + 23), where q is the exponent of the
element format's quantum at v's magnitude, leaves v + C in a binade whose fp32 ulp is 2**q, so
the fp32 addition itself rounds v to the nearest multiple of 2**q, ties to even (C / 2**q is
even); subtracting C is exact.
"""

from __future__ import annotations

import torch

from .formats import E8M0_BIAS, F32_EXPONENT_MASK, F32_MANTISSA_BITS, ElemFormat
from .scales import inverse_scale_fp32_from_bytes, scale_bytes_from_amax, scale_fp32_from_bytes
from .formats import ScaleMode

_MAGIC_MANTISSA = 1 << (F32_MANTISSA_BITS - 1)  # the 0.5 of C = 1.5 * 2**k


def min_normal_exponent(fmt: ElemFormat) -> int:
    """Exponent of the smallest normal value: 1 - bias (e4m3: -6, e5m2: -14)."""
    exponent_bits = fmt.dtype.itemsize * 8 - 1 - fmt.mantissa_bits
    return 2 - (1 << (exponent_bits - 1))


def round_to_element(v: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """fp32 `v` (|v| <= max_normal or NaN) rounded to the element format, as fp32."""
    exponent = ((v.view(torch.int32) >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK) - E8M0_BIAS
    quantum = exponent.clamp(min=min_normal_exponent(fmt)) - fmt.mantissa_bits
    magic_bits = ((quantum + F32_MANTISSA_BITS + E8M0_BIAS) << F32_MANTISSA_BITS) | _MAGIC_MANTISSA
    magic = magic_bits.view(torch.float32)
    return torch.copysign((v + magic) - magic, v)


def fake_quantize_last_axis(
    x: torch.Tensor, fmt: ElemFormat, mode: ScaleMode, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize(quantize(x)) along the last axis, as `dtype`, without materializing fp8."""
    *lead, n = x.shape
    blocks = x.reshape(*lead, n // block_size, block_size).to(torch.float32)
    scale_bytes = scale_bytes_from_amax(blocks.abs().amax(dim=-1, keepdim=True), fmt, mode)
    scaled = (blocks * inverse_scale_fp32_from_bytes(scale_bytes)).clamp(-fmt.max_normal, fmt.max_normal)
    values = round_to_element(scaled, fmt) * scale_fp32_from_bytes(scale_bytes)
    return values.reshape(*lead, n).to(dtype)


def fake_quantize_along(
    x: torch.Tensor, axis: int, fmt: ElemFormat, mode: ScaleMode, block_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """fake_quantize_last_axis along any (non-negative) axis."""
    last = x.ndim - 1
    if axis == last:
        return fake_quantize_last_axis(x, fmt, mode, block_size, dtype)
    moved = fake_quantize_last_axis(x.movedim(axis, last), fmt, mode, block_size, dtype)
    return moved.movedim(last, axis)
