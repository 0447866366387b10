// MX quantization on CPU in one pass over each block: mxcompile::quantize,
// mxcompile::fake_quantize and mxcompile::dequantize for contiguous operands.
//
// The same arithmetic as the numerics core (mxcompile/numerics), step for step, so the results
// are equal bit for bit (tests/ops/test_native.py checks every path against it):
//   amax     the largest |x| of a block, as an integer maximum of the fp32 bit patterns with
//            the sign cleared (finite values order as their bits; NaN patterns lie above Inf,
//            so a NaN propagates as torch's amax does);
//   scale    the E8M0 byte of `numerics.scales.scale_bytes_from_amax`, then the fp32 scale and
//            inverse scale of `scale_fp32_from_bytes` / `inverse_scale_fp32_from_bytes`;
//   elements x * inverse, clamped to +-max_normal (floor and even rules), then either encoded
//            as the fp8 byte nearest to it (quantize: the fp8 cast, as integer arithmetic) or
//            rounded to the element format by `numerics.rounding.round_to_element` (Veltkamp
//            split in the normal range, the magic-number addition in the subnormal range),
//            multiplied by the scale and converted to the output dtype (fake quantize); every
//            element of a NaN block (scale byte 0xFF) is NaN. bf16 fake quantization rounds
//            the inputs' own bits where that gives the same values (see "bit rounding").
//
// Written with GCC/Clang vector extensions (16 fp32 lanes), not intrinsics: the compiler emits
// AVX512 where the CPU has it and splits the vectors elsewhere. Built with -ffp-contract=off:
// a fused multiply-add would change the rounding tricks' results.
//
// Each entry point takes a whole operand and splits its rows (or (batch, block) strips of the
// column layout) across `threads` OpenMP threads; small operands run on the calling thread.

#include <stdint.h>
#include <string.h>

#include <cmath>
#include <utility>

namespace {

constexpr int kLanes = 16;
typedef float f32v __attribute__((vector_size(kLanes * 4)));
typedef int32_t i32v __attribute__((vector_size(kLanes * 4)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));
typedef uint8_t u8v __attribute__((vector_size(kLanes)));

// Operand and result kinds (mxcompile/ops/native/__init__.py keeps the same numbers).
enum Dtype : int32_t { BF16 = 0, F16 = 1, F32 = 2, FP8 = 3 };
enum ScaleMode : int32_t { FLOOR = 0, RCEIL = 1, CEIL = 2, EVEN = 3 };

constexpr uint32_t kSignMask = 0x80000000u;
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNanBits = 0x7FC00000u;
constexpr int kMantissaBits = 23;
constexpr uint32_t kMantissaMask = (1u << kMantissaBits) - 1;
constexpr int32_t kE8M0Nan = 0xFF;
constexpr int32_t kE8M0MaxByte = 0xFE;
constexpr uint32_t kTwoPowMinus127Bits = 1u << (kMantissaBits - 1);  // the subnormal 2**-127
constexpr int kF32ExponentBias = 127;

}  // namespace

// The element format and scale rule, filled by the Python loader from mxcompile.numerics.
struct MXFormat {
    int32_t scale_mode;     // ScaleMode
    int32_t emax;           // exponent of the largest power of two <= max_normal
    int32_t mantissa_bits;  // element mantissa bits (e4m3: 3, e5m2: 2)
    int32_t exponent_bias;  // element exponent bias (e4m3: 7, e5m2: 15)
    int32_t nan_byte;       // the fp8 byte written for the elements of a NaN block
    float max_normal;       // largest finite element magnitude
    float reciprocal_max;   // fp32(1 / max_normal), the rceil multiplier
    float splitter;         // 2**(24 - (mantissa_bits + 1)) + 1: Veltkamp's splitter
    float magic;            // 1.5 * 2**(emin - mantissa_bits + 23): the subnormal rounding constant
    float min_normal;       // 2**emin, the smallest normal element magnitude
};

namespace {

inline f32v splat(float v) { return f32v{} + v; }
inline i32v splat_i(int32_t v) { return i32v{} + v; }
inline u32v splat_u(uint32_t v) { return u32v{} + v; }

inline i32v max_i(i32v a, i32v b) { return a > b ? a : b; }
inline i32v min_i(i32v a, i32v b) { return a < b ? a : b; }

inline i32v abs_bits(f32v v) { return (i32v)((u32v)v & kAbsMask); }

// ---- fp16 <-> fp32, as integer arithmetic on the bits (GCC runs vectors of _Float16 element
// by element on CPUs without AVX512-FP16) ----

// The magnitude bits shifted into fp32's fields read as fp32 are the value times 2**-112 (fp16's
// subnormals become fp32 subnormals, exactly); the power-of-two factor restores it. The top
// exponent (Inf, NaN) maps to fp32's.
inline f32v fp32_from_fp16(u16v half) {
    i32v bits = (i32v)__builtin_convertvector(half, u32v);
    i32v magnitude = (bits & 0x7FFF) << 13;
    i32v value = (i32v)((f32v)magnitude * 0x1p112f);
    value = (bits & 0x7C00) == 0x7C00 ? magnitude | (int32_t)kInfBits : value;
    return (f32v)(value | ((bits & 0x8000) << 16));
}

// Round to nearest even (torch's conversion): overflow to Inf, NaN to the quiet NaN 0x7E00,
// the subnormal range by adding a magic number whose ulp is fp16's smallest subnormal, the
// normal range by rounding the 13 dropped mantissa bits (half less one plus the kept lowest bit).
inline u16v fp16_from_fp32(f32v v) {
    constexpr int32_t kOverflow = (kF32ExponentBias + 16) << kMantissaBits;       // 2**16
    constexpr int32_t kSubnormalLimit = (kF32ExponentBias - 14) << kMantissaBits;  // 2**-14
    constexpr int32_t kMagic = (kF32ExponentBias - 1) << kMantissaBits;            // 0.5: ulp 2**-24
    i32v magnitude = abs_bits(v);
    i32v special = magnitude > (int32_t)kInfBits ? splat_i(0x7E00) : splat_i(0x7C00);
    i32v subnormal = (i32v)((f32v)magnitude + (f32v)splat_i(kMagic)) - kMagic;
    i32v normal = (magnitude - ((kF32ExponentBias - 15) << kMantissaBits) + 0xFFF + ((magnitude >> 13) & 1)) >> 13;
    i32v half = magnitude < kSubnormalLimit ? subnormal : normal;
    half = magnitude >= kOverflow ? special : half;
    return __builtin_convertvector((u32v)(half | (i32v)(((u32v)v >> 16) & 0x8000u)), u16v);
}

// ---- loads and stores of 16 elements (n < 16: the first n, zero-filled) ----

// Copies the first n elements. The full vector (n == kLanes) is a constant-size copy, which
// compiles to one vector move; a runtime size (a row's last, partial vector) to a byte loop.
template <typename Element>
inline void copy_lanes(void* destination, const void* source, int n) {
    if (n == kLanes) {
        memcpy(destination, source, kLanes * sizeof(Element));
    } else {
        memcpy(destination, source, n * sizeof(Element));
    }
}

// bf16 bit patterns as the fp32 bit patterns of the same values (shifted into the upper half):
// each pattern interleaved with a zero below it. Not __builtin_convertvector(h, u32v) << 16,
// which GCC 12 splits into two half-width conversions.
inline u32v fp32_bits_from_bf16(u16v h) {
    return (u32v)__builtin_shufflevector(u16v{}, h, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23,
                                         0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31);
}

template <int32_t kDtype>
inline f32v load(const void* base, int64_t index, int n = kLanes) {
    if constexpr (kDtype == BF16) {
        u16v h{};
        copy_lanes<uint16_t>(&h, static_cast<const uint16_t*>(base) + index, n);
        return (f32v)fp32_bits_from_bf16(h);
    } else if constexpr (kDtype == F16) {
        u16v h{};
        copy_lanes<uint16_t>(&h, static_cast<const uint16_t*>(base) + index, n);
        return fp32_from_fp16(h);
    } else {
        f32v v{};
        copy_lanes<float>(&v, static_cast<const float*>(base) + index, n);
        return v;
    }
}

// fp32 -> bf16, round to nearest even, NaN as ATen's vectorized conversion writes it (0xFFFF).
inline u16v bf16_bits(f32v v) {
    u32v bits = (u32v)v;
    u32v rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    rounded = v == v ? rounded : splat_u(0xFFFFu);
    return __builtin_convertvector(rounded, u16v);
}

template <int32_t kDtype>
inline void store(void* base, int64_t index, f32v v, int n = kLanes) {
    if constexpr (kDtype == BF16) {
        u16v h = bf16_bits(v);
        copy_lanes<uint16_t>(static_cast<uint16_t*>(base) + index, &h, n);
    } else if constexpr (kDtype == F16) {
        u16v h = fp16_from_fp32(v);
        copy_lanes<uint16_t>(static_cast<uint16_t*>(base) + index, &h, n);
    } else {
        copy_lanes<float>(static_cast<float*>(base) + index, &v, n);
    }
}

// Bytes to 32-bit lanes in two steps: GCC 12 converts u8 -> i32 vectors element by element,
// u8 -> u16 -> u32 with vector zero-extensions.
inline i32v widen_bytes(u8v b) { return (i32v)__builtin_convertvector(__builtin_convertvector(b, u16v), u32v); }

inline void store_bytes(uint8_t* base, int64_t index, i32v v, int n = kLanes) {
    u8v b = __builtin_convertvector(v, u8v);
    copy_lanes<uint8_t>(base + index, &b, n);
}

// ---- scales ----

// numerics.scales.scale_bytes_from_amax, for amax given as non-negative fp32 bit patterns.
inline i32v scale_bytes(i32v amax_bits, const MXFormat& f) {
    i32v biased;
    if (f.scale_mode == RCEIL) {
        i32v descale = (i32v)((f32v)amax_bits * f.reciprocal_max);
        i32v exponent = (descale >> kMantissaBits) & 0xFF;
        i32v mantissa = descale & (int32_t)kMantissaMask;
        i32v normal = exponent + (mantissa != 0 ? splat_i(1) : splat_i(0));
        i32v subnormal = mantissa > (int32_t)kTwoPowMinus127Bits ? splat_i(1) : splat_i(0);
        biased = exponent == 0 ? subnormal : normal;
    } else {
        i32v bits = amax_bits;
        if (f.scale_mode == EVEN) bits += 1 << (kMantissaBits - f.mantissa_bits - 1);
        i32v exponent = (bits >> kMantissaBits) & 0xFF;
        if (f.scale_mode == CEIL) exponent += ((bits & (int32_t)kMantissaMask) != 0 ? splat_i(1) : splat_i(0));
        biased = exponent - f.emax;
    }
    biased = min_i(max_i(biased, splat_i(0)), splat_i(kE8M0MaxByte));
    return amax_bits < (int32_t)kInfBits ? biased : splat_i(kE8M0Nan);
}

// numerics.scales.scale_fp32_from_bytes: 2**(b - 127), NaN for 0xFF.
inline f32v scale_from_bytes(i32v b) {
    u32v bits = b == 0 ? splat_u(kTwoPowMinus127Bits) : (u32v)(b << kMantissaBits);
    return (f32v)(b == kE8M0Nan ? splat_u(kQuietNanBits) : bits);
}

// numerics.scales.inverse_scale_fp32_from_bytes: 2**(127 - b), NaN for 0xFF.
inline f32v inverse_scale_from_bytes(i32v b) {
    u32v bits = b == kE8M0MaxByte ? splat_u(kTwoPowMinus127Bits) : (u32v)((2 * 127 - b) << kMantissaBits);
    return (f32v)(b == kE8M0Nan ? splat_u(kQuietNanBits) : bits);
}

// ---- elements ----

// x * inverse clamped to +-max_normal (numerics.rounding.quantize_blocks). Only the floor and
// even rules need the clamp: rceil and ceil choose the scale so that amax * inverse <=
// max_normal, and x * inverse, a power-of-two scaling, cannot round above it. Blocks whose
// scale is NaN are overwritten afterwards, so min/max need no NaN rule.
template <bool kClamp>
inline f32v scaled_element(f32v x, f32v inverse, const MXFormat& f) {
    f32v v = x * inverse;
    if constexpr (kClamp) {
        v = v < -f.max_normal ? splat(-f.max_normal) : v;
        v = v > f.max_normal ? splat(f.max_normal) : v;
    }
    return v;
}

// numerics.rounding.round_to_element: Veltkamp's split in the normal range, the magic-number
// addition in the subnormal range, the sign copied back (signed zeros kept).
inline f32v rounded_element(f32v v, const MXFormat& f) {
    f32v c = v * f.splitter;
    f32v normal = c - (c - v);
    f32v subnormal = (v + f.magic) - f.magic;
    f32v magnitude = (f32v)abs_bits(v) < f.min_normal ? subnormal : normal;
    return (f32v)(((u32v)magnitude & kAbsMask) | ((u32v)v & kSignMask));
}

// The constant of fp8_bytes' normal range: half an fp8 ulp less one (in fp32 mantissa units),
// less the difference of the exponent biases in fp32's exponent field.
inline int32_t fp8_rounding_offset(const MXFormat& f) {
    const int dropped = kMantissaBits - f.mantissa_bits;
    return ((1 << (dropped - 1)) - 1) - ((kF32ExponentBias - f.exponent_bias) << kMantissaBits);
}

// The fp8 byte nearest to v (|v| <= max_normal), ties to even: the fp8 cast, as integer
// arithmetic on v's bits. Normal range: the fp32 mantissa rounded to mantissa_bits by adding
// half an fp8 ulp less one plus the kept part's lowest bit, the exponent re-biased by the same
// addition (`offset`, fp8_rounding_offset). Subnormal range: v + magic rounds |v| to a multiple
// of the subnormal quantum in the low mantissa bits (the addition of rounded_element), which
// are the byte's code.
inline i32v fp8_bytes(f32v v, int32_t offset, const MXFormat& f) {
    const int dropped = kMantissaBits - f.mantissa_bits;
    i32v magnitude = abs_bits(v);
    i32v normal = (magnitude + offset + ((magnitude >> dropped) & 1)) >> dropped;
    i32v subnormal = (i32v)((f32v)magnitude + f.magic) - (i32v)splat(f.magic);
    i32v code = (f32v)magnitude < f.min_normal ? subnormal : normal;
    return code | (i32v)(((u32v)v >> 24) & 0x80u);
}

// The fp32 value of fp8 bytes (what torch's fp8 -> fp32 conversion gives). The magnitude bits
// shifted into fp32's exponent and mantissa fields read as fp32 are the value times
// 2**(exponent_bias - 127) (subnormal elements become fp32 subnormals, exactly); `unbias`, that
// power of two's inverse, restores it. NaN (e4m3: S.1111.111) and e5m2's Inf and NaN (top
// exponent) map to fp32's.
inline f32v fp8_values(i32v code, float unbias, const MXFormat& f) {
    const int shift = kMantissaBits - f.mantissa_bits;
    i32v magnitude = (code & 0x7F) << shift;
    i32v value = (i32v)((f32v)magnitude * unbias);
    i32v special = f.mantissa_bits == 3 ? ((code & 0x7F) == 0x7F ? splat_i((int32_t)kQuietNanBits) : value)
                                        : ((code & 0x7C) == 0x7C ? magnitude | (int32_t)kInfBits : value);
    return (f32v)(special | ((code & 0x80) << 24));
}

// ---- bit rounding: MX quantization of bf16 by rounding its own bits ----
//
// A block's scale is a power of two, so x * inverse has x's significand. Where it lies in the
// element format's normal range, rounding it to mantissa_bits is rounding x's own significand:
// done on the bf16 patterns with fp8_bytes' integer rule, in 16-bit lanes, nothing multiplied,
// the result is the rounded x itself (at most mantissa_bits + 1 significant bits: exact in bf16
// and fp32), and its exponent and kept mantissa bits, re-biased, are the fp8 byte. Elements in
// the subnormal range (0 < |x| < min_normal * scale) round to a fixed quantum instead; a block
// (a column strip) holding one runs the fp32 arithmetic, as do blocks whose normal range starts
// below bf16's (scale bytes below exponent_bias) and NaN blocks. The clamp of the floor and even
// rules (max_normal * scale) is a bf16 pattern too, or one above every finite magnitude where
// that product exceeds bf16's range. Not for fp16 results (a conversion), nor fp32 inputs (1.2x
// slower in 32-bit lanes). Against the fp32 path (benchmarks/native_ab.py), bf16 -> bf16: rows
// 0.74-0.82x, columns 0.77-0.88x (1.0x at 4096^2); bf16 -> fp8 (native_ab.py --base 6d5c698):
// rows 0.92-0.96x, columns 0.75-0.87x (1.0x at 4096^2), rows under the floor rule 0.72-0.78x.
// A row group's constants are converted once per group: converted per block, they cost what
// the rounding saved (1.1x slower).

constexpr int kBf16MantissaBits = 7;
constexpr uint16_t kBf16Magnitude = 0x7FFF;

// Whether a kIn -> kOut quantization takes bit rounding.
template <int32_t kIn, int32_t kOut>
constexpr bool kBitRounding = kIn == BF16 && (kOut == BF16 || kOut == F32 || kOut == FP8);

// The lane-wise bounds of bit rounding for blocks with these scale bytes, as bf16 patterns: the
// smallest magnitude of the normal range less one (kBf16Magnitude where the block cannot take
// the path: then only a block of zeros does), and the clamp (max_normal * scale; up to
// 0x8680 for byte 254, above every finite magnitude, as 16-bit lanes compare unsigned).
struct BitBounds {
    i32v normal_min_less_one, clamp;
};

inline BitBounds bit_bounds(i32v bytes, const MXFormat& f) {
    constexpr int kShift = kBf16MantissaBits;
    const int32_t emin = 1 - f.exponent_bias;
    // max_normal's mantissa field in bf16 (its low bits are zero: mantissa_bits < 7).
    const int32_t max_mantissa = (int32_t)(((u32v)splat(f.max_normal))[0] & kMantissaMask) >> (kMantissaBits - kShift);
    const i32v usable = (bytes + emin >= 1) & (bytes != kE8M0Nan);
    return {usable ? ((bytes + emin) << kShift) - 1 : splat_i(kBf16Magnitude),
            ((bytes + f.emax) << kShift) | max_mantissa};
}

// The rounding of one strip: its clamp as bf16 lanes, and the rounding constants.
struct BitRounding {
    u16v clamp;
    u16v code_offset;        // fp8 results: (scale byte - exponent_bias) << mantissa_bits, the
                             // difference of the rounded pattern's top bits and the fp8 byte
    int dropped;             // the mantissa bits rounded off
    uint16_t half_less_one;  // half the kept part's unit, less one
};

// Lane j's rounding in every lane (block j of a group of the row layout).
inline BitRounding broadcast_lane(const BitRounding& r, int j) {
    return {u16v{} + r.clamp[j], u16v{} + r.code_offset[j], r.dropped, r.half_less_one};
}

inline BitRounding bit_rounding(i32v bytes, i32v clamp, const MXFormat& f) {
    const int dropped = kBf16MantissaBits - f.mantissa_bits;
    return {__builtin_convertvector(clamp, u16v),
            __builtin_convertvector((bytes - f.exponent_bias) << f.mantissa_bits, u16v), dropped,
            (uint16_t)((1u << (dropped - 1)) - 1)};
}

// `count` vectors of n lanes at start, start + stride, ..., none of whose magnitudes lies in
// (0, normal_min), rounded by bit rounding: fake-quantized, or as fp8 bytes.
template <int32_t kOut, bool kClamp>
inline void bit_rounded_strip(const void* x, void* out, int64_t start, int64_t stride, int64_t count, int n,
                              const BitRounding& r) {
    for (int64_t k = 0; k < count; ++k) {
        const int64_t index = start + k * stride;
        u16v h{};
        copy_lanes<uint16_t>(&h, static_cast<const uint16_t*>(x) + index, n);
        u16v magnitude = h & kBf16Magnitude;
        if constexpr (kClamp) magnitude = magnitude < r.clamp ? magnitude : r.clamp;
        const u16v rounded = magnitude + r.half_less_one + ((magnitude >> r.dropped) & 1);
        if constexpr (kOut == FP8) {  // the kept exponent and mantissa bits, re-biased; zeros stay zero
            u16v code = (rounded >> r.dropped) - r.code_offset;
            code = magnitude == 0 ? u16v{} : code;
            const u8v b = __builtin_convertvector(code | ((h >> 8) & 0x80), u8v);
            copy_lanes<uint8_t>(static_cast<uint8_t*>(out) + index, &b, n);
        } else {
            const u16v value = (rounded & (uint16_t) ~((1u << r.dropped) - 1)) | (h & (uint16_t) ~kBf16Magnitude);
            if constexpr (kOut == BF16) {
                copy_lanes<uint16_t>(static_cast<uint16_t*>(out) + index, &value, n);
            } else {  // fp32: the pattern widened
                const u32v wide = fp32_bits_from_bf16(value);
                copy_lanes<float>(static_cast<float*>(out) + index, &wide, n);
            }
        }
    }
}

// __builtin_shufflevector: Clang's, and GCC's from version 12.
inline int32_t horizontal_max(i32v m) {
    m = max_i(m, __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    m = max_i(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    m = max_i(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    m = max_i(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return m[0];
}

inline int32_t horizontal_min(i32v m) { return -horizontal_max(-m); }

// The lane of [a, b] (32 lanes) that result lane `lane` of a merge takes when a and b hold
// groups of kWidth partial maxima: the first half of each group, all groups in order.
template <int kWidth>
constexpr int first_half_lane(int lane) { return lane / (kWidth / 2) * kWidth + lane % (kWidth / 2); }

template <int kWidth, bool kMinimum, int... kLane>
inline i32v merge(i32v a, i32v b, std::integer_sequence<int, kLane...>) {
    const i32v first = __builtin_shufflevector(a, b, first_half_lane<kWidth>(kLane)...);
    const i32v second = __builtin_shufflevector(a, b, (first_half_lane<kWidth>(kLane) + kWidth / 2)...);
    return kMinimum ? min_i(first, second) : max_i(first, second);
}

template <int kWidth, bool kMinimum>
inline i32v merge(i32v a, i32v b) { return merge<kWidth, kMinimum>(a, b, std::make_integer_sequence<int, kLanes>{}); }

// Lane j of the result: the maximum (kMinimum: the minimum) of the lanes of m[j], for 16
// vectors at once. A tree of 15 merges (16 horizontal_max calls take 64 shuffle-max steps):
// each merge packs two vectors of partial results into one, the first halves of their lane
// groups beside the second halves (two shuffles), so one max halves the partials per vector:
// 16, 8, 4, 2, 1 lanes per vector.
template <bool kMinimum>
inline i32v lane_extrema(const i32v (&m)[kLanes]) {
    i32v eight[8], four[4], two[2];
    for (int j = 0; j < 8; ++j) eight[j] = merge<16, kMinimum>(m[2 * j], m[2 * j + 1]);
    for (int j = 0; j < 4; ++j) four[j] = merge<8, kMinimum>(eight[2 * j], eight[2 * j + 1]);
    for (int j = 0; j < 2; ++j) two[j] = merge<4, kMinimum>(four[2 * j], four[2 * j + 1]);
    return merge<2, kMinimum>(two[0], two[1]);
}

inline i32v lane_maxima(const i32v (&m)[kLanes]) { return lane_extrema<false>(m); }
inline i32v lane_minima(const i32v (&m)[kLanes]) { return lane_extrema<true>(m); }

// The lane-wise amax of `count` vectors of n lanes at start, start + stride, ... as fp32 bit
// patterns with the sign cleared. bf16 patterns with the sign cleared order like the values
// too, so their maximum is taken on the 16-bit patterns, widened once at the end. For bf16
// with `smallest`, also the lane-wise smallest magnitude less one (wrapped: zeros count as the
// largest), as bf16 patterns: the bit-rounding check.
template <int32_t kIn>
inline i32v strip_amax(const void* x, int64_t start, int64_t stride, int64_t count, int n,
                       i32v* smallest = nullptr) {
    if constexpr (kIn == BF16) {
        u16v m{}, least = u16v{} + kBf16Magnitude;
        for (int64_t k = 0; k < count; ++k) {
            u16v h{};
            copy_lanes<uint16_t>(&h, static_cast<const uint16_t*>(x) + start + k * stride, n);
            h &= kBf16Magnitude;
            m = m > h ? m : h;
            if (smallest) {
                const u16v less_one = (h - 1) & kBf16Magnitude;
                least = least < less_one ? least : less_one;
            }
        }
        if (smallest) *smallest = (i32v)__builtin_convertvector(least, u32v);
        return (i32v)fp32_bits_from_bf16(m);
    } else {
        i32v m{};
        for (int64_t k = 0; k < count; ++k) m = max_i(m, abs_bits(load<kIn>(x, start + k * stride, n)));
        return m;
    }
}

// What a block (or a vector of column blocks) needs besides the common arithmetic.
enum class Block {
    kNan,            // some lanes have the NaN scale: their elements are NaN
    kFinite,         // finite scales
    kNormalResults,  // finite scales under which every nonzero dequantized element is a normal
                     // fp32 value: its bf16 conversion is a truncation (exact: the value has
                     // at most mantissa_bits + 1 significant bits)
};

// The smallest scale byte of Block::kNormalResults: the smallest nonzero element
// 2**(emin - mantissa_bits) times the scale 2**(b - 127) is at least 2**-126 from b =
// mantissa_bits + exponent_bias on (emin = 1 - exponent_bias).
inline int32_t normal_results_min_byte(const MXFormat& f) { return f.mantissa_bits + f.exponent_bias; }

// The scales of a vector's lanes: one block's, broadcast, or a column block's per lane.
struct LaneScales {
    f32v scale, inverse;
    i32v nan_lanes;
};

inline LaneScales lane_scales(i32v bytes) {
    return {scale_from_bytes(bytes), inverse_scale_from_bytes(bytes), bytes == kE8M0Nan};
}

// Lane j's scales in every lane (block j of a group of the row layout).
inline LaneScales broadcast_lane(const LaneScales& s, int j) {
    return {splat(s.scale[j]), splat(s.inverse[j]), splat_i(s.nan_lanes[j])};
}

// Whether any lane of a comparison's mask is set.
inline bool any_lane(i32v mask) {
    typedef uint64_t u64x8 __attribute__((vector_size(64)));
    const u64x8 w = (u64x8)mask;
    return (((w[0] | w[1]) | (w[2] | w[3])) | ((w[4] | w[5]) | (w[6] | w[7]))) != 0;
}

// `count` vectors of a block's elements at start, start + stride, ..., quantized with their
// scales in fp32 arithmetic: fp8 bytes into `out`, or for a float kOut the dequantized values
// (fake quantization). NaN lanes get fmt.nan_byte, or the quiet NaN that the reference's float
// arithmetic gives.
template <int32_t kIn, int32_t kOut, bool kClamp, Block kBlock>
inline void quantize_strip(const void* x, void* out, int64_t start, int64_t stride, int64_t count, int n,
                           const LaneScales& s, int32_t offset, const MXFormat& f) {
    for (int64_t k = 0; k < count; ++k) {
        const int64_t index = start + k * stride;
        f32v v = scaled_element<kClamp>(load<kIn>(x, index, n), s.inverse, f);
        if constexpr (kOut == FP8) {
            i32v code = fp8_bytes(v, offset, f);
            if constexpr (kBlock == Block::kNan) code = s.nan_lanes ? splat_i(f.nan_byte) : code;
            store_bytes(static_cast<uint8_t*>(out), index, code, n);
        } else {
            f32v value = rounded_element(v, f) * s.scale;
            if constexpr (kBlock == Block::kNan) value = (f32v)(s.nan_lanes ? splat_i((int32_t)kQuietNanBits) : (i32v)value);
            if constexpr (kOut == BF16 && kBlock == Block::kNormalResults) {
                u16v h = __builtin_convertvector((u32v)value >> 16, u16v);
                copy_lanes<uint16_t>(static_cast<uint16_t*>(out) + index, &h, n);
            } else {
                store<kOut>(out, index, value, n);
            }
        }
    }
}

template <int32_t kIn, int32_t kOut, bool kClamp>
inline void quantize_strip(Block block, const void* x, void* out, int64_t start, int64_t stride, int64_t count,
                           int n, const LaneScales& s, int32_t offset, const MXFormat& f) {
    switch (block) {
        case Block::kNan:
            quantize_strip<kIn, kOut, kClamp, Block::kNan>(x, out, start, stride, count, n, s, offset, f);
            break;
        case Block::kFinite:
            quantize_strip<kIn, kOut, kClamp, Block::kFinite>(x, out, start, stride, count, n, s, offset, f);
            break;
        case Block::kNormalResults:
            quantize_strip<kIn, kOut, kClamp, Block::kNormalResults>(x, out, start, stride, count, n, s, offset, f);
            break;
    }
}

// The Block kind of blocks whose scale bytes lie in [smallest, largest].
template <int32_t kOut>
inline Block block_kind(int32_t smallest, int32_t largest, const MXFormat& f) {
    if (largest == kE8M0Nan) return Block::kNan;
    if (kOut == BF16 && smallest >= normal_results_min_byte(f)) return Block::kNormalResults;
    return Block::kFinite;
}

// The Block kind of lanes with these scale bytes (the first n lanes count).
template <int32_t kOut>
inline Block block_kind(i32v bytes, int n, const MXFormat& f) {
    i32v used = bytes;
    for (int lane = n; lane < kLanes; ++lane) used[lane] = bytes[0];
    return block_kind<kOut>(horizontal_min(used), horizontal_max(used), f);
}

// The first element of a column-layout unit: the (batch, block) strip of block_size rows.
inline int64_t unit_start(int64_t unit, int64_t blocks, int64_t length, int64_t block_size, int64_t width) {
    return ((unit / blocks) * length + (unit % blocks) * block_size) * width;
}

// The lanes of the vector at `column` of a row of `width` elements (the last may be partial).
inline int lanes_at(int64_t column, int64_t width) { return (int)(width - column < kLanes ? width - column : kLanes); }

// Work smaller than this many elements runs on the calling thread: an OpenMP parallel region
// costs a few microseconds, about what 2**14 elements take.
constexpr int64_t kParallelMinElements = 1 << 14;

// ---- row layout: (rows, length), blocks of block_size consecutive elements along each row;
// scales (rows, length / block_size). block_size is a multiple of 16. A contiguous operand's
// blocks follow one another across rows, as do their scales, so the kernel runs over the
// sequence of all blocks, 16 at a time, whatever the row length. ----

// The blocks first, ..., first + group - 1 of the row layout, all of one finite Block kind:
// by bit rounding (lane j of `rounding`) those whose lanes of `clean` are set, the others in
// fp32 arithmetic (lane j of `s`).
template <int32_t kIn, int32_t kOut, bool kClamp, Block kBlock>
inline void quantize_group(const void* x, void* out, int64_t first, int group, int64_t block_size,
                           const LaneScales& s, const BitRounding& rounding, i32v clean, int32_t offset,
                           const MXFormat& f) {
    const int64_t vectors = block_size / kLanes;
    for (int j = 0; j < group; ++j) {
        const int64_t start = (first + j) * block_size;
        if constexpr (kBitRounding<kIn, kOut>) {
            if (clean[j]) {
                bit_rounded_strip<kOut, kClamp>(x, out, start, kLanes, vectors, kLanes, broadcast_lane(rounding, j));
                continue;
            }
        }
        quantize_strip<kIn, kOut, kClamp, kBlock>(x, out, start, kLanes, vectors, kLanes, broadcast_lane(s, j), offset, f);
    }
}

template <int32_t kIn, int32_t kOut, bool kClamp>
void quantize_rows(const void* x, void* out, uint8_t* scales, int64_t rows, int64_t length,
                   int64_t block_size, int threads, const MXFormat* format) {
    // Private copies per thread (firstprivate): the byte stores may alias the memory of a shared
    // format, which would reload its fields in every iteration.
    const MXFormat f = *format;
    const int32_t offset = fp8_rounding_offset(f);
    const int64_t blocks = rows * (length / block_size), vectors = block_size / kLanes;
    const int64_t groups = (blocks + kLanes - 1) / kLanes;
    constexpr bool kBitPath = kBitRounding<kIn, kOut>;
#pragma omp parallel for schedule(static) num_threads(threads) firstprivate(f) if (rows * length >= kParallelMinElements)
    for (int64_t group_index = 0; group_index < groups; ++group_index) {
        // 16 blocks (the last group: what remains): their amax (and smallest magnitudes), then
        // their scales as one vector, then their elements, each block with its scale
        // broadcast (its data in L1).
        const int64_t first = group_index * kLanes;
        const int group = (int)(blocks - first < kLanes ? blocks - first : kLanes);
        i32v partial[kLanes] = {}, least[kLanes] = {};
        for (int j = 0; j < group; ++j)
            partial[j] = strip_amax<kIn>(x, (first + j) * block_size, kLanes, vectors, kLanes, kBitPath ? &least[j] : nullptr);
        const i32v bytes = scale_bytes(lane_maxima(partial), f);
        const LaneScales s = lane_scales(bytes);
        if (scales) store_bytes(scales, first, bytes, group);
        BitRounding rounding{};
        i32v clean{};
        if constexpr (kBitPath) {  // the group's rounding converted once, broadcast per block
            const BitBounds bits = bit_bounds(bytes, f);
            rounding = bit_rounding(bytes, bits.clamp, f);
            clean = lane_minima(least) >= bits.normal_min_less_one;
        }
        switch (block_kind<kOut>(bytes, group, f)) {
            case Block::kNan:  // rare: each block's own kind, in fp32 arithmetic
                for (int j = 0; j < group; ++j) {
                    quantize_strip<kIn, kOut, kClamp>(block_kind<kOut>(bytes[j], bytes[j], f), x, out,
                                                      (first + j) * block_size, kLanes, vectors, kLanes,
                                                      broadcast_lane(s, j), offset, f);
                }
                break;
            case Block::kFinite:
                quantize_group<kIn, kOut, kClamp, Block::kFinite>(x, out, first, group, block_size, s, rounding, clean,
                                                                  offset, f);
                break;
            case Block::kNormalResults:
                quantize_group<kIn, kOut, kClamp, Block::kNormalResults>(x, out, first, group, block_size, s, rounding,
                                                                         clean, offset, f);
                break;
        }
    }
}

// ---- column layout: (batch, length, width), blocks of block_size elements along the middle
// axis; scales (batch, length / block_size, width). A unit is one (batch, block) strip of
// block_size rows; the lanes run along the width, so the amax is a vertical maximum. ----

// strip(start, scales_index, n) for every vector-wide strip of the column layout: the n lanes
// at `start` of block_size rows `width` apart, whose scale bytes are at `scales_index`. Units
// are split across `threads`; each thread runs its own copy of `strip` (firstprivate: the byte
// stores may alias the memory of a shared one, and its captures would be reloaded every
// iteration).
template <typename Strip>
inline void for_each_column_strip(int64_t batch, int64_t length, int64_t width, int64_t block_size, int threads,
                                  Strip strip) {
    const int64_t blocks = length / block_size, units = batch * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) firstprivate(strip) if (batch * length * width >= kParallelMinElements)
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t start = unit_start(unit, blocks, length, block_size, width);
        for (int64_t column = 0; column < width; column += kLanes)
            strip(start + column, unit * width + column, lanes_at(column, width));
    }
}

template <int32_t kIn, int32_t kOut, bool kClamp>
void quantize_columns(const void* x, void* out, uint8_t* scales, int64_t batch, int64_t length,
                      int64_t width, int64_t block_size, int threads, const MXFormat* format) {
    const MXFormat f = *format;
    const int32_t offset = fp8_rounding_offset(f);
    constexpr bool kBitPath = kBitRounding<kIn, kOut>;
    for_each_column_strip(batch, length, width, block_size, threads, [=](int64_t start, int64_t scales_index, int n) {
        i32v least{};
        const i32v bytes = scale_bytes(strip_amax<kIn>(x, start, width, block_size, n, kBitPath ? &least : nullptr), f);
        if (scales) store_bytes(scales, scales_index, bytes, n);
        if constexpr (kBitPath) {
            const BitBounds bits = bit_bounds(bytes, f);
            if (!any_lane(least < bits.normal_min_less_one)) {
                bit_rounded_strip<kOut, kClamp>(x, out, start, width, block_size, n, bit_rounding(bytes, bits.clamp, f));
                return;
            }
        }
        quantize_strip<kIn, kOut, kClamp>(block_kind<kOut>(bytes, n, f), x, out, start, width, block_size, n,
                                          lane_scales(bytes), offset, f);
    });
}

// ---- dequantization: fp8 bytes times their block's scale, as the output dtype ----

// 2**(127 - exponent_bias): see fp8_values.
inline float unbias_factor(const MXFormat& f) { return std::ldexp(1.0f, kF32ExponentBias - f.exponent_bias); }

// kTruncate: bf16 results by truncation, exact where every nonzero result is a normal fp32
// value (Block::kNormalResults; NaN stays NaN: its quiet bit is kept).
template <int32_t kOut, bool kTruncate>
inline void dequantize_lanes(const uint8_t* data, void* out, int64_t index, f32v scale, float unbias,
                             const MXFormat& f, int n) {
    u8v b{};
    copy_lanes<uint8_t>(&b, data + index, n);
    const f32v value = fp8_values(widen_bytes(b), unbias, f) * scale;
    if constexpr (kTruncate) {
        u16v h = __builtin_convertvector((u32v)value >> 16, u16v);
        copy_lanes<uint16_t>(static_cast<uint16_t*>(out) + index, &h, n);
    } else {
        store<kOut>(out, index, value, n);
    }
}

// `count` vectors of n lanes at start, start + stride, ... dequantized with their scales.
template <int32_t kOut>
inline void dequantize_strip(Block block, const uint8_t* data, void* out, int64_t start, int64_t stride,
                             int64_t count, int n, f32v scale, float unbias, const MXFormat& f) {
    if (block == Block::kNormalResults) {
        for (int64_t k = 0; k < count; ++k) dequantize_lanes<kOut, true>(data, out, start + k * stride, scale, unbias, f, n);
    } else {
        for (int64_t k = 0; k < count; ++k) dequantize_lanes<kOut, false>(data, out, start + k * stride, scale, unbias, f, n);
    }
}

template <int32_t kOut>
void dequantize_rows(const uint8_t* data, const uint8_t* scales, void* out, int64_t rows,
                     int64_t length, int64_t block_size, int threads, const MXFormat* format) {
    // Private copies per thread (firstprivate): see quantize_rows.
    const MXFormat f = *format;
    const float unbias = unbias_factor(f);
    const int64_t blocks = length / block_size;
#pragma omp parallel for schedule(static) num_threads(threads) firstprivate(f) if (rows * length >= kParallelMinElements)
    for (int64_t row = 0; row < rows; ++row) {
        for (int64_t block = 0; block < blocks; ++block) {
            const int32_t byte = scales[row * blocks + block];
            dequantize_strip<kOut>(block_kind<kOut>(byte, byte, f), data, out, row * length + block * block_size, kLanes,
                                   block_size / kLanes, kLanes, scale_from_bytes(splat_i(byte)), unbias, f);
        }
    }
}

template <int32_t kOut>
void dequantize_columns(const uint8_t* data, const uint8_t* scales, void* out, int64_t batch,
                        int64_t length, int64_t width, int64_t block_size, int threads,
                        const MXFormat* format) {
    const MXFormat f = *format;
    const float unbias = unbias_factor(f);
    for_each_column_strip(batch, length, width, block_size, threads, [=](int64_t start, int64_t scales_index, int n) {
        u8v b{};
        copy_lanes<uint8_t>(&b, scales + scales_index, n);
        const i32v bytes = widen_bytes(b);
        dequantize_strip<kOut>(block_kind<kOut>(bytes, n, f), data, out, start, width, block_size, n,
                               scale_from_bytes(bytes), unbias, f);
    });
}

// Dispatch on the runtime dtypes to the instantiation for them.
template <template <int32_t, int32_t> class Kernel, typename... Args>
int dispatch_in_out(int32_t in, int32_t out, Args... args) {
#define MX_CASE(I, O) if (in == I && out == O) { Kernel<I, O>::run(args...); return 0; }
    MX_CASE(BF16, FP8) MX_CASE(BF16, BF16) MX_CASE(BF16, F16) MX_CASE(BF16, F32)
    MX_CASE(F16, FP8) MX_CASE(F16, BF16) MX_CASE(F16, F16) MX_CASE(F16, F32)
    MX_CASE(F32, FP8) MX_CASE(F32, BF16) MX_CASE(F32, F16) MX_CASE(F32, F32)
#undef MX_CASE
    return 1;
}

// The floor and even rules need the elements clamped (see scaled_element); the others do not.
inline bool needs_clamp(const MXFormat* format) {
    return format->scale_mode == FLOOR || format->scale_mode == EVEN;
}

template <int32_t kIn, int32_t kOut>
struct QuantizeRows {
    static void run(const void* x, void* out, uint8_t* scales, int64_t rows, int64_t length, int64_t block_size,
                    int threads, const MXFormat* format) {
        if (needs_clamp(format)) {
            quantize_rows<kIn, kOut, true>(x, out, scales, rows, length, block_size, threads, format);
        } else {
            quantize_rows<kIn, kOut, false>(x, out, scales, rows, length, block_size, threads, format);
        }
    }
};
template <int32_t kIn, int32_t kOut>
struct QuantizeColumns {
    static void run(const void* x, void* out, uint8_t* scales, int64_t batch, int64_t length, int64_t width,
                    int64_t block_size, int threads, const MXFormat* format) {
        if (needs_clamp(format)) {
            quantize_columns<kIn, kOut, true>(x, out, scales, batch, length, width, block_size, threads, format);
        } else {
            quantize_columns<kIn, kOut, false>(x, out, scales, batch, length, width, block_size, threads, format);
        }
    }
};

}  // namespace

// The exported entry points return 0, or 1 for arguments they do not handle (a dtype
// combination, or row blocks that are not whole vectors). The quantize entry points take a
// null `scales` where the caller wants no scale bytes (fake quantization).
extern "C" {

int mx_quantize_rows(const void* x, int32_t in_dtype, void* out, int32_t out_dtype, uint8_t* scales,
                     int64_t rows, int64_t length, int64_t block_size, int32_t threads,
                     const MXFormat* format) {
    if (block_size % kLanes) return 1;
    return dispatch_in_out<QuantizeRows>(in_dtype, out_dtype, x, out, scales, rows, length, block_size,
                                         (int)threads, format);
}

int mx_quantize_columns(const void* x, int32_t in_dtype, void* out, int32_t out_dtype, uint8_t* scales,
                        int64_t batch, int64_t length, int64_t width, int64_t block_size,
                        int32_t threads, const MXFormat* format) {
    return dispatch_in_out<QuantizeColumns>(in_dtype, out_dtype, x, out, scales, batch, length, width,
                                            block_size, (int)threads, format);
}

int mx_dequantize_rows(const uint8_t* data, const uint8_t* scales, void* out, int32_t out_dtype,
                       int64_t rows, int64_t length, int64_t block_size, int32_t threads,
                       const MXFormat* format) {
    if (block_size % kLanes) return 1;
    switch (out_dtype) {
        case BF16: dequantize_rows<BF16>(data, scales, out, rows, length, block_size, threads, format); return 0;
        case F16: dequantize_rows<F16>(data, scales, out, rows, length, block_size, threads, format); return 0;
        case F32: dequantize_rows<F32>(data, scales, out, rows, length, block_size, threads, format); return 0;
        default: return 1;
    }
}

int mx_dequantize_columns(const uint8_t* data, const uint8_t* scales, void* out, int32_t out_dtype,
                          int64_t batch, int64_t length, int64_t width, int64_t block_size,
                          int32_t threads, const MXFormat* format) {
    switch (out_dtype) {
        case BF16: dequantize_columns<BF16>(data, scales, out, batch, length, width, block_size, threads, format); return 0;
        case F16: dequantize_columns<F16>(data, scales, out, batch, length, width, block_size, threads, format); return 0;
        case F32: dequantize_columns<F32>(data, scales, out, batch, length, width, block_size, threads, format); return 0;
        default: return 1;
    }
}

}  // extern "C"
