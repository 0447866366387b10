"""E2M1 (FP4) elements: codes, packing, and rounding to the E2M1 grid, nearest-even or stochastic.

A code is the 4-bit pattern s.ee.m (sign, two exponent bits with bias 1, one mantissa bit); the
values are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (OCP MX v1.0 section 5.3.3). E2M1 has no Inf or NaN:
`encode_e2m1` saturates at +-6 and maps NaN to code 0 (+0). Quantizers never rely on that: they
give a block holding a NaN a NaN scale, which makes every element of it NaN on dequantization.

Packing: two codes per byte, along one axis; the element with the even index along that axis
goes in the low nibble (bits 3..0), the next one in the high nibble (bits 7..4). That is the
layout of torch.float4_e2m1fn_x2 (c10/util/Float4_e2m1fn_x2.h in torch 2.13: "val1 : val0 |
7654 : 3210") and of Triton's `tl.dot_scaled` "e2m1" operands (triton/language/core.py in
Triton 3.9: "Fp4 elements are packed into uint8 inputs with the first element in lower bits",
packed along K unless `lhs_k_pack` / `rhs_k_pack` is False).

Stochastic rounding: |v| (already scaled and clamped to [0, 6]) lies between two neighbours
lo <= |v| <= hi of the grid, whose gap hi - lo is a power of two; the result is hi when
u < (|v| - lo) / (hi - lo) for a uniform u in [0, 1), else lo. Both the fraction and the result
are exact in fp32, so E[result] = |v| up to the resolution of u (see `uniform_noise`).
"""

from __future__ import annotations

import torch

from .formats import E2M1, F32_MANTISSA_BITS, NamedEnum
from .rounding import min_normal_exponent, round_to_element

# The nibble layout of a packed byte.
NIBBLE_BITS = 4
NIBBLE_MASK = (1 << NIBBLE_BITS) - 1
E2M1_SIGN_BIT = 1 << (E2M1.bits - 1)  # 0b1000
E2M1_CODES = 1 << E2M1.bits  # 16 codes, 0b0000 .. 0b1111

_EMIN = min_normal_exponent(E2M1)  # 0: the smallest normal magnitude is 2**0 = 1
_BIAS = 1 - _EMIN
_SUBNORMAL_QUANTUM = 2.0 ** (_EMIN - E2M1.mantissa_bits)  # 0.5, the spacing below 2**emin


def _magnitude_of_code(code: int) -> float:
    """The magnitude of a code's low three bits, from the bit fields (not from a value list)."""
    field = (code & ~E2M1_SIGN_BIT) >> E2M1.mantissa_bits
    mantissa = code & ((1 << E2M1.mantissa_bits) - 1)
    if field == 0:
        return mantissa * _SUBNORMAL_QUANTUM
    return (1.0 + mantissa / (1 << E2M1.mantissa_bits)) * 2.0 ** (field - _BIAS)


# Code -> value, for all 16 codes (code 0b1000 is -0.0).
E2M1_VALUES: tuple[float, ...] = tuple(
    -_magnitude_of_code(c) if c & E2M1_SIGN_BIT else _magnitude_of_code(c) for c in range(E2M1_CODES)
)


class Rounding(NamedEnum):
    """How a scaled value becomes an element.

    nearest: round to nearest, ties to even (the IEEE default; what `cvt.rn` does).
    stochastic: round up with probability equal to the distance from the grid point below, in
        units of the gap (unbiased); needs a uniform noise tensor of the same shape.
    """

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


def rounding_named(name: str | Rounding, *, argument: str = "rounding") -> Rounding:
    """Look up a rounding by name, with an error that lists what is accepted."""
    try:
        return Rounding(name)
    except ValueError:
        raise ValueError(
            f"{argument}={name!r} is not a supported rounding; accepted: {[r.value for r in Rounding]}"
        ) from None


def _saturate(v: torch.Tensor) -> torch.Tensor:
    """fp32 v clamped to [-6, 6] (NaN stays NaN)."""
    return v.to(torch.float32).clamp(-E2M1.max_normal, E2M1.max_normal)


def round_e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """v rounded to the E2M1 grid, ties to even, saturating at +-6; fp32 values, NaN for NaN."""
    return round_to_element(_saturate(v), E2M1)


def e2m1_gap(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of the E2M1 grid at each magnitude in [0, 6]: 0.5 below 2, 1 in [2, 4), 2 in
    [4, 6] (the spacing of the binade holding it; subnormals share the lowest normal spacing)."""
    gap = torch.full_like(magnitude, _SUBNORMAL_QUANTUM)
    for exponent in range(_EMIN + 1, E2M1.emax + 1):
        gap = torch.where(magnitude >= 2.0**exponent, 2.0 ** (exponent - E2M1.mantissa_bits), gap)
    return gap


def round_e2m1_stochastic(v: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """v rounded stochastically to the E2M1 grid, saturating at +-6; fp32 values, NaN for NaN.

    `uniform` holds one draw in [0, 1) per element (same shape as v). With lo the grid point at
    or below |v| and gap the spacing there, the magnitude is lo + gap when
    uniform < (|v| - lo) / gap, else lo; the sign is v's (signed zeros kept). Every step is exact
    in fp32: |v| / gap and its floor are exact (gap is a power of two), |v| - lo is exact
    (Sterbenz) and so is the fraction. A value on the grid is returned unchanged.
    """
    if uniform.shape != v.shape:
        raise ValueError(f"uniform has shape {tuple(uniform.shape)}; it must match v's {tuple(v.shape)}")
    saturated = _saturate(v)
    magnitude = saturated.abs()
    gap = e2m1_gap(magnitude)
    lo = torch.floor(magnitude / gap) * gap
    fraction = (magnitude - lo) / gap
    rounded = torch.where(uniform.to(torch.float32) < fraction, lo + gap, lo)
    return torch.copysign(torch.where(magnitude.isnan(), magnitude, rounded), saturated)


def round_e2m1(
    v: torch.Tensor, rounding: Rounding = Rounding.NEAREST, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """v rounded to the E2M1 grid with `rounding` (stochastic rounding needs `uniform`)."""
    rounding = rounding_named(rounding)
    if rounding is Rounding.STOCHASTIC:
        if uniform is None:
            raise ValueError("uniform is None; rounding='stochastic' needs a noise tensor (uniform_noise)")
        return round_e2m1_stochastic(v, uniform)
    if uniform is not None:
        raise ValueError("uniform is given but rounding='nearest' uses no noise")
    return round_e2m1_nearest(v)


def uniform_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 draws in [0, 1) for stochastic rounding, from `generator` or a fresh one seeded with
    `seed` (exactly one of the two), moved to `device`.

    Drawn on the generator's device with `torch.rand`: on the CPU, each fp32 draw is k * 2**-24
    for a 24-bit k from the Mersenne twister (ATen's uniform_real_distribution), drawn serially,
    so a seed gives the same bits on every machine. Stochastic rounding is then exactly unbiased
    wherever the fraction (|v| - lo) / gap is a multiple of 2**-24 (every |v| >= 0.5); below
    0.5 the bias is under 2**-24 of the gap.
    """
    if (generator is None) == (seed is None):
        raise ValueError("give exactly one of generator= and seed= for stochastic rounding")
    if generator is None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an int")
        generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(tuple(shape), generator=generator, dtype=torch.float32, device=generator.device)
    return draws if device is None else draws.to(device)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """The uint8 codes (0..15) of fp32 values already on the E2M1 grid (`round_e2m1`'s output):
    sign bit 3, then the exponent field and mantissa bit. NaN gives code 0 (+0); -0 gives 0b1000.

    Computed from the value's fp32 bits: a normal magnitude 2**e * (1 + m/2) has field e + bias
    and mantissa bit m (the top fp32 mantissa bit); the subnormal 0.5 is code 1, zero is 0.
    """
    values = values.to(torch.float32)
    magnitude = values.abs()
    bits = magnitude.view(torch.int32)
    field = (bits >> F32_MANTISSA_BITS) - (127 - _BIAS)  # fp32 bias 127 -> E2M1 bias 1
    mantissa = (bits >> (F32_MANTISSA_BITS - E2M1.mantissa_bits)) & ((1 << E2M1.mantissa_bits) - 1)
    normal = (field << E2M1.mantissa_bits) | mantissa
    subnormal = (magnitude / _SUBNORMAL_QUANTUM).to(torch.int32)  # 0 or 1, exact on the grid
    code = torch.where(magnitude >= 2.0**_EMIN, normal, subnormal)
    code = code | torch.where(torch.signbit(values), E2M1_SIGN_BIT, 0)
    return torch.where(values.isnan(), 0, code).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of uint8 codes (the low nibble of each byte is read), as `dtype` (exact)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & NIBBLE_MASK).long()].to(dtype)


def pack_e2m1(codes: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Two codes per byte along `axis` (its length must be even): element 2i in the low nibble,
    element 2i + 1 in the high nibble. The output has `axis` halved and dtype uint8."""
    axis = axis % codes.ndim
    if codes.shape[axis] % 2:
        raise ValueError(f"codes.shape[{axis}]={codes.shape[axis]} must be even to pack two codes per byte")
    pairs = codes.to(torch.uint8).unflatten(axis, (codes.shape[axis] // 2, 2))
    low, high = pairs.select(axis + 1, 0), pairs.select(axis + 1, 1)
    return (low & NIBBLE_MASK) | (high << NIBBLE_BITS)


def unpack_e2m1(packed: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """The codes `pack_e2m1` packed along `axis` (which doubles), one per uint8."""
    axis = axis % packed.ndim
    packed = packed.view(torch.uint8) if packed.dtype == torch.float4_e2m1fn_x2 else packed
    codes = torch.stack((packed & NIBBLE_MASK, packed >> NIBBLE_BITS), dim=axis + 1)
    return codes.flatten(axis, axis + 1)


def as_float4_e2m1fn_x2(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 bytes viewed as torch.float4_e2m1fn_x2, bit for bit (same nibble order)."""
    return packed.view(torch.float4_e2m1fn_x2)


__all__ = [
    "E2M1_VALUES",
    "NIBBLE_BITS",
    "Rounding",
    "as_float4_e2m1fn_x2",
    "decode_e2m1",
    "e2m1_gap",
    "encode_e2m1",
    "pack_e2m1",
    "round_e2m1",
    "round_e2m1_nearest",
    "round_e2m1_stochastic",
    "rounding_named",
    "uniform_noise",
    "unpack_e2m1",
]
