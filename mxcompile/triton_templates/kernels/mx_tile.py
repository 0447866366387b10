"""Shared `@triton.jit` helpers: MX quantization of a tile (E8M0 scale bytes, FP8 bytes), the
load of an MX operand tile expanded exactly for a bf16 MMA (`load_mx_tile`), MX rounding in
registers (`mx_round`), row-masked tile loads, the online-softmax step, and the named constants.

The helpers restate, in Triton on fp32 bit patterns, the rules of `mxcompile.numerics.scales`
and `mxcompile.numerics.quantize` (the single definition of MX numerics); the tests check them
bit for bit against those functions. The element format, scale mode and cast are `tl.constexpr`
strings ("e4m3"/"e5m2", a `ScaleMode` value, "software"/"hardware"); the per-format constants
come from `mxcompile.numerics.formats` through `triton.constexpr_function`s, evaluated when a
kernel is specialised.

Interpreter notes (TRITON_INTERPRET=1, Triton 3.9):
  * a Python int on the left of `<<` with a `tl.constexpr` on the right fails there, so the
    constants such shifts would build are computed in Python (`F32_SMALLEST_SUBNORMAL_BITS`, ...);
  * no `@jit` function of triton.language.standard is called (tl.max, tl.sum, tl.zeros, tl.cdiv
    are decorated when triton is imported, so they are compiled-mode functions in a process that
    imported triton before setting TRITON_INTERPRET=1, and an interpreted kernel cannot call
    them). Reductions are `tl.reduce` with the standard library's own combine functions, the
    ones tl.max and tl.sum use: the interpreter recognises those and reduces with numpy (it runs
    any other combine function element by element in Python, ~30x slower). The fallbacks below
    serve a Triton without those private names.
"""

import math

import triton
import triton.language as tl

from mxcompile.numerics import formats
from mxcompile.triton_templates.common import exponent_bias

# fp32 and E8M0 bit-level constants.
F32_MANTISSA_BITS: tl.constexpr = tl.constexpr(formats.F32_MANTISSA_BITS)
F32_MANTISSA_MASK: tl.constexpr = tl.constexpr(formats.F32_MANTISSA_MASK)
F32_EXPONENT_MASK: tl.constexpr = tl.constexpr(formats.F32_EXPONENT_MASK)
F32_EXPONENT_BIAS: tl.constexpr = tl.constexpr(127)
F32_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
F32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)  # the smallest non-finite |x| bits
F32_QUIET_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
F32_EXPONENT_FIELD: tl.constexpr = tl.constexpr(formats.F32_EXPONENT_MASK << formats.F32_MANTISSA_BITS)
F32_SIGN_BIT: tl.constexpr = tl.constexpr(-(1 << 31))  # 0x80000000 as an int32
# 2**-127 (an fp32 subnormal): the mantissa's top bit alone.
F32_SMALLEST_SCALE_BITS: tl.constexpr = tl.constexpr(1 << (formats.F32_MANTISSA_BITS - 1))
# bf16's mantissa width, and its 2**-127 (a subnormal: the mantissa's top bit alone).
_BF16_MANTISSA_BITS = 7
_BF16_SMALLEST_SCALE_BITS = 1 << (_BF16_MANTISSA_BITS - 1)
BF16_MANTISSA_BITS: tl.constexpr = tl.constexpr(_BF16_MANTISSA_BITS)
BF16_SMALLEST_SCALE_BITS: tl.constexpr = tl.constexpr(_BF16_SMALLEST_SCALE_BITS)
# Bits to drop, at most, when rounding an fp32 significand (keeps the shift below 31).
F32_MAX_ROUNDING_SHIFT: tl.constexpr = tl.constexpr(30)
BYTE_BITS: tl.constexpr = tl.constexpr(8)
BYTE_MASK: tl.constexpr = tl.constexpr(0xFF)
E8M0_BIAS: tl.constexpr = tl.constexpr(formats.E8M0_BIAS)
E8M0_MAX_BYTE: tl.constexpr = tl.constexpr(formats.E8M0_MAX_BYTE)
E8M0_NAN: tl.constexpr = tl.constexpr(formats.E8M0_NAN)
E8M0_ONE: tl.constexpr = tl.constexpr(formats.E8M0_BIAS)  # the scale byte of 1.0

# Softmax in base 2: exp(x) = 2**(x * LOG2E); ln(y) = log2(y) * LN2.
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


# Per-element-format constants, from the numerics core, folded when a kernel is specialised.
# (Triton lets a constexpr_function read global values, not call plain Python functions: the
# tables are built here, at import.)
_FORMATS = {fmt.name: fmt for fmt in (formats.E4M3, formats.E5M2)}
_EXPONENT_BIAS = {name: exponent_bias(fmt) for name, fmt in _FORMATS.items()}
_FP8_TYPES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_DOT_TYPES = {"bf16": tl.bfloat16, "fp32": tl.float32}
_SCALE_MODES = tuple(scale_mode.value for scale_mode in formats.ScaleMode)


@triton.constexpr_function
def elem_max(elem):
    return _FORMATS[elem].max_normal


@triton.constexpr_function
def elem_reciprocal_max(elem):
    """fp32(1 / max_normal), exact in fp32 (the rceil rule's multiplier)."""
    return _FORMATS[elem].reciprocal_max_fp32


@triton.constexpr_function
def elem_emax(elem):
    return _FORMATS[elem].emax


@triton.constexpr_function
def elem_mantissa_bits(elem):
    return _FORMATS[elem].mantissa_bits


@triton.constexpr_function
def elem_dropped_bits(elem):
    """fp32 mantissa bits an FP8 normal drops."""
    return formats.F32_MANTISSA_BITS - _FORMATS[elem].mantissa_bits


@triton.constexpr_function
def elem_min_normal_exponent(elem):
    """Unbiased exponent of the format's smallest normal (1 - bias)."""
    return 1 - _EXPONENT_BIAS[elem]


@triton.constexpr_function
def elem_exponent_bias(elem):
    return _EXPONENT_BIAS[elem]


@triton.constexpr_function
def elem_nan_byte(elem):
    return _FORMATS[elem].nan_byte


@triton.constexpr_function
def even_rounding_increment(elem):
    """Half a unit in the last place of the format's mantissa, on fp32 bits (scale mode even)."""
    return 1 << (formats.F32_MANTISSA_BITS - _FORMATS[elem].mantissa_bits - 1)


@triton.constexpr_function
def fp8_type(elem):
    return _FP8_TYPES[elem]


@triton.constexpr_function
def elem_min_normal_field(elem):
    """fp32 exponent field (bits) of the format's smallest normal."""
    return (1 - _EXPONENT_BIAS[elem] + 127) << formats.F32_MANTISSA_BITS


@triton.constexpr_function
def elem_magic_offset(elem):
    """Added to an exponent field: the power of two whose fp32 ulp is 2**-mantissa_bits of it."""
    return (formats.F32_MANTISSA_BITS - _FORMATS[elem].mantissa_bits) << formats.F32_MANTISSA_BITS


@triton.constexpr_function
def dot_type(name):
    """The MMA operand dtype: "bf16" on a GPU (exact for MX operands, see `load_mx_tile`);
    "fp32" under the interpreter, whose bf16 dot multiplies the uint16 bit patterns."""
    return _DOT_TYPES[name]


@triton.jit
def _max_combine_fallback(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine_fallback(a, b):
    return a + b


@triton.jit
def nan_max_combine(a, b):
    """The maximum of two floats, NaN if either is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


max_combine = getattr(tl.standard, "_elementwise_max", None) or _max_combine_fallback
sum_combine = getattr(tl.standard, "_sum_combine", None) or _sum_combine_fallback


@triton.constexpr_function
def is_scale_mode(name):
    return name in _SCALE_MODES


@triton.jit
def _exponent_and_mantissa(bits):
    """The biased exponent and the mantissa fields of fp32 bit patterns."""
    return (bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK, bits & F32_MANTISSA_MASK


@triton.jit
def scale_bytes(amax, nonfinite, ELEM: tl.constexpr, SCALE_MODE: tl.constexpr):
    """E8M0 scale byte (int32) of each block from its fp32 amax; E8M0_NAN where the block holds
    a NaN or an Inf (`nonfinite`), else clamped to [0, E8M0_MAX_BYTE]."""
    tl.static_assert(is_scale_mode(SCALE_MODE), "SCALE_MODE: rceil, floor, ceil or even")
    if SCALE_MODE == "rceil":
        # rceil: descale = amax * fp32(1/max), rounded up to a power of two.
        descale_bits = (amax * elem_reciprocal_max(ELEM)).to(tl.uint32, bitcast=True)
        rounded_up = tl.minimum(descale_bits + F32_MANTISSA_MASK, 2 * descale_bits - 1)
        biased = tl.minimum((rounded_up >> F32_MANTISSA_BITS).to(tl.int32), E8M0_MAX_BYTE)
    else:
        # floor, ceil, even: floor(log2(amax)) - emax, where even first rounds amax half-up to
        # the element's mantissa width (a carry bumps the exponent) and ceil rounds log2 up.
        bits = amax.to(tl.int32, bitcast=True)
        if SCALE_MODE == "even":
            bits = bits + even_rounding_increment(ELEM)
        exponent, mantissa = _exponent_and_mantissa(bits)
        if SCALE_MODE == "ceil":
            exponent = exponent + (mantissa != 0).to(tl.int32)
        biased = tl.minimum(tl.maximum(exponent - elem_emax(ELEM), 0), E8M0_MAX_BYTE)
    return tl.where(nonfinite, E8M0_NAN, biased)


@triton.jit
def inverse_scale(scale_bytes):
    """fp32 2**(127 - b) of each scale byte (2**-127, an fp32 subnormal, for b = 254)."""
    bits = tl.maximum((2 * E8M0_BIAS - scale_bytes) << F32_MANTISSA_BITS, F32_SMALLEST_SCALE_BITS)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_fp32(scale_bytes):
    """fp32 2**(b - 127) of each scale byte (2**-127 for b = 0, NaN for b = 255)."""
    b = scale_bytes.to(tl.int32)
    bits = tl.where(b == 0, F32_SMALLEST_SCALE_BITS, b << F32_MANTISSA_BITS)
    bits = tl.where(b == E8M0_NAN, F32_QUIET_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_fp8_bytes(x, ELEM: tl.constexpr, CAST: tl.constexpr):
    """FP8 byte (int32) of each fp32 value, already clamped to [-max, max]; round to nearest
    even. CAST "hardware": cvt.rn.satfinite on sm89+. "software": integer arithmetic on the fp32
    bits, exact everywhere; the interpreter needs it (its fp32->fp8 conversion rounds ties away
    and drops the mantissa carry into the exponent)."""
    if CAST == "hardware":
        fp8 = x.to(fp8_type(ELEM), fp_downcast_rounding="rtne")
        result = fp8.to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        tl.static_assert(CAST == "software", "CAST: software or hardware")
        # Round-to-nearest-even on the fp32 bits; |x| <= max, so the result never overflows.
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        exponent = (bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK
        # 24-bit significand with its implicit bit; an fp32 subnormal has exponent 1 and no
        # implicit bit.
        implicit_bit = (exponent > 0).to(tl.int32) << F32_MANTISSA_BITS
        significand = (bits & F32_MANTISSA_MASK) | implicit_bit
        unbiased = tl.maximum(exponent, 1) - F32_EXPONENT_BIAS
        # Bits to drop: the mantissa difference, plus the distance below the FP8 normal range.
        below = tl.maximum(elem_min_normal_exponent(ELEM) - unbiased, 0)
        shift = tl.minimum(elem_dropped_bits(ELEM) + below, F32_MAX_ROUNDING_SHIFT)
        kept = significand >> shift
        rest = significand & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
        kept = kept + round_up.to(tl.int32)
        # Normal results: (biased exponent - 1) * 2**m + kept, where kept carries the implicit
        # bit, so a rounding carry moves into the exponent field. Subnormal results: kept alone.
        biased_less_one = tl.maximum(unbiased + elem_exponent_bias(ELEM) - 1, 0)
        base = biased_less_one << elem_mantissa_bits(ELEM)
        result = (sign << 7) | (base + kept)
    return result


@triton.jit
def quantize_blocks(
    x, AXIS: tl.constexpr, ELEM: tl.constexpr, SCALE_MODE: tl.constexpr, CAST: tl.constexpr
):
    """Quantize fp32 `x` in blocks along `AXIS` (a block per index of the other axes).

    Returns (FP8 bytes of x's shape, scale bytes with AXIS reduced), both uint8.
    """
    # Phase 1: block amax, and non-finite blocks found with an integer test on the bits:
    # Triton's max may drop NaN, so it cannot be trusted to propagate one.
    bits = x.to(tl.int32, bitcast=True)
    amax = tl.reduce(tl.abs(x), AXIS, max_combine)
    nonfinite_lanes = ((bits & F32_ABS_MASK) >= F32_INF_BITS).to(tl.int32)
    nonfinite = tl.reduce(nonfinite_lanes, AXIS, max_combine) > 0
    # Phase 2: the E8M0 scale byte of each block.
    scale = scale_bytes(amax, nonfinite, ELEM, SCALE_MODE)
    # Phase 3: scale (exact power of two), clamp (makes the cast saturating), cast.
    scaled = x * tl.expand_dims(inverse_scale(scale), AXIS)
    scaled = tl.minimum(tl.maximum(scaled, -elem_max(ELEM)), elem_max(ELEM))
    data = cast_fp8_bytes(scaled, ELEM, CAST)
    # Every element of a NaN block is the format's positive NaN byte.
    data = tl.where(tl.expand_dims(nonfinite, AXIS), elem_nan_byte(ELEM), data)
    return data.to(tl.uint8), scale.to(tl.uint8)


@triton.jit
def expansion_scale(scale_bytes, DOT: tl.constexpr):
    """2**(b - 127) of each scale byte b in the MMA dtype DOT, exact (2**-127 for b = 0, a
    subnormal in bf16 and fp32): the power of two set in the exponent field, and for b = 0 the
    subnormal's bits, which every b >= 1 exceeds, so one max. b = 255 (a block holding a NaN or
    an Inf) gives +Inf: such a block's elements are NaN (`quantize_blocks`, the numerics core),
    so their products are NaN all the same."""
    b = scale_bytes.to(tl.int32)
    if DOT == "bf16":
        bits = tl.maximum(b << BF16_MANTISSA_BITS, BF16_SMALLEST_SCALE_BITS)
        scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        tl.static_assert(DOT == "fp32", "DOT: bf16 or fp32")
        scale = tl.maximum(b << F32_MANTISSA_BITS, F32_SMALLEST_SCALE_BITS).to(tl.float32, bitcast=True)
    return scale


@triton.constexpr_function
def _bf16_scale_asm():
    """PTX: `expansion_scale`'s bf16 bits for a scale byte ($1, int32) into $0 (16 bits)."""
    return (
        "{ .reg .b32 t;\n"
        f"shl.b32 t, $1, {_BF16_MANTISSA_BITS};\n"
        f"max.u32 t, t, {_BF16_SMALLEST_SCALE_BITS};\n"
        "cvt.u16.u32 $0, t; }"
    )


@triton.jit
def pinned_bf16_scale(scale_bytes):
    """`expansion_scale(scale_bytes, "bf16")` (int32 bytes), computed where it is written: by
    inline assembly marked impure, so in the layout the scales are loaded in, where a thread
    holds few of them. Written as plain Triton, the compiler moves the layout conversion that
    the broadcast over the data tile needs in front of the computation (it converts bytes rather
    than bf16) and computes each element's factor in the data's layout: for scales along the
    rows, which differ from column to column, about 6 instructions per pair of elements on sm90
    (sm90 forward head_dim 128, 905 -> 815 loop instructions; 2026-12-08, Triton 3.9)."""
    return tl.inline_asm_elementwise(_bf16_scale_asm(), "=h,r", [scale_bytes], dtype=tl.bfloat16,
                                     is_pure=False, pack=1)


@triton.jit
def load_column_pairs(ptr, offs_rows, mask_rows, COLS: tl.constexpr):
    """The bytes ptr[offs_rows, :COLS] (2-byte aligned rows of an even length), read two columns
    per 16-bit load: (even columns, odd columns) as int32, each (rows, COLS / 2); masked rows
    read 0."""
    offs_w = tl.arange(0, COLS // 2)
    word_ptrs = ptr.to(tl.pointer_type(tl.int16)) + offs_rows[:, None] * (COLS // 2) + offs_w[None, :]
    words = tl.load(word_ptrs, mask=mask_rows, other=0).to(tl.int32)
    return words & BYTE_MASK, (words >> BYTE_BITS) & BYTE_MASK


@triton.jit
def join_column_pairs(even, odd):
    """(rows, C) values of the even and the odd columns -> the (rows, 2C) tile."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * even.shape[1]))


@triton.jit
def load_mx_tile(
    data_ptr, scale_ptr, head, r0, S,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ALONG_ROWS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Rows r0 .. r0 + ROWS of head `head` of an MX operand quantized outside the kernel,
    expanded exactly to the MMA's dtype DOT ("bf16", or "fp32" under the interpreter). Data
    (heads, S, HEAD_DIM) FP8, contiguous; scales contiguous uint8, (heads, S, HEAD_DIM / 32)
    along head_dim, or with ALONG_ROWS (heads, ceil(S / 32), HEAD_DIM) along the rows (r0 is
    then a multiple of SCALE_BLOCK). Rows at or past S read 0.

    On a GPU, scales along the rows are read two bytes at a time: their tensor must be 2-byte
    aligned (`attention.aligned_scales`).

    An FP8 value times a power-of-two scale is exact in bf16 unless it falls below bf16's
    smallest subnormal (2**-133): exact for every element of a block whose scale byte is at
    least 3 (E4M3, smallest subnormal 2**-9) or 10 (E5M2, 2**-16), i.e. a block maximum above
    about 2**-116 (E4M3); fp32 is exact for every byte."""
    offs_r = r0 + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_r = offs_r < S
    data_ptrs = data_ptr + head * S * HEAD_DIM + offs_r[:, None] * HEAD_DIM + offs_d[None, :]
    x = tl.load(data_ptrs, mask=mask_r[:, None], other=0.0).to(dot_type(DOT))
    if ALONG_ROWS:
        n_blocks = (S + SCALE_BLOCK - 1) // SCALE_BLOCK
        offs_b = r0 // SCALE_BLOCK + tl.arange(0, ROWS // SCALE_BLOCK)
        head_scales = scale_ptr + head * n_blocks * HEAD_DIM
        in_range = (offs_b < n_blocks)[:, None]
        # Past the last block, scale byte 0 (2**-127, finite): it multiplies rows read as 0, and
        # a zero fills a masked word at once where another byte was selected byte by byte.
        if DOT == "bf16":
            # Two columns' bytes per 16-bit load, their factors joined back side by side: each
            # thread then holds pairs of adjacent factors, which the broadcast over the data
            # tile reads from shared memory 4 bytes at a time (2 bytes at a time from a plain
            # byte tile: sm90 forward head_dim 128, 801 -> 789 loop instructions; dK/dV
            # 727 -> 688).
            even, odd = load_column_pairs(head_scales, offs_b, in_range, HEAD_DIM)
            factor = join_column_pairs(pinned_bf16_scale(even), pinned_bf16_scale(odd))
        else:
            scale = tl.load(head_scales + offs_b[:, None] * HEAD_DIM + offs_d[None, :], mask=in_range, other=0)
            factor = expansion_scale(scale, DOT)
        blocks = tl.reshape(x, (ROWS // SCALE_BLOCK, SCALE_BLOCK, HEAD_DIM))
        x = blocks * tl.expand_dims(factor, 1)
    else:
        blocks_per_row: tl.constexpr = HEAD_DIM // SCALE_BLOCK
        offs_b = tl.arange(0, blocks_per_row)
        scale_ptrs = scale_ptr + head * S * blocks_per_row + offs_r[:, None] * blocks_per_row + offs_b[None, :]
        scale = tl.load(scale_ptrs, mask=mask_r[:, None], other=0)  # rows past S: as above
        blocks = tl.reshape(x, (ROWS, blocks_per_row, SCALE_BLOCK))
        x = blocks * tl.expand_dims(expansion_scale(scale, DOT), 2)
    return tl.reshape(x, (ROWS, HEAD_DIM))


# Two bf16 quiet NaNs in one int32 (the factor of a non-finite block in `_round_unsigned_bf16`).
BF16X2_QUIET_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC07FC0)
BF16_HALF_BITS: tl.constexpr = tl.constexpr(16)


@triton.jit
def bf16x2_pow2_bits(exponent):
    """Two bf16 copies of 2**exponent in one int32, for a packed multiply (exponent in
    [-126, 127]: a normal bf16)."""
    half = (exponent + F32_EXPONENT_BIAS) << BF16_MANTISSA_BITS
    return half | (half << BF16_HALF_BITS)


# An FP8 value converted to f16 (exact) and its bits shifted right by F16_TO_BF16_SHIFT (bf16's
# exponent field is that much wider) is the bf16 of value * 2**(F16_EXPONENT_BIAS - 127).
F16_EXPONENT_BIAS: tl.constexpr = tl.constexpr(15)
_F16_TO_BF16_SHIFT = 3


@triton.constexpr_function
def _round_unsigned_asm(elem):
    """PTX for two fp32 values y0, y1 >= 0 ($1, $2) and a bf16x2 factor ($3): both rounded to
    the element format by the hardware cast (nearest even, saturating; NaN stays NaN),
    converted to f16x2 (exact: f16 holds every E4M3 and E5M2 value), whose bits shifted right
    by 3 are the bf16x2 of the values times 2**(15 - 127) (the f16 exponent field becomes the
    low bits of bf16's, f16 subnormals bf16 subnormals; nothing crosses the halves, as the low
    3 bits of an FP8 value's f16 are 0), then multiplied by the factor ($0: bf16 x0 in the low
    half): a factor 2**(scale + 112) gives value * 2**scale, rounded once."""
    return (
        "{ .reg .b16 q; .reg .b32 w;\n"
        f"cvt.rn.satfinite.{elem}x2.f32 q, $2, $1;\n"
        f"cvt.rn.f16x2.{elem}x2 w, q;\n"
        f"shr.b32 w, w, {_F16_TO_BF16_SHIFT};\n"
        "mul.rn.bf16x2 $0, w, $3; }"
    )


@triton.jit
def _round_unsigned_bf16(y, factor, ELEM: tl.constexpr):
    """bf16 of fp32 y >= 0 (already scaled into the element format's range) rounded to the
    element format ELEM and multiplied by `factor` (int32, `bf16x2_pow2_bits`), two elements
    per instance of `_round_unsigned_asm`: 4 instructions per pair."""
    return tl.inline_asm_elementwise(_round_unsigned_asm(ELEM), "=r,r,r,r,r", [y, factor],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.constexpr_function
def _mul_f32x2_asm():
    """PTX: $0, $1 = ($2, $3) * ($4, $5), one packed fp32 multiply (sm100+), rounded to nearest
    as two `mul.rn.f32` would be (subnormals kept)."""
    return (
        "{ .reg .b64 a, f, r;\n"
        "mov.b64 a, {$2, $3};\n"
        "mov.b64 f, {$4, $5};\n"
        "mul.rn.f32x2 r, a, f;\n"
        "mov.b64 {$0, $1}, r; }"
    )


@triton.jit
def _packed_mul(x, factor):
    """x * factor (fp32, broadcast), two products per instruction on sm100, where ptxas packs
    few of these multiplies itself (dQ at head_dim 128: 601 -> 585 loop instructions)."""
    return tl.inline_asm_elementwise(_mul_f32x2_asm(), "=r,=r,r,r,r,r", [x, factor], dtype=tl.float32,
                                     is_pure=True, pack=2)


@triton.jit
def mx_round(x, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
             ELEM: tl.constexpr, SCALE_MODE: tl.constexpr, SIGNED: tl.constexpr,
             DOT: tl.constexpr, FP8_CVT_BF16: tl.constexpr):  # fmt: skip
    """fp32 x (ROWS, COLS) rounded to MX along COLS, in registers, as the MMA operand in dtype
    DOT: the dequantized value an MX GEMM multiplies (`mxcompile.numerics`: the block scale
    from the block's amax, x scaled by its inverse, clamped, rounded to the element format's
    nearest even, scaled back; a block holding a NaN or an Inf is all NaN).

    DOT "fp32" (the interpreter, whose fp32 -> FP8 cast rounds ties away): rounding to the
    element grid is the fp32 add and subtract of a power of two, 2**(23 - mantissa bits) times
    the grid's exponent (that of the scaled value, or the format's smallest normal below it),
    signed like the value; the rounded value is scaled back in fp32. DOT "bf16" (a GPU): the
    hardware cast rounds (cvt.rn.satfinite, the same nearest-even grid); the element converts
    to bf16 exactly and is scaled back there, one packed multiply per two elements, exact as
    `load_mx_tile`'s expansion. SIGNED=False: 0 <= x < 2**23 (P, at most 1): no sign
    operations, and on a GPU without FP8_CVT_BF16 (sm90, whose FP8 conversions give f16) the
    element's f16 bits are shifted under bf16's exponent field (`_round_unsigned_asm`; its
    factor 2**(scale + 112) is a normal bf16 for every scale such values get): 4 instructions
    per pair, against 6 for the cast, the conversion through f16 and the multiply. With
    FP8_CVT_BF16 (sm100, one conversion instruction per pair) the cast, conversion and
    multiply take 3, and x is scaled into the element range by packed multiplies."""
    blocks = tl.reshape(x, (ROWS, COLS // SCALE_BLOCK, SCALE_BLOCK))
    if SIGNED and DOT == "bf16":
        # On a GPU a float maximum that keeps NaN (max.NaN) takes |x| as an operand modifier:
        # no instruction per element for the absolute value (dQ at head_dim 128: 585 -> 548
        # loop instructions on sm100, 854 -> 830 on sm90). Its bits are the integer maximum's.
        amax_bits = tl.reduce(tl.abs(blocks), 2, nan_max_combine).to(tl.int32, bitcast=True)
    else:
        # The block amax on the bits: NaN bits exceed Inf's, so one integer max finds both
        # (the interpreter reduces with numpy only with the standard library's combines).
        abs_bits = blocks.to(tl.int32, bitcast=True)
        if SIGNED:
            abs_bits = abs_bits & F32_ABS_MASK
        amax_bits = tl.reduce(abs_bits, 2, max_combine)
    nonfinite = amax_bits >= F32_INF_BITS
    scale = scale_bytes(amax_bits.to(tl.float32, bitcast=True), nonfinite, ELEM, SCALE_MODE)
    # A non-finite block is scaled by NaN, so every value of it rounds to NaN.
    inverse = tl.where(nonfinite, float("nan"), inverse_scale(scale))
    if DOT == "bf16" and FP8_CVT_BF16:
        y = _packed_mul(blocks, tl.expand_dims(inverse, 2))
    else:
        y = blocks * tl.expand_dims(inverse, 2)
    if SCALE_MODE != "rceil":
        # rceil's scale keeps |y| within the format's max (to fp32 rounding, which rounds back
        # to the max below); the other modes saturate (keeping a non-finite block's NaN).
        y = tl.maximum(y, -elem_max(ELEM), propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, elem_max(ELEM), propagate_nan=tl.PropagateNan.ALL)
    if DOT == "bf16" and not SIGNED and not FP8_CVT_BF16:
        pow2 = bf16x2_pow2_bits(scale - F16_EXPONENT_BIAS)
        factor = tl.where(nonfinite, BF16X2_QUIET_NAN_BITS, pow2)
        rounded = _round_unsigned_bf16(y, tl.expand_dims(factor, 2), ELEM)
    else:
        if DOT == "bf16":
            elements = y.to(fp8_type(ELEM), fp_downcast_rounding="rtne").to(tl.bfloat16)
        else:
            y_bits = y.to(tl.int32, bitcast=True)
            offset = elem_magic_offset(ELEM)
            magic_bits = tl.maximum((y_bits & F32_EXPONENT_FIELD) + offset, elem_min_normal_field(ELEM) + offset)
            if SIGNED:
                magic_bits = magic_bits | (y_bits & F32_SIGN_BIT)
            magic = magic_bits.to(tl.float32, bitcast=True)
            elements = ((y + magic) - magic).to(dot_type(DOT))
        rounded = elements * tl.expand_dims(expansion_scale(scale, DOT), 2)
    return tl.reshape(rounded, (ROWS, COLS))


@triton.jit
def load_rows(ptr, offs_rows, stride_rows, offs_cols, stride_cols, mask_rows, other):
    """The tile ptr[offs_rows, offs_cols] (rows x cols); rows outside `mask_rows` read `other`."""
    ptrs = ptr + offs_rows[:, None] * stride_rows + offs_cols[None, :] * stride_cols
    return tl.load(ptrs, mask=mask_rows[:, None], other=other)


@triton.jit
def program_rows(S, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's tile of BLOCK rows out of S (grid axis 0) and its head (grid axis 1), as
    64-bit offsets: (tile index, head, row offsets, head_dim offsets, row mask)."""
    pid = tl.program_id(axis=0).to(tl.int64)
    head = tl.program_id(axis=1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    return pid, head, offs, tl.arange(0, HEAD_DIM), offs < S


@triton.jit
def load_row_stats(lse_ptr, delta_ptr, head, offs_m, mask_m, stride_lh, stride_lm, stride_eh,
                   stride_em):  # fmt: skip
    """The saved logsumexp (natural log), in base 2, and delta of the query rows offs_m."""
    lse = tl.load(lse_ptr + head * stride_lh + offs_m * stride_lm, mask=mask_m, other=0.0)
    delta = tl.load(delta_ptr + head * stride_eh + offs_m * stride_em, mask=mask_m, other=0.0)
    return lse * LOG2E, delta


@triton.jit
def online_softmax_step(s, m_i, l_i, INTEGER_MAX: tl.constexpr):
    """One key tile of the base-2 online softmax: scores `s` (rows x keys, -inf where masked),
    running maximum m_i and denominator l_i per row. Returns (p, alpha, m_new, l_new): the
    unnormalized probabilities 2**(s - m_new), the factor that rescales what was accumulated
    under m_i, and the updated statistics. A row with no valid key yet keeps m = -inf and p = 0.
    INTEGER_MAX: the running maximum is rounded up to an integer (ceil), so alpha is an exact
    power of two and the largest p lies in (1/2, 1] (the MX kernels: P's MX rounding then does
    not depend on the tile size); else it is the real maximum (FlashAttention)."""
    row_max = tl.reduce(s, 1, max_combine)
    if INTEGER_MAX:
        row_max = tl.ceil(row_max)
    m_new = tl.maximum(m_i, row_max)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.reduce(p, 1, sum_combine)
    return p, alpha, m_new, l_new


@triton.jit
def key_tiles_end(S_K, pid_m, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the keys the query tile pid_m attends to (causal: up to the diagonal)."""
    if CAUSAL:
        end = tl.minimum(S_K, (pid_m + 1) * BLOCK_M)
    else:
        end = S_K
    return end
