"""An independent, pure-Python model of MX quantization, written from the definitions only.

Nothing here imports mxcompile or uses torch arithmetic: scale bytes come from exact Python
float (binary64) arithmetic and `math.frexp`, and FP8 elements from a hand-written
round-to-nearest-even encoder. Input values are Python floats holding the exact value of a
bf16 / fp16 / fp32 element (binary64 represents every one of them exactly).

Definitions (the spec the tests check mxcompile against):
  scale byte b encodes 2**(b - 127); byte 0xFF is NaN.
  floor: clamp(fp32_biased_exponent(amax) - emax, 0, 254)
  ceil:  clamp(ceil(log2(amax)) + 127 - emax, 0, 254)
  even:  amax rounded half-up to the element's mantissa width, then floor(log2) + 127 - emax
  rceil: descale = fp32(amax * fp32(1 / max_elem)); clamp(ceil(log2(descale)) + 127, 0, 254)
  element: RNE(x * 2**(127 - b)), saturating at +-max_elem.
  A block holding a NaN or an Inf: scale 0xFF and every element the positive NaN byte 0x7F.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

E8M0_NAN = 0xFF
FP8_NAN_BYTE = 0x7F
F32_MIN_NORMAL_EXP = -126


@dataclass(frozen=True)
class Fp8Spec:
    """An FP8 element format described by its bit fields only."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_normal: float

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max_normal."""
        return math.frexp(self.max_normal)[1] - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias


E4M3 = Fp8Spec("e4m3", 4, 3, 7, 448.0)
E5M2 = Fp8Spec("e5m2", 5, 2, 15, 57344.0)
FP8_SPECS = {s.name: s for s in (E4M3, E5M2)}

SCALE_MODES = ("floor", "rceil", "ceil", "even")


def to_fp32(value: float) -> float:
    """Round a binary64 value to the nearest binary32 value (RNE, subnormals kept)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


# Values at or above this round (RNE) to infinity in fp32: fp32 max plus half an ulp.
F32_OVERFLOW_THRESHOLD = (2.0 - 2.0**-24) * 2.0**127


def round_fp32(value: float) -> float:
    """Like `to_fp32`, but overflowing to +-inf as IEEE rounding does (struct.pack raises).

    An MX value can exceed fp32's range: with a scale of 2**120 and an element of 256 (what
    rceil, ceil and even give for an input at bf16's or fp32's max) the block represents
    2**128, which dequantizes to inf in fp32.
    """
    if not math.isfinite(value):
        return value
    if abs(value) >= F32_OVERFLOW_THRESHOLD:
        return math.copysign(math.inf, value)
    return to_fp32(value)


def floor_log2(value: float) -> int:
    """floor(log2(value)) for a finite positive float, exact (no libm log)."""
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent - 1


def ceil_log2(value: float) -> int:
    """ceil(log2(value)) for a finite positive float, exact."""
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else exponent


def _clamp_byte(biased: int) -> int:
    return min(max(biased, 0), 254)


def scale_byte(amax: float, fmt: Fp8Spec, scale_mode: str) -> int:
    """The E8M0 scale byte of a block whose largest magnitude is `amax` (an fp32 value)."""
    if math.isnan(amax) or math.isinf(amax):
        return E8M0_NAN
    if scale_mode == "rceil":
        descale = to_fp32(amax * to_fp32(1.0 / fmt.max_normal))  # product exact in binary64
        if descale == 0.0:
            return 0
        return _clamp_byte(ceil_log2(descale) + 127)
    if amax == 0.0:
        return 0
    if scale_mode == "floor":
        # The fp32 biased exponent field: 0 for fp32 subnormals, else floor(log2) + 127.
        exponent = floor_log2(amax)
        biased = 0 if exponent < F32_MIN_NORMAL_EXP else exponent + 127
        return _clamp_byte(biased - fmt.emax)
    if scale_mode == "ceil":
        if amax < 2.0**F32_MIN_NORMAL_EXP:
            return 0  # ceil(log2(amax)) + 127 - emax <= 1 - emax < 0
        return _clamp_byte(ceil_log2(amax) + 127 - fmt.emax)
    if scale_mode == "even":
        if amax < 2.0**F32_MIN_NORMAL_EXP:
            return 0
        exponent = floor_log2(amax)
        quantum = 2.0 ** (exponent - fmt.mantissa_bits)
        # Half-up rounding of amax to mantissa_bits fraction bits (exact in binary64).
        rounded = math.floor(amax / quantum + 0.5) * quantum
        return _clamp_byte(floor_log2(rounded) + 127 - fmt.emax)
    raise ValueError(f"unknown scale_mode {scale_mode!r}")


def round_half_even(value: float) -> int:
    """Round a non-negative binary64 value to the nearest integer, ties to even."""
    floor = math.floor(value)
    frac = value - floor
    if frac > 0.5 or (frac == 0.5 and floor % 2 == 1):
        return floor + 1
    return floor


def fp8_encode(value: float, fmt: Fp8Spec) -> int:
    """The FP8 byte of RNE(value) with saturation at +-max_normal; NaN gives 0x7F."""
    if math.isnan(value):
        return FP8_NAN_BYTE
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    magnitude = min(abs(value), fmt.max_normal)
    if magnitude == 0.0:
        return sign
    exponent = max(floor_log2(magnitude), fmt.emin)  # subnormals share the emin quantum
    quantum = 2.0 ** (exponent - fmt.mantissa_bits)
    rounded = round_half_even(magnitude / quantum) * quantum
    rounded = min(rounded, fmt.max_normal)
    if rounded == 0.0:
        return sign
    exponent = floor_log2(rounded)
    if exponent < fmt.emin:  # subnormal: exponent field 0
        field, mantissa = 0, int(rounded / 2.0 ** (fmt.emin - fmt.mantissa_bits))
    else:
        field = exponent + fmt.bias
        mantissa = int((rounded / 2.0**exponent - 1.0) * 2**fmt.mantissa_bits)
    return sign | (field << fmt.mantissa_bits) | mantissa


def fp8_decode(byte: int, fmt: Fp8Spec) -> float:
    """The value of an FP8 byte (NaN for the NaN encodings; e5m2 also has +-Inf)."""
    sign = -1.0 if byte & 0x80 else 1.0
    field = (byte >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    mantissa = byte & ((1 << fmt.mantissa_bits) - 1)
    all_ones = (1 << fmt.exponent_bits) - 1
    if fmt.name == "e4m3" and field == all_ones and mantissa == (1 << fmt.mantissa_bits) - 1:
        return math.nan
    if fmt.name == "e5m2" and field == all_ones:
        return math.nan if mantissa else sign * math.inf
    if field == 0:
        return sign * mantissa * 2.0 ** (fmt.emin - fmt.mantissa_bits)
    return sign * (1.0 + mantissa / 2**fmt.mantissa_bits) * 2.0 ** (field - fmt.bias)


def quantize_block(values: list[float], fmt: Fp8Spec, scale_mode: str) -> tuple[int, list[int]]:
    """(scale byte, element bytes) of one block."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return E8M0_NAN, [FP8_NAN_BYTE] * len(values)
    amax = max(abs(v) for v in values)
    byte = scale_byte(amax, fmt, scale_mode)
    inverse_scale = 2.0 ** (127 - byte)
    return byte, [fp8_encode(v * inverse_scale, fmt) for v in values]


def dequantize_block(byte: int, data: list[int], fmt: Fp8Spec) -> list[float]:
    """The exact values a block represents (all NaN when the scale byte is 0xFF)."""
    if byte == E8M0_NAN:
        return [math.nan] * len(data)
    scale = 2.0 ** (byte - 127)
    return [fp8_decode(d, fmt) * scale for d in data]


def quantize_rows(
    rows: list[list[float]], fmt: Fp8Spec, scale_mode: str, block_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Quantize each row in blocks of `block_size` consecutive elements: (scales, data)."""
    scales, data = [], []
    for row in rows:
        row_scales, row_data = [], []
        for start in range(0, len(row), block_size):
            byte, elements = quantize_block(row[start : start + block_size], fmt, scale_mode)
            row_scales.append(byte)
            row_data.extend(elements)
        scales.append(row_scales)
        data.append(row_data)
    return scales, data


# ---------------------------------------------------------------------------------------------
# Test data: named special blocks. torch is used here only for the input dtypes' constants
# (torch.finfo), never for arithmetic.

BLOCK = 32


def _mantissa_bits(dtype: torch.dtype) -> int:
    return -math.frexp(torch.finfo(dtype).eps)[1] + 1


def _next_up(value: float, dtype: torch.dtype) -> float:
    """The next larger value of `dtype` after a positive normal `value`."""
    return value + 2.0 ** (floor_log2(value) - _mantissa_bits(dtype))


def _next_down(value: float, dtype: torch.dtype) -> float:
    """The next smaller value of `dtype` before a positive normal `value`."""
    exponent = floor_log2(value)
    if value == 2.0**exponent:
        exponent -= 1  # the gap below a power of two is the finer one of the binade below
    return value - 2.0 ** (exponent - _mantissa_bits(dtype))


def pad_block(values: list[float], fill: float = 0.0) -> list[float]:
    assert len(values) <= BLOCK
    return values + [fill] * (BLOCK - len(values))


def _with_companions(amax: float) -> list[float]:
    """A block whose largest magnitude is `amax`, with smaller elements of both signs spread
    over many octaves below it (they exercise rounding, subnormals and underflow)."""
    fractions = [1.0, -0.75, 0.5, -0.3, 0.126, -0.0625, 0.01, -1e-3, 3e-5, -2e-7, 0.999, -0.51]
    return pad_block([amax * f for f in fractions])


def special_cases(dtype: torch.dtype) -> list[tuple[str, list[float]]]:
    """Named blocks of BLOCK finite-or-special values, all exactly representable in dtype
    (rounding on conversion can only move a companion value, never the block's amax)."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal
    smallest_sub = tiny * info.eps
    big = info.max
    nan, inf = math.nan, math.inf
    cases: list[tuple[str, list[float]]] = [
        ("zeros", pad_block([])),
        ("signed_zeros", [0.0, -0.0] * (BLOCK // 2)),
        ("smallest_normal", pad_block([tiny, -tiny])),
        ("smallest_normal_with_subnormals", pad_block([tiny, -tiny / 2, tiny / 4, -smallest_sub])),
        ("smallest_subnormal", pad_block([smallest_sub, -smallest_sub])),
        ("neg_smallest_subnormal_neg_zeros", pad_block([-smallest_sub], -0.0)),
        ("inf_in_block", pad_block([1.0, inf, -2.0])),
        ("neg_inf_in_block", pad_block([-inf, 3.0])),
        ("nan_in_block", pad_block([1.0, -3.0, nan, 0.5])),
        ("all_nan", [nan] * BLOCK),
        ("pm448", pad_block([448.0, -448.0, 1.0, -1.0, 0.5])),
        ("pm_dtype_max", pad_block([big, -big, 1.0, -1.0])),
        ("between_448_and_512", pad_block([450.0, -480.0, 500.0, 510.0, -449.0, 1.0])),
        ("neg_510_alone", pad_block([-510.0])),
        ("e5m2_saturation", pad_block([60000.0, -59000.0, 1.0])),
        ("pm57344", pad_block([57344.0, -57344.0, 2.0])),
        # Underflow inside a block: tiny elements next to a large one flush to zeros that keep
        # their sign; the values at and just above half the smallest subnormal check the tie.
        (
            "mixed_underflow_sign_kept",
            pad_block([1024.0, 2.0**-20, -(2.0**-20), 2.0**-30, -(2.0**-30), -0.0, 0.0, 2.0**-8,
                  -(2.0**-8), 1.5 * 2.0**-8, -1.5 * 2.0**-8, 2.0**-7, -3 * 2.0**-8]),
        ),
        # Ties of round-to-nearest-even at scale 1 (amax 256 gives scale byte 127 in every
        # e4m3 mode): 1.0625 -> 1.0, 1.1875 -> 1.25, 2**-10 -> 0, 3 * 2**-10 -> 2**-8.
        ("rne_ties", pad_block([256.0, 1.0625, -1.1875, 2.0**-10, -3 * 2.0**-10, 9.0, -11.0, 208.0])),
        ("wide_dynamic_range", pad_block([2.0**100, -(2.0**-100), 2.0**60, 1.0])),
    ]
    if dtype != torch.float16:
        # Below fp16's range: the documented example (scale byte 0, data 2**-6) and blocks whose
        # amax is an fp32 subnormal.
        cases += [
            ("two_pow_minus_133", pad_block([2.0**-133])),
            ("fp32_subnormal_amax", pad_block([2.0**-127, -(2.0**-130), 2.0**-133])),
            ("fp32_subnormal_amax_odd", pad_block([3 * 2.0**-128, -(2.0**-129)])),
        ]
    # Just above and below powers of two, and at the rounding boundaries of each mode: these
    # separate floor (log2 rounded down), ceil (rounded up), even (amax rounded to the element
    # mantissa first) and rceil (amax / max_elem rounded up to a power of two).
    for exponent in (-3, 0, 8, 20):
        p = 2.0**exponent
        for name, amax in (
            ("pow2", p),
            ("pow2_up", _next_up(p, dtype)),
            ("pow2_down", _next_down(p, dtype)),
            ("even_e4m3_tie", 1.9375 * p),  # half-way between 1.875 and 2 at 3 mantissa bits
            ("even_e4m3_below_tie", _next_down(1.9375 * p, dtype)),
            ("even_e5m2_tie", 1.875 * p),  # half-way between 1.75 and 2 at 2 mantissa bits
            ("even_e5m2_below_tie", _next_down(1.875 * p, dtype)),
            ("rceil_e4m3", 448.0 * p / 256),
            ("rceil_e4m3_up", _next_up(448.0 * p / 256, dtype)),
            ("rceil_e4m3_down", _next_down(448.0 * p / 256, dtype)),
            ("rceil_e5m2", 57344.0 * p / 2**15),
            ("rceil_e5m2_up", _next_up(57344.0 * p / 2**15, dtype)),
            ("rceil_e5m2_down", _next_down(57344.0 * p / 2**15, dtype)),
        ):
            if amax < info.max:
                cases.append((f"{name}_2^{exponent}", _with_companions(amax)))
    # rceil at the bottom of the E8M0 range: descales of exactly 2**-127 (scale byte 0) and
    # 2**-126 (byte 1) are fp32 subnormal / smallest normal; the neighbours round up past them.
    for elem_max in (448.0, 57344.0):
        for exponent in (-127, -126):
            amax = elem_max * 2.0**exponent
            if amax >= tiny:
                for name, value in (
                    ("", amax), ("_up", _next_up(amax, dtype)), ("_down", _next_down(amax, dtype))
                ):
                    cases.append((f"rceil_{elem_max:g}_descale_2^{exponent}{name}", pad_block([value])))
    return cases
