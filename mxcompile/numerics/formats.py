"""Element formats, block formats, E8M0 scales and scale modes of the OCP Microscaling (MX)
v1.0 format and of NVIDIA's NVFP4.

Every constant that the rest of mxcompile uses about the formats is defined here once. Two
tables: `ALL_ELEM_FORMATS` (E4M3, E5M2, E2M1: one row per element format) and `BLOCK_FORMATS`
(MXFP8 with either FP8 element, MXFP4, NVFP4: element format, block size, scale format, tensor
scale). `ELEM_FORMATS` is the FP8 part of the first table, the element formats that the MXFP8
ops and kernels accept.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import torch

# E8M0: byte b encodes 2**(b - E8M0_BIAS); byte E8M0_NAN encodes NaN. There is no zero.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_BYTE = 0xFE

# fp32 bit layout, used to read exponents exactly from amax values.
F32_MANTISSA_BITS = 23
F32_EXPONENT_MASK = 0xFF
F32_MANTISSA_MASK = (1 << F32_MANTISSA_BITS) - 1

DEFAULT_BLOCK_SIZE = 32
BLOCK_SIZE_MULTIPLE = 8  # block sizes must be positive multiples of this
NVFP4_BLOCK_SIZE = 16  # NVIDIA's NVFP4: 16 elements per E4M3 block scale

BITS_PER_BYTE = 8

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _to_fp32(value: float) -> float:
    """Round a Python float (binary64) to the nearest binary32 value."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass(frozen=True)
class ElemFormat:
    """A floating-point element format (FP8 or FP4): its storage dtype and the numbers the scale
    and rounding rules need. Every field is derived from the bit layout
    (1 sign, `exponent_bits`, `mantissa_bits`) and the largest finite value."""

    name: str
    # The torch storage dtype. FP8: one element per byte, castable with `.to`; E2M1:
    # torch.float4_e2m1fn_x2, two elements per byte, which torch cannot cast to or from.
    dtype: torch.dtype
    max_normal: float  # largest finite magnitude
    emax: int  # exponent of the largest power of two <= max_normal
    mantissa_bits: int
    # The code written for every element of a block whose scale is NaN: the positive NaN of an
    # FP8 format; E2M1 has no NaN (nor Inf), so +0 there, and the NaN scale carries the NaN.
    nan_byte: int
    exponent_bits: int
    bits: int  # width of one element: 8 (FP8) or 4 (FP4)

    def __post_init__(self) -> None:
        for field in ("emax", "mantissa_bits", "nan_byte", "exponent_bits", "bits"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ElemFormat.{field}={value!r} must be a non-negative int")
        if self.bits != 1 + self.exponent_bits + self.mantissa_bits:
            raise ValueError(
                f"ElemFormat.bits={self.bits} must be 1 + exponent_bits + mantissa_bits "
                f"= {1 + self.exponent_bits + self.mantissa_bits}"
            )
        if BITS_PER_BYTE % self.bits:
            raise ValueError(f"ElemFormat.bits={self.bits} must divide {BITS_PER_BYTE}")
        if not (isinstance(self.max_normal, float) and self.max_normal > 0):
            raise ValueError(f"ElemFormat.max_normal={self.max_normal!r} must be a positive float")

    @property
    def reciprocal_max_fp32(self) -> float:
        """fp32(1 / max_normal): the multiplier of the rceil rule, exactly representable in fp32."""
        return _to_fp32(1.0 / self.max_normal)

    @property
    def elements_per_byte(self) -> int:
        """How many elements one storage byte holds (E2M1: two, packed as nibbles)."""
        return BITS_PER_BYTE // self.bits


E4M3 = ElemFormat(
    "e4m3", torch.float8_e4m3fn, 448.0, emax=8, mantissa_bits=3, nan_byte=0x7F,
    exponent_bits=4, bits=8,
)
E5M2 = ElemFormat(
    "e5m2", torch.float8_e5m2, 57344.0, emax=15, mantissa_bits=2, nan_byte=0x7F,
    exponent_bits=5, bits=8,
)
# OCP MX v1.0 section 5.3.3: E2M1, bias 1, values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no Inf or NaN.
E2M1 = ElemFormat(
    "e2m1", torch.float4_e2m1fn_x2, 6.0, emax=2, mantissa_bits=1, nan_byte=0x0,
    exponent_bits=2, bits=4,
)

# Every element format, one row each.
ALL_ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E4M3, E5M2, E2M1)}
# The FP8 rows: the element formats of MXFP8, which `quantize_mx`, the ops and the kernels take.
ELEM_FORMATS: dict[str, ElemFormat] = {
    name: f for name, f in ALL_ELEM_FORMATS.items() if f.bits == BITS_PER_BYTE
}


class NamedEnum(str, enum.Enum):
    """A string enum whose str() and format() give its value (as 3.11's StrEnum does), so messages
    and reports read 'rceil', not 'ScaleMode.RCEIL'."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ElemFormatName(NamedEnum):
    """The name of an element format, as `MXConfig` carries it; `elem_format` gives the format."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"


class ScaleMode(NamedEnum):
    """How the shared E8M0 exponent of a block is derived from the block's amax.

    floor: OCP MX v1.0 section 6.3: floor(log2(amax)) - emax_elem. Can saturate.
    rceil: NVIDIA (cuBLAS, cvt.rp.ue8m0): descale = amax * fp32(1/max_elem), rounded up to a
           power of two. Never saturates. The default, as in NVIDIA's MXFP8 pre-training recipe.
    ceil:  ceil(log2(amax)) - emax_elem.
    even:  floor(log2(amax')) - emax_elem where amax' is amax rounded (half up) to the
           element format's mantissa width, so a block whose amax would round up to the next
           power of two in the element format gets the larger scale.
    """

    FLOOR = "floor"
    RCEIL = "rceil"
    CEIL = "ceil"
    EVEN = "even"


def elem_format(name: str | ElemFormat, *, argument: str = "elem") -> ElemFormat:
    """Look up an element format by name, with an error that lists what is accepted."""
    if isinstance(name, ElemFormat):
        return name
    if isinstance(name, str) and name in ELEM_FORMATS:
        return ELEM_FORMATS[name]
    raise ValueError(
        f"{argument}={name!r} is not a supported MX element format; accepted: "
        f"{sorted(ELEM_FORMATS)}"
    )


def scale_mode_named(name: str | ScaleMode, *, argument: str = "scale_mode") -> ScaleMode:
    """Look up a scale mode by name, with an error that lists what is accepted."""
    try:
        return ScaleMode(name)
    except ValueError:
        raise ValueError(
            f"{argument}={name!r} is not a supported scale mode; accepted: "
            f"{[m.value for m in ScaleMode]}"
        ) from None


def check_block_size(block_size: int, *, argument: str = "block_size") -> int:
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size <= 0
        or block_size % BLOCK_SIZE_MULTIPLE
    ):
        raise ValueError(
            f"{argument}={block_size!r} is not accepted; use a positive multiple of "
            f"{BLOCK_SIZE_MULTIPLE} (MX uses {DEFAULT_BLOCK_SIZE})"
        )
    return block_size


def any_elem_format(name: str | ElemFormat, *, argument: str = "elem") -> ElemFormat:
    """Look up any element format (FP8 or FP4) by name, with an error that lists what is accepted.
    `elem_format` accepts the FP8 formats only, as the MXFP8 code paths need."""
    if isinstance(name, ElemFormat):
        return name
    if isinstance(name, str) and name in ALL_ELEM_FORMATS:
        return ALL_ELEM_FORMATS[name]
    raise ValueError(
        f"{argument}={name!r} is not a supported element format; accepted: {sorted(ALL_ELEM_FORMATS)}"
    )


class ScaleFormat(NamedEnum):
    """How a block scale is stored.

    e8m0: a power of two 2**(b - 127) in one byte (OCP MX), derived by a `ScaleMode`.
    e4m3: an FP8 E4M3 value times an fp32 per-tensor scale (NVFP4), see `numerics.fp4`.
    """

    E8M0 = "e8m0"
    E4M3 = "e4m3"


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: elements of `elem` in blocks of `block_size` consecutive elements
    along the quantization axis, one `scale_format` scale per block and, where `tensor_scale`,
    one fp32 scale per tensor from the tensor's amax."""

    name: str
    elem: ElemFormat
    block_size: int
    scale_format: ScaleFormat
    tensor_scale: bool

    def __post_init__(self) -> None:
        check_block_size(self.block_size, argument="BlockFormat.block_size")
        if not isinstance(self.elem, ElemFormat):
            raise ValueError(f"BlockFormat.elem={self.elem!r} must be an ElemFormat")
        if not isinstance(self.scale_format, ScaleFormat):
            raise ValueError(f"BlockFormat.scale_format={self.scale_format!r} must be a ScaleFormat")
        if self.tensor_scale != (self.scale_format is ScaleFormat.E4M3):
            raise ValueError(
                f"BlockFormat.tensor_scale={self.tensor_scale!r}: an fp32 tensor scale goes with "
                f"E4M3 block scales (and only with them)"
            )


MXFP8_E4M3 = BlockFormat("mxfp8_e4m3", E4M3, DEFAULT_BLOCK_SIZE, ScaleFormat.E8M0, tensor_scale=False)
MXFP8_E5M2 = BlockFormat("mxfp8_e5m2", E5M2, DEFAULT_BLOCK_SIZE, ScaleFormat.E8M0, tensor_scale=False)
MXFP4 = BlockFormat("mxfp4", E2M1, DEFAULT_BLOCK_SIZE, ScaleFormat.E8M0, tensor_scale=False)
NVFP4 = BlockFormat("nvfp4", E2M1, NVFP4_BLOCK_SIZE, ScaleFormat.E4M3, tensor_scale=True)

# Every block format, one row each: MXFP8 and FP4 side by side.
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (MXFP8_E4M3, MXFP8_E5M2, MXFP4, NVFP4)}


def block_format(name: str | BlockFormat, *, argument: str = "block_format") -> BlockFormat:
    """Look up a block format by name, with an error that lists what is accepted."""
    if isinstance(name, BlockFormat):
        return name
    if isinstance(name, str) and name in BLOCK_FORMATS:
        return BLOCK_FORMATS[name]
    raise ValueError(
        f"{argument}={name!r} is not a supported block format; accepted: {sorted(BLOCK_FORMATS)}"
    )
