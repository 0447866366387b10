"""An independent, pure-Python model of the FP4 formats, written from the definitions only.

Nothing here imports mxcompile or uses torch arithmetic. E2M1 rounding picks the nearest of the
enumerated magnitudes (ties to the even code); E8M0 scales come from `mx_reference.scale_byte`
(E2M1 described by its bit fields); E4M3 block scales from `mx_reference.fp8_encode`. Every fp32
operation of the NVFP4 order (docs/fp4.md) is modelled as exact binary64 arithmetic rounded once
to binary32 (`round_fp32`): for +, -, * and / of binary32 operands that double rounding is
innocuous (53 >= 2 * 24 + 2), so it gives the correctly rounded fp32 result.

Definitions (the spec the FP4 tests check mxcompile against):
  E2M1 codes s.ee.m: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, bit 3 the sign.
  nearest: the closest magnitude to min(|v|, 6); at a tie the code whose low bit is 0. NaN: +0.
  stochastic(v, u): lo <= min(|v|, 6) <= hi neighbours; hi if u < (|v| - lo) / (hi - lo).
  packing: element 2i in bits 3..0, element 2i + 1 in bits 7..4.
  MXFP4 block: NaN/Inf in the block -> (0xFF, all +0); else b = scale_byte(amax), codes of
      round_fp32(v * 2**(127 - b)).
  NVFP4: the op table of docs/fp4.md.
  Hadamard: H[i][j] = (-1)**popcount(i & j) (Sylvester), R = diag(s) H / 4.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mx_reference as mx

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
SIGN = 0x8
# E2M1 by its bit fields, for mx_reference's scale rules (emax = 2 from max 6, mantissa 1 bit).
E2M1_SPEC = mx.Fp8Spec("e2m1", 2, 1, 1, E2M1_MAX)
E4M3_SPEC = mx.E4M3
E4M3_MAX = 448.0
F32_MAX = (2.0 - 2.0**-23) * 2.0**127
NVFP4_BLOCK = 16
HADAMARD = 16

round_fp32 = mx.round_fp32


def e2m1_encode(v: float) -> int:
    """The code of v rounded to nearest (ties to even), saturating at +-6; NaN -> 0."""
    if math.isnan(v):
        return 0
    sign = SIGN if math.copysign(1.0, v) < 0 else 0
    m = min(abs(v), E2M1_MAX)
    code = min(range(len(E2M1_MAGNITUDES)), key=lambda c: (abs(E2M1_MAGNITUDES[c] - m), c & 1))
    return sign | code


def e2m1_decode(code: int) -> float:
    magnitude = E2M1_MAGNITUDES[code & 0x7]
    return -magnitude if code & SIGN else magnitude


def e2m1_stochastic(v: float, u: float) -> float:
    """v rounded stochastically with the draw u in [0, 1), saturating at +-6; NaN stays NaN."""
    if math.isnan(v):
        return v
    m = min(abs(v), E2M1_MAX)
    lo = max(g for g in E2M1_MAGNITUDES if g <= m)
    hi = min(g for g in E2M1_MAGNITUDES if g >= m)
    r = lo if lo == hi or not u < (m - lo) / (hi - lo) else hi
    return math.copysign(r, v)


def pack(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


def unpack(data: list[int]) -> list[int]:
    return [c for byte in data for c in (byte & 0xF, byte >> 4)]


# ---------------------------------------------------------------------------------------------
# MXFP4


def mxfp4_block(
    values: list[float], scale_mode: str, uniforms: list[float] | None = None
) -> tuple[int, list[int]]:
    """(E8M0 scale byte, codes) of one block; stochastic rounding where `uniforms` is given."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return mx.E8M0_NAN, [0] * len(values)
    byte = mx.scale_byte(max(abs(v) for v in values), E2M1_SPEC, scale_mode)
    scaled = [round_fp32(v * 2.0 ** (127 - byte)) for v in values]
    if uniforms is None:
        return byte, [e2m1_encode(s) for s in scaled]
    return byte, [e2m1_encode(e2m1_stochastic(s, u)) for s, u in zip(scaled, uniforms)]


def mxfp4_dequantize_block(byte: int, codes: list[int]) -> list[float]:
    if byte == mx.E8M0_NAN:
        return [math.nan] * len(codes)
    return [round_fp32(e2m1_decode(c) * 2.0 ** (byte - 127)) for c in codes]


# ---------------------------------------------------------------------------------------------
# NVFP4


def _div(a: float, b: float) -> float:
    """fp32 a / b (IEEE: x / 0 is +-inf for x != 0)."""
    if b == 0.0:
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return round_fp32(a / b)


def nvfp4_tensor_scales(amax: float) -> tuple[float, float]:
    """(S_enc, S_dec): S_enc = min(2688 / A, FLT_MAX), S_dec = 1 / S_enc; NaN if A is not finite."""
    if not math.isfinite(amax):
        return math.nan, math.nan
    encode = min(_div(E4M3_MAX * E2M1_MAX, amax), F32_MAX)
    return encode, _div(1.0, encode)


def e4m3_round(d: float) -> float:
    """d (|d| <= 448 or NaN) rounded to the E4M3 grid, nearest even."""
    return mx.fp8_decode(mx.fp8_encode(d, E4M3_SPEC), E4M3_SPEC)


def nvfp4_block_scale(block_amax: float, encode: float, decode: float) -> tuple[float, float]:
    """(s_b, e_b) of a block: s_b = E4M3(min(a_b * (S_enc * fp32(1/6)), 448)),
    e_b = min(1 / (s_b * S_dec), FLT_MAX)."""
    if math.isnan(encode):
        return math.nan, math.nan
    multiplier = round_fp32(encode * mx.to_fp32(1.0 / E2M1_MAX))
    d = min(round_fp32(block_amax * multiplier), E4M3_MAX)
    s = e4m3_round(d)
    return s, min(_div(1.0, round_fp32(s * decode)), F32_MAX)


def nvfp4_codes(
    values: list[float], block_encode: float, uniforms: list[float] | None = None
) -> list[int]:
    """The codes of one block's elements: E2M1(clamp(fp32(x * e_b), -6, 6))."""
    if math.isnan(block_encode):
        return [0] * len(values)
    scaled = [round_fp32(v * block_encode) for v in values]
    if uniforms is None:
        return [e2m1_encode(s) for s in scaled]
    return [e2m1_encode(e2m1_stochastic(s, u)) for s, u in zip(scaled, uniforms)]


def nvfp4_rows(
    rows: list[list[float]],
    *,
    block_2d: bool = False,
    uniforms: list[list[float]] | None = None,
) -> tuple[list[list[float]], list[list[int]], float]:
    """NVFP4 of a 2-D tensor given as rows, blocks of 16 along each row: (E4M3 block scales as
    values, codes, S_dec). With block_2d each block's amax is its 16x16 tile's."""
    flat = [v for row in rows for v in row]
    amax = math.nan if any(math.isnan(v) for v in flat) else max(abs(v) for v in flat)
    encode, decode = nvfp4_tensor_scales(amax)
    scales, codes = [], []
    for r, row in enumerate(rows):
        row_scales, row_codes = [], []
        for start in range(0, len(row), NVFP4_BLOCK):
            if block_2d:
                top = r - r % NVFP4_BLOCK
                tile = [v for rr in rows[top : top + NVFP4_BLOCK] for v in rr[start : start + NVFP4_BLOCK]]
            else:
                tile = row[start : start + NVFP4_BLOCK]
            block_amax = math.nan if any(math.isnan(v) for v in tile) else max(abs(v) for v in tile)
            s, e = nvfp4_block_scale(block_amax, encode, decode)
            u = None if uniforms is None else uniforms[r][start : start + NVFP4_BLOCK]
            row_scales.append(s)
            row_codes.extend(nvfp4_codes(row[start : start + NVFP4_BLOCK], e, u))
        scales.append(row_scales)
        codes.append(row_codes)
    return scales, codes, decode


def nvfp4_dequantize(scales: list[list[float]], codes: list[list[int]], decode: float) -> list[list[float]]:
    """(q * s_b) * S_dec per element (q * s_b exact)."""
    return [
        [round_fp32(e2m1_decode(c) * row_scales[i // NVFP4_BLOCK] * decode) for i, c in enumerate(row)]
        for row_scales, row in zip(scales, codes)
    ]


# ---------------------------------------------------------------------------------------------
# Random Hadamard transform


def hadamard_entry(i: int, j: int) -> int:
    """Sylvester's H[i][j] = (-1)**popcount(i & j)."""
    return -1 if bin(i & j).count("1") % 2 else 1


def rht_exact(block: list[float], signs: list[float]) -> list[Fraction]:
    """y_j = sum_i R[i][j] b_i with R = diag(s) H / 4, in exact rational arithmetic."""
    return [
        sum(Fraction(signs[i]) * hadamard_entry(i, j) * Fraction(block[i]) for i in range(HADAMARD)) / 4
        for j in range(HADAMARD)
    ]


def rht_fp32(block: list[float], signs: list[float]) -> list[float]:
    """The fp32 model of the transform's op order: signs, butterflies with strides 1, 2, 4, 8
    ((a, b) -> (a + b, a - b), each rounded to fp32), then * 1/4 (rounded)."""
    v = [s * b for s, b in zip(signs, block)]
    stride = 1
    while stride < HADAMARD:
        for start in range(0, HADAMARD, 2 * stride):
            for i in range(start, start + stride):
                a, b = v[i], v[i + stride]
                v[i], v[i + stride] = round_fp32(a + b), round_fp32(a - b)
        stride *= 2
    return [round_fp32(x * 0.25) for x in v]
