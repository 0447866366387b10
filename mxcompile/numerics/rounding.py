"""FP8 and FP4 (E2M1) rounding in fp32 arithmetic, and quantization written for Inductor's CPU
code generation.

`round_to_element(v, fmt)` returns exactly `v.to(fmt.dtype).to(torch.float32)` for every finite
|v| <= fmt.max_normal (signed zeros included) and NaN for NaN, with fp32 multiplies and adds
only. (E2M1 has no torch cast: there it is round-to-nearest-even onto +-{0, 0.5, ..., 6},
checked against an enumeration of the grid in tests/numerics/test_fp4_e2m1.py.) Inductor vectorizes those, whereas its fp8 conversions and int/float bitcasts run element
by element. Two classic tricks, both exact in round-to-nearest-even fp32 arithmetic:

- normal range (|v| >= 2**emin): Veltkamp splitting. c = v * (2**(24 - p) + 1) and
  hi = c - (c - v) round v to p = mantissa_bits + 1 significant bits, ties to even.
- subnormal range: adding C = 1.5 * 2**(q + 23), q the exponent of the fixed subnormal quantum,
  leaves v + C in a binade whose fp32 ulp is 2**q, so the addition rounds v to a multiple of
  2**q, ties to even (C / 2**q is even); subtracting C is exact.

Checked against the fp8 cast on millions of random fp32 patterns and on every fp8 value, every
midpoint between neighbours and each midpoint +-1 ulp (tests/numerics/test_rounding.py).

`quantize_blocks` / `fake_quantize_blocks` apply given block scales to blocks of fp32 values;
the Inductor lowering (mxcompile/ops/quantize.py) feeds them scales computed outside the fused loop.
"""

from __future__ import annotations

import torch

from .formats import F32_MANTISSA_BITS, ElemFormat

_F32_SIGNIFICAND_BITS = F32_MANTISSA_BITS + 1
MAGIC_SIGNIFICAND = 1.5  # C = 1.5 * 2**k keeps v + C inside one binade for |v| < 2**(k-1)


def min_normal_exponent(fmt: ElemFormat) -> int:
    """Exponent of the smallest normal value: 1 - bias (e4m3: -6, e5m2: -14, e2m1: 0)."""
    return 2 - (1 << (fmt.exponent_bits - 1))


def splitter(fmt: ElemFormat) -> float:
    """Veltkamp's splitter that rounds fp32 values to the element's significant bits."""
    return float(2 ** (_F32_SIGNIFICAND_BITS - (fmt.mantissa_bits + 1)) + 1)


def subnormal_quantum_exponent(fmt: ElemFormat) -> int:
    """Exponent of the smallest subnormal element, the spacing of the subnormal range."""
    return min_normal_exponent(fmt) - fmt.mantissa_bits


def subnormal_magic(fmt: ElemFormat) -> float:
    """C = 1.5 * 2**(q + 23), q the subnormal quantum's exponent: v + C rounds v to a multiple
    of 2**q."""
    return MAGIC_SIGNIFICAND * 2.0 ** (subnormal_quantum_exponent(fmt) + F32_MANTISSA_BITS)


def round_to_element(v: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """fp32 `v` (|v| <= max_normal, or NaN) rounded to the element format, as fp32."""
    c = v * splitter(fmt)
    normal = c - (c - v)
    magic = subnormal_magic(fmt)
    subnormal = (v + magic) - magic
    return torch.copysign(torch.where(v.abs() < 2.0 ** min_normal_exponent(fmt), subnormal, normal), v)


def quantize_blocks(
    blocks: torch.Tensor, inverse_scale: torch.Tensor, fmt: ElemFormat
) -> torch.Tensor:
    """fp32 blocks (..., n_blocks, block) times their inverse scales (..., n_blocks, 1), rounded
    and saturated to the element format, as fp32 values on the element grid (NaN blocks: NaN)."""
    scaled = (blocks * inverse_scale).clamp(-fmt.max_normal, fmt.max_normal)
    return round_to_element(scaled, fmt)


def fake_quantize_blocks(
    blocks: torch.Tensor, scale: torch.Tensor, inverse_scale: torch.Tensor, fmt: ElemFormat
) -> torch.Tensor:
    """dequantize(quantize(blocks)) in fp32, given the block scales and their inverses."""
    return quantize_blocks(blocks, inverse_scale, fmt) * scale
