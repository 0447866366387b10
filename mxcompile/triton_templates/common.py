"""Kernel-independent tables of the Triton kernels, importable without triton: the element
formats `tl.dot_scaled` takes, the fp32 -> FP8 cast strategies, and the FP8 exponent bias."""

from __future__ import annotations

from ..numerics.formats import ElemFormat

# The dot_scaled format name of each MX element format.
DOT_SCALED_FORMATS: dict[str, str] = {"e4m3": "e4m3", "e5m2": "e5m2"}

# Cast strategies for fp32 -> FP8 after the clamp (both round to nearest even):
#   "software": integer arithmetic on the fp32 bits. Exact everywhere; required under
#               TRITON_INTERPRET=1, whose fp32->fp8 conversion (triton 3.9) rounds ties away
#               and drops the mantissa carry into the exponent.
#   "hardware": `x.to(fp8, fp_downcast_rounding="rtne")` (cvt.rn.satfinite on sm89+). Faster;
#               check it with `benchmarks/gpu_kernels.py --check` on a GPU before relying on it.
CAST_MODES = ("software", "hardware")


def check_cast(cast: str) -> str:
    if cast not in CAST_MODES:
        raise ValueError(f"cast={cast!r} is not accepted; use one of {list(CAST_MODES)}")
    return cast


def exponent_bias(fmt: ElemFormat) -> int:
    """IEEE-style exponent bias of an FP8 format (7 for E4M3, 15 for E5M2)."""
    exponent_bits = 7 - fmt.mantissa_bits
    return (1 << (exponent_bits - 1)) - 1
