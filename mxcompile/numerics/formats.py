"""Element formats, E8M0 scales and scale modes of the OCP Microscaling (MX) v1.0 format.

Every constant that the rest of mxcompile uses about the formats is defined here once.
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

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _to_fp32(value: float) -> float:
    """Round a Python float (binary64) to the nearest binary32 value."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass(frozen=True)
class ElemFormat:
    """An FP8 element format: its torch dtype and the numbers the scale rules need."""

    name: str
    dtype: torch.dtype
    max_normal: float  # largest finite magnitude
    emax: int  # exponent of the largest power of two <= max_normal
    mantissa_bits: int
    nan_byte: int  # the positive NaN bit pattern, written for every element of a NaN block

    @property
    def reciprocal_max_fp32(self) -> float:
        """fp32(1 / max_normal): the multiplier of the rceil rule, exactly representable in fp32."""
        return _to_fp32(1.0 / self.max_normal)


E4M3 = ElemFormat("e4m3", torch.float8_e4m3fn, 448.0, 8, 3, 0x7F)
E5M2 = ElemFormat("e5m2", torch.float8_e5m2, 57344.0, 15, 2, 0x7F)

ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E4M3, E5M2)}


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
