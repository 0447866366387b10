"""E8M0 scale computation, written with integer operations on fp32 bit patterns so that it is
exact for every input (subnormals, zeros, Inf, NaN) and compiles to fused loops in Inductor.
"""

from __future__ import annotations

from typing import Callable

import torch

from .formats import (
    E8M0_BIAS,
    E8M0_MAX_BYTE,
    E8M0_NAN,
    ALL_ELEM_FORMATS,
    F32_EXPONENT_MASK,
    F32_MANTISSA_BITS,
    F32_MANTISSA_MASK,
    ElemFormat,
    ScaleMode,
)

# The fp32 bit pattern of 2**-127, the one E8M0 value that is an fp32 subnormal.
_F32_BITS_TWO_POW_MINUS_127 = 1 << (F32_MANTISSA_BITS - 1)
# Largest subnormal-descale mantissa that still rounds up only to 2**-127 (i.e. descale <= 2**-127).
_F32_HALF_MIN_NORMAL_MANTISSA = 1 << (F32_MANTISSA_BITS - 1)


# fp32(1 / max_elem) of the built-in formats, computed once at import. Evaluating
# `ElemFormat.reciprocal_max_fp32` (struct.pack) while Dynamo traces fails after a recompile:
# Dynamo then treats the format's float fields as dynamic, cannot constant-fold struct.pack
# and recurses in its struct polyfill (torch 2.13: "RecursionError: maximum recursion depth
# exceeded", seen when compiling e4m3 and then e5m2 in one process).
_RECIPROCAL_MAX_FP32 = {name: fmt.reciprocal_max_fp32 for name, fmt in ALL_ELEM_FORMATS.items()}


def _reciprocal_max_fp32(fmt: ElemFormat) -> float:
    if ALL_ELEM_FORMATS.get(fmt.name) is fmt:
        return _RECIPROCAL_MAX_FP32[fmt.name]
    return fmt.reciprocal_max_fp32


def _exponent_and_mantissa(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK, bits & F32_MANTISSA_MASK


def scale_bytes_from_amax(amax: torch.Tensor, fmt: ElemFormat, scale_mode: ScaleMode) -> torch.Tensor:
    """Biased E8M0 scale bytes (int32 in [0, 255]) for blocks whose absolute maximum is `amax`.

    `amax` must be non-negative fp32. A non-finite amax (the block holds a NaN or an Inf) gives
    the NaN byte 0xFF. Results are clamped to the E8M0 range [2**-127, 2**127].
    """
    if scale_mode is ScaleMode.RCEIL:
        descale = amax * _reciprocal_max_fp32(fmt)
        exponent, mantissa = _exponent_and_mantissa(descale.view(torch.int32))
        # Normal descale: ceil(log2) = exponent - bias + (mantissa != 0).
        normal = exponent + (mantissa != 0).to(torch.int32)
        # Subnormal descale (exponent field 0): it equals mantissa * 2**-149, so it rounds up to
        # 2**-126 (byte 1) when it exceeds 2**-127 and to 2**-127 or below (byte 0) otherwise.
        subnormal = (mantissa > _F32_HALF_MIN_NORMAL_MANTISSA).to(torch.int32)
        biased = torch.where(exponent == 0, subnormal, normal)
    else:
        bits = amax.view(torch.int32)
        if scale_mode is ScaleMode.EVEN:
            # Round amax half-up to the element's mantissa width; a carry bumps the exponent.
            bits = bits + (1 << (F32_MANTISSA_BITS - fmt.mantissa_bits - 1))
        exponent, mantissa = _exponent_and_mantissa(bits)
        if scale_mode is ScaleMode.CEIL:
            exponent = exponent + (mantissa != 0).to(torch.int32)
        # floor(log2(amax)) - emax, re-biased: (exponent - bias) - emax + bias.
        biased = exponent - fmt.emax
    biased = biased.clamp(0, E8M0_MAX_BYTE)
    return torch.where(torch.isfinite(amax), biased, E8M0_NAN)


def scale_fp32_from_bytes(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 value 2**(b - 127) of each scale byte b; NaN for 0xFF. Exact, subnormal 2**-127 included."""
    b = scale_bytes.to(torch.int32)
    bits = torch.where(b == 0, _F32_BITS_TWO_POW_MINUS_127, b << F32_MANTISSA_BITS)
    return torch.where(b == E8M0_NAN, float("nan"), bits.view(torch.float32))


def inverse_scale_fp32_from_bytes(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 value 2**(127 - b) of each scale byte b; NaN for 0xFF. Exact for every byte."""
    b = scale_bytes.to(torch.int32)
    inverse_biased = 2 * E8M0_BIAS - b  # 2**(127-b) has biased fp32 exponent 254 - b
    bits = torch.where(
        b == E8M0_MAX_BYTE, _F32_BITS_TWO_POW_MINUS_127, inverse_biased << F32_MANTISSA_BITS
    )
    return torch.where(b == E8M0_NAN, float("nan"), bits.view(torch.float32))


def e8m0_from_bytes(scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 scale bytes as torch.float8_e8m0fnu, bit for bit.

    Eager: a view. Inside torch.compile: a value conversion of 2**(b - 127) (exact: every byte
    is a power of two or NaN), because Inductor's CPU code generation cannot view a tensor as
    (or from) float8_e8m0fnu, whereas it compiles a conversion to it.
    """
    if torch.compiler.is_compiling():
        return scale_fp32_from_bytes(scale_bytes).to(torch.float8_e8m0fnu)
    return scale_bytes.view(torch.float8_e8m0fnu)


def bytes_from_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """torch.float8_e8m0fnu scales as uint8 bytes, bit for bit (the inverse of
    `e8m0_from_bytes`, with the same eager view / compiled conversion split). The fp32 value
    2**(b - 127) has biased exponent field b for b >= 1; b = 0 is the subnormal 2**-127, whose
    exponent field is 0 as well, and the NaN byte 0xFF gives an all-ones exponent field."""
    if torch.compiler.is_compiling():
        bits = scale.to(torch.float32).view(torch.int32)
        return ((bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK).to(torch.uint8)
    return scale.view(torch.uint8)


# Float-only scale computation (see `scale_fp32_from_amax`).
_E8M0_MIN_FP32 = 2.0 ** -E8M0_BIAS
_E8M0_MAX_FP32 = 2.0 ** (E8M0_MAX_BYTE - E8M0_BIAS)
# Inputs are brought into [2**-RANGE, 2**RANGE] by an exact power-of-two factor, where the
# one-bit Veltkamp split below neither overflows (needs |w| < 2**(128 - 23)) nor meets
# subnormals (every fp32 subnormal times 2**RANGE is normal: 2**-149 * 2**64 = 2**-85).
_POW2_RANGE_EXPONENT = 64
# Veltkamp's splitter for one significant bit: c = w * (2**23 + 1), w - (c - (c - w)) ... keeps
# the top bit of w rounded to nearest, i.e. one of the two powers of two around w.
_ONE_BIT_SPLITTER = float(2**F32_MANTISSA_BITS + 1)


def _nearby_power_of_two(w: torch.Tensor) -> torch.Tensor:
    """For w >= 0 in [2**-85, 2**64] (or 0): one of the two powers of two bracketing w (0 for 0)."""
    c = w * _ONE_BIT_SPLITTER
    return c - (c - w)


def identity(t: torch.Tensor) -> torch.Tensor:
    """t itself: the default `materialize` (nothing to store separately in eager PyTorch)."""
    return t


def scale_fp32_from_amax(
    amax: torch.Tensor,
    fmt: ElemFormat,
    scale_mode: ScaleMode,
    *,
    materialize: Callable[[torch.Tensor], torch.Tensor] = identity,
) -> torch.Tensor:
    """The fp32 block scale 2**(b - 127) of the byte b = `scale_bytes_from_amax(amax)` (NaN for
    0xFF), computed with fp32 multiplies, adds, comparisons and selects only.

    Equal bit for bit to `scale_fp32_from_bytes(scale_bytes_from_amax(amax, ...))`
    (tests/numerics/test_scales.py checks every exponent with edge and random mantissas), but
    free of int/float bitcasts, which Inductor's CPU code generation runs element by element:
    this form vectorizes, so the quantize kernels compute scales inside their fused loops.

    Each rule is a power of two next to a value v (amax, or the rceil descale): a one-bit
    Veltkamp split gives a power of two p within a factor 2 of v, one comparison turns it into
    floor (p <= v) or ceil (p >= v). The power-of-two factors (range scaling, 2**-emax) are
    exact; products below 2**-127 may underflow, and the clamp to the E8M0 range maps them to
    2**-127 as the byte clamp does.

    `materialize` is applied to the intermediates used more than once (identity by default).
    The Inductor form of quantize passes a realization hint: Inductor inlines single-use
    elementwise nodes into their users and re-expands an inlined node at every use, so without
    it this dozen-op function expands to hundreds of nodes per use of the scale (a 3548-node
    loop body in a 2-layer MLP's backward), and Inductor's code generation time follows.
    """
    finite = materialize(torch.isfinite(amax))
    value = amax * _reciprocal_max_fp32(fmt) if scale_mode is ScaleMode.RCEIL else amax
    value = materialize(torch.where(finite, value, 0.0))
    big, small = 2.0**_POW2_RANGE_EXPONENT, 2.0**-_POW2_RANGE_EXPONENT
    into_range = materialize(torch.where(value >= big, small, torch.where(value < small, big, 1.0)))
    w = materialize(value * into_range)
    p = materialize(_nearby_power_of_two(w))
    if scale_mode in (ScaleMode.RCEIL, ScaleMode.CEIL):
        p = torch.where(p < w, p * 2.0, p)
    else:
        p = torch.where(p > w, p * 0.5, p)
        if scale_mode is ScaleMode.EVEN:
            # Rounding amax half up to the element's mantissa width carries into the next
            # power of two iff amax >= p * (2 - 2**-(mantissa_bits + 1)).
            p = torch.where(w >= p * (2.0 - 2.0 ** -(fmt.mantissa_bits + 1)), p * 2.0, p)
    if scale_mode is not ScaleMode.RCEIL:
        p = p * 2.0**-fmt.emax
    scale = (p * (1.0 / into_range)).clamp(_E8M0_MIN_FP32, _E8M0_MAX_FP32)
    return torch.where(finite, scale, float("nan"))
