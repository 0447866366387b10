"""Shared template pieces: the element-format constants and the `@triton.jit` helpers that turn
fp32 blocks into E8M0 scale bytes and FP8 bytes, rendered for one (element format, scale mode,
cast) variant.

The helpers restate, in Triton on fp32 bit patterns, the rules of `mxcompile.numerics.scales`
and `mxcompile.numerics.quantize.quantize_last_axis` (the single definition of MX numerics);
the tests check them bit for bit against those functions.
"""

from __future__ import annotations

import re

import torch

from ..numerics.formats import (
    E8M0_BIAS,
    E8M0_MAX_BYTE,
    E8M0_NAN,
    F32_MANTISSA_BITS,
    ElemFormat,
    ScaleMode,
)
from .render import indent, render

# Triton element type and dot_scaled format name of each MX element format.
TRITON_FP8_TYPES: dict[str, str] = {"e4m3": "tl.float8e4nv", "e5m2": "tl.float8e5"}
DOT_SCALED_FORMATS: dict[str, str] = {"e4m3": "e4m3", "e5m2": "e5m2"}

TORCH_TO_TRITON: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
}

# Cast strategies for fp32 -> FP8 after the clamp (both round to nearest even):
#   "software": integer arithmetic on the fp32 bits. Exact everywhere; required under
#               TRITON_INTERPRET=1, whose fp32->fp8 conversion (triton 3.9) rounds ties away
#               and drops the mantissa carry into the exponent.
#   "hardware": `x.to(fp8, fp_downcast_rounding="rtne")` (cvt.rn.satfinite on sm89+). Faster;
#               check it with `benchmarks/gpu_kernels.py --check` on a GPU before relying on it.
CAST_MODES = ("software", "hardware")


def exponent_bias(fmt: ElemFormat) -> int:
    """IEEE-style exponent bias of an FP8 format (7 for E4M3, 15 for E5M2)."""
    exponent_bits = 7 - fmt.mantissa_bits
    return (1 << (exponent_bits - 1)) - 1


# The constants are rendered into the helpers as literals: the Triton 3.9 interpreter cannot do
# Python arithmetic on module-level `tl.constexpr` globals. This header documents them.
_CONSTANTS = """\
# Element format ${name} (${torch_dtype}); E8M0 scales; scale mode ${mode}; ${cast} fp32->fp8 cast.
#   ELEM_MAX=${ELEM_MAX} ELEM_EMAX=${ELEM_EMAX} ELEM_MANTISSA_BITS=${ELEM_MANTISSA_BITS}
#   ELEM_EXP_BIAS=${ELEM_EXP_BIAS} ELEM_NAN_BYTE=${ELEM_NAN_BYTE}
#   ELEM_RECIPROCAL_MAX=${ELEM_RECIPROCAL_MAX} (fp32(1 / ELEM_MAX), exact in fp32)
#   E8M0_BIAS=${E8M0_BIAS} E8M0_MAX_BYTE=${E8M0_MAX_BYTE} E8M0_NAN=${E8M0_NAN}
"""

# Scale rules: each sets `biased` (int32) from `amax` (fp32 >= 0) and its bits `amax_bits`.
_SCALE_RULES: dict[ScaleMode, str] = {
    ScaleMode.RCEIL: """\
# rceil: descale = amax * fp32(1/max), rounded up to a power of two.
descale_bits = (amax * ${ELEM_RECIPROCAL_MAX}).to(tl.int32, bitcast=True)
exponent = (descale_bits >> ${F32_MANTISSA_BITS}) & 0xFF
mantissa = descale_bits & 0x7FFFFF
normal = exponent + (mantissa != 0).to(tl.int32)
# A subnormal descale rounds up to 2**-126 (byte 1) only when it exceeds 2**-127.
subnormal = (mantissa > 0x400000).to(tl.int32)
biased = tl.where(exponent == 0, subnormal, normal)
""",
    ScaleMode.FLOOR: """\
# floor: floor(log2(amax)) - emax.
exponent = (amax_bits >> ${F32_MANTISSA_BITS}) & 0xFF
biased = exponent - ${ELEM_EMAX}
""",
    ScaleMode.CEIL: """\
# ceil: ceil(log2(amax)) - emax.
exponent = (amax_bits >> ${F32_MANTISSA_BITS}) & 0xFF
mantissa = amax_bits & 0x7FFFFF
biased = exponent + (mantissa != 0).to(tl.int32) - ${ELEM_EMAX}
""",
    ScaleMode.EVEN: """\
# even: round amax half-up to the element's mantissa width (a carry bumps the exponent),
# then floor(log2) - emax.
rounded_bits = amax_bits + (1 << (${F32_MANTISSA_BITS} - ${ELEM_MANTISSA_BITS} - 1))
exponent = (rounded_bits >> ${F32_MANTISSA_BITS}) & 0xFF
biased = exponent - ${ELEM_EMAX}
""",
}

_CASTS: dict[str, str] = {
    "hardware": """\
return x.to($fp8_type, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
""",
    "software": """\
# Round-to-nearest-even on the fp32 bits; |x| <= ${ELEM_MAX}, so the result never overflows.
bits = x.to(tl.int32, bitcast=True)
sign = (bits >> 31) & 1
exponent = (bits >> ${F32_MANTISSA_BITS}) & 0xFF
# 24-bit significand with its implicit bit; an fp32 subnormal has exponent 1 and no implicit bit.
significand = (bits & 0x7FFFFF) | ((exponent > 0).to(tl.int32) << ${F32_MANTISSA_BITS})
unbiased = tl.maximum(exponent, 1) - 127
# Bits to drop: the mantissa difference, plus the distance below the FP8 normal range.
below = tl.maximum(1 - ${ELEM_EXP_BIAS} - unbiased, 0)
shift = tl.minimum(${F32_MANTISSA_BITS} - ${ELEM_MANTISSA_BITS} + below, 30)
kept = significand >> shift
rest = significand & ((1 << shift) - 1)
half = 1 << (shift - 1)
round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
kept = kept + round_up.to(tl.int32)
# Normal results: (biased exponent - 1) * 2**m + kept, where kept carries the implicit bit,
# so a rounding carry moves into the exponent field. Subnormal results: kept alone.
base = tl.maximum(unbiased + ${ELEM_EXP_BIAS} - 1, 0) << ${ELEM_MANTISSA_BITS}
return (sign << 7) | (base + kept)
""",
}

# The helpers and kernels call no `@jit` function of triton.language.standard (tl.max, tl.sum,
# tl.zeros, tl.cdiv, tl.sigmoid are decorated when triton is imported, so they are compiled-mode
# functions in a process that imported triton before setting TRITON_INTERPRET=1, and an
# interpreted kernel cannot call them). Reductions are `tl.reduce` with the standard library's
# own combine functions, the ones tl.max and tl.sum use: the interpreter recognises those and
# reduces with numpy (it runs any other combine function element by element in Python, ~30x
# slower). The fallbacks below serve a Triton without those private names.
_HELPERS = """\
@triton.jit
def _mx_max_combine_fallback(a, b):
    return tl.maximum(a, b)


@triton.jit
def _mx_sum_combine_fallback(a, b):
    return a + b


_mx_max_combine = getattr(tl.standard, "_elementwise_max", None) or _mx_max_combine_fallback
_mx_sum_combine = getattr(tl.standard, "_sum_combine", None) or _mx_sum_combine_fallback


@triton.jit
def _mx_scale_bytes(amax, nonfinite):
    \"\"\"E8M0 scale byte (int32) of each block from its fp32 amax; ${E8M0_NAN} where the block
    holds a NaN or an Inf (`nonfinite`), else clamped to [0, ${E8M0_MAX_BYTE}].\"\"\"
    amax_bits = amax.to(tl.int32, bitcast=True)
$scale_rule
    biased = tl.minimum(tl.maximum(biased, 0), ${E8M0_MAX_BYTE})
    return tl.where(nonfinite, ${E8M0_NAN}, biased)


@triton.jit
def _mx_inverse_scale(scale_bytes):
    \"\"\"fp32 2**(127 - b) of each scale byte (2**-127, an fp32 subnormal, for b = 254).\"\"\"
    bits = tl.where(
        scale_bytes == ${E8M0_MAX_BYTE},
        1 << (${F32_MANTISSA_BITS} - 1),
        (2 * ${E8M0_BIAS} - scale_bytes) << ${F32_MANTISSA_BITS},
    )
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_scale_fp32(scale_bytes):
    \"\"\"fp32 2**(b - 127) of each scale byte (2**-127 for b = 0, NaN for b = 255).\"\"\"
    b = scale_bytes.to(tl.int32)
    bits = tl.where(b == 0, 1 << (${F32_MANTISSA_BITS} - 1), b << ${F32_MANTISSA_BITS})
    bits = tl.where(b == ${E8M0_NAN}, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_cast_fp8_bytes(x):
    \"\"\"FP8 byte (int32) of each fp32 value, already clamped to [-${ELEM_MAX}, ${ELEM_MAX}].\"\"\"
$cast


@triton.jit
def _mx_quantize_blocks(x, AXIS: tl.constexpr):
    \"\"\"Quantize fp32 `x` in blocks along `AXIS` (a block per index of the other axes).

    Returns (FP8 bytes of x's shape, scale bytes with AXIS reduced), both uint8.
    \"\"\"
    # Phase 1: block amax, and non-finite blocks found with an integer test on the bits:
    # Triton's max may drop NaN, so it cannot be trusted to propagate one.
    bits = x.to(tl.int32, bitcast=True)
    amax = tl.reduce(tl.abs(x), AXIS, _mx_max_combine)
    nonfinite_lanes = ((bits & 0x7FFFFFFF) >= 0x7F800000).to(tl.int32)
    nonfinite = tl.reduce(nonfinite_lanes, AXIS, _mx_max_combine) > 0
    # Phase 2: the E8M0 scale byte of each block.
    scale = _mx_scale_bytes(amax, nonfinite)
    # Phase 3: scale (exact power of two), clamp (makes the cast saturating), cast.
    scaled = x * tl.expand_dims(_mx_inverse_scale(scale), AXIS)
    scaled = tl.minimum(tl.maximum(scaled, -${ELEM_MAX}), ${ELEM_MAX})
    data = _mx_cast_fp8_bytes(scaled)
    # Every element of a NaN block is the format's positive NaN byte.
    data = tl.where(tl.expand_dims(nonfinite, AXIS), ${ELEM_NAN_BYTE}, data)
    return data.to(tl.uint8), scale.to(tl.uint8)
"""


def mx_constants(fmt: ElemFormat) -> dict[str, str]:
    """The literal values substituted for the constants of the helper templates."""
    return {
        "ELEM_MAX": repr(fmt.max_normal),
        "ELEM_EMAX": str(fmt.emax),
        "ELEM_MANTISSA_BITS": str(fmt.mantissa_bits),
        "ELEM_EXP_BIAS": str(exponent_bias(fmt)),
        "ELEM_NAN_BYTE": hex(fmt.nan_byte),
        "ELEM_RECIPROCAL_MAX": repr(fmt.reciprocal_max_fp32),
        "E8M0_BIAS": str(E8M0_BIAS),
        "E8M0_MAX_BYTE": hex(E8M0_MAX_BYTE),
        "E8M0_NAN": hex(E8M0_NAN),
        "F32_MANTISSA_BITS": str(F32_MANTISSA_BITS),
    }


_HELPER_NAME = re.compile(r"\b(_mx_[a-z0-9_]+)\b")


def render_mx_helpers(fmt: ElemFormat, mode: ScaleMode, cast: str, *, suffix: str = "") -> str:
    """A comment naming the variant's constants, then its `@triton.jit` helpers. `suffix` is
    appended to every helper name (`_mx_quantize_blocks` -> `_mx_quantize_blocks<suffix>`), so
    that one module can hold the helpers of two element formats."""
    if suffix and not suffix.isidentifier():
        raise ValueError(f"suffix={suffix!r} must be an identifier tail")
    if cast not in CAST_MODES:
        raise ValueError(f"cast={cast!r} is not accepted; use one of {list(CAST_MODES)}")
    consts = mx_constants(fmt)
    header = render(
        _CONSTANTS, consts, name=fmt.name, torch_dtype=str(fmt.dtype), mode=mode.value, cast=cast
    )
    cast_params = {"fp8_type": TRITON_FP8_TYPES[fmt.name]} if cast == "hardware" else {}
    cast_code = render(_CASTS[cast], consts, **cast_params)
    scale_rule = render(_SCALE_RULES[mode], consts)
    helpers = render(_HELPERS, consts, scale_rule=indent(scale_rule, 4), cast=indent(cast_code, 4))
    if suffix:
        helpers = _HELPER_NAME.sub(lambda m: m.group(1) + suffix, helpers)
    return header + "\n\n" + helpers


# A header shared by every rendered module.
MODULE_HEADER = """\
# Generated by mxcompile.triton_templates from a template; do not edit.
# Specialisation: $key
import triton
import triton.language as tl

"""
