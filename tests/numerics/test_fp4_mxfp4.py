"""MXFP4 (E2M1 in blocks of 32, E8M0 scales in the four MXFP8 scale modes) bit for bit against
`fp4_reference`, along both axes, on multi-octave data, special values and hypothesis inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4_reference as ref
from mxcompile.numerics import (
    E2M1,
    E4M3,
    MXFP4,
    ScaleMode,
    dequantize_fp4,
    encode_e2m1,
    fake_quantize_fp4_along,
    fake_quantize_mxfp4_along,
    quantize_mxfp4,
    round_e2m1,
    scale_bytes_from_amax,
    scale_fp32_from_amax,
    scale_fp32_from_bytes,
)
from mxcompile.numerics.quantize import split_blocks
from mxcompile.numerics.scales import inverse_scale_fp32_from_bytes

BLOCK = MXFP4.block_size
MODES = [m.value for m in ScaleMode]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _implementation(x: torch.Tensor, axis: int, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = quantize_mxfp4(x, axis, scale_mode=scale_mode)
    return t.scale.view(torch.uint8), t.codes


def _check(x: torch.Tensor, scale_mode: str, axis: int, quantize=_implementation) -> None:
    """Scales, codes, dequantized values and the fake quantizer against the reference, row by
    row along the quantization axis (raises AssertionError on any difference)."""
    rows = x.float().tolist() if axis == 1 else x.float().t().tolist()
    scales, codes = quantize(x, axis, scale_mode)
    if axis == 0:
        scales, codes = scales.t(), codes.t()
    want_deq = []
    for row, got_s, got_c in zip(rows, scales.tolist(), codes.tolist()):
        want_row = []
        for b, start in enumerate(range(0, len(row), BLOCK)):
            byte, want_codes = ref.mxfp4_block(row[start : start + BLOCK], scale_mode)
            assert got_s[b] == byte, (scale_mode, axis, row[start : start + BLOCK], got_s[b], byte)
            assert got_c[start : start + BLOCK] == want_codes, (scale_mode, axis, row[start : start + BLOCK])
            want_row.extend(ref.mxfp4_dequantize_block(byte, want_codes))
        want_deq.append(want_row)
    if quantize is not _implementation:
        return
    want = torch.tensor(want_deq, dtype=torch.float32)
    want = want if axis == 1 else want.t()
    got = quantize_mxfp4(x, axis, scale_mode=scale_mode).dequantize()
    fake = fake_quantize_mxfp4_along(x, axis, ScaleMode(scale_mode))
    for have in (got, fake):
        same = (have.view(torch.int32) == want.view(torch.int32)) | (have.isnan() & want.isnan())
        assert same.all(), (scale_mode, axis, have[~same][:4], want[~same][:4])


def _octave_data(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Magnitudes varying over many octaves along rows and columns (FACTS: iid Gaussian data
    cannot tell a right block axis from a wrong one)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    row_scale = 2.0 ** torch.randint(-12, 12, (rows, 1), generator=g).float()
    col_scale = 2.0 ** torch.randint(-12, 12, (1, cols), generator=g).float()
    return x * row_scale * col_scale


@pytest.mark.parametrize("scale_mode", MODES)
@pytest.mark.parametrize("axis", [0, 1])
def test_octave_data_matches_reference(scale_mode: str, axis: int) -> None:
    x = _octave_data(64, 64, seed=3)
    _check(x.bfloat16() if axis else x, scale_mode, axis)


def _special_rows() -> list[list[float]]:
    mags = list(ref.E2M1_MAGNITUDES)
    midpoints = [(a + b) / 2 for a, b in zip(mags, mags[1:])]
    rows = [
        [0.0] * BLOCK,  # all-zero block: scale byte 0, codes 0
        [-0.0] * BLOCK,  # signed zeros kept
        [math.nan] + [1.0] * (BLOCK - 1),  # NaN block: 0xFF, codes +0
        [math.inf] + [1.0] * (BLOCK - 1),
        [-math.inf] + [0.0] * (BLOCK - 1),
        # Saturation in floor mode: 7 * 2**k has scale 2**(k + 2 - 2) and 7 > 6 saturates.
        [7.0 * 2.0**10] + [-7.0 * 2.0**10] + [1.0] * (BLOCK - 2),
        # Ties of the E2M1 grid after scaling by 1 (amax 6 or 4 gives scale 1 in several modes).
        ([6.0] + midpoints + [-m for m in midpoints] + mags + [0.0] * BLOCK)[:BLOCK],
        ([4.0] + midpoints + mags + [-m for m in mags] + [0.0] * BLOCK)[:BLOCK],
        # fp32 subnormals and the bottom of the E8M0 range (scale byte 0, elements underflow).
        [2.0**-149, 2.0**-140, -(2.0**-130), 2.0**-127] + [0.0] * (BLOCK - 4),
        # The top of fp32: rceil / ceil / even give scales past 2**127 / saturate.
        [3.4e38, -3.0e38, 1e38, 1.0] + [0.0] * (BLOCK - 4),
        # One large value and values 2**20 below it (underflow inside a block).
        [1.0] + [2.0**-20 * (i + 1) for i in range(BLOCK - 1)],
    ]
    return [[ref.round_fp32(v) if math.isfinite(v) else v for v in row] for row in rows]


@pytest.mark.parametrize("scale_mode", MODES)
def test_special_values_match_reference(scale_mode: str) -> None:
    rows = _special_rows()
    x = torch.tensor(rows, dtype=torch.float32)
    _check(x, scale_mode, 1)
    _check(x.t().contiguous(), scale_mode, 0)


def test_special_values_by_hand() -> None:
    """A few bytes worked out on paper, pinning the reference too."""
    x = torch.tensor([[6.0, 3.0, -0.75, 0.25] + [0.0] * (BLOCK - 4)])
    t = quantize_mxfp4(x, scale_mode="floor")
    # amax 6: floor(log2 6) - emax(2) = 0 -> byte 127; codes 6 -> 0x7, 3 -> 0x5,
    # -0.75 -> tie between 0.5 and 1 -> 1 (even) -> 0xA, 0.25 -> tie between 0 and 0.5 -> 0.
    assert t.scale.view(torch.uint8).tolist() == [[127]]
    assert t.codes[0, :4].tolist() == [0x7, 0x5, 0xA, 0x0]
    nan_block = quantize_mxfp4(torch.tensor([[math.nan] + [1.0] * (BLOCK - 1)]))
    assert nan_block.scale.view(torch.uint8).tolist() == [[0xFF]]
    assert nan_block.codes.tolist() == [[0] * BLOCK] and nan_block.dequantize().isnan().all()


def test_scale_float_form_matches_bytes_for_e2m1() -> None:
    """`scale_fp32_from_amax` (the fake quantizer's bitcast-free scales) equals the byte rule for
    the E2M1 row at every fp32 exponent with the mantissas where a rule flips."""
    full = 1 << 23
    runs = {full - (1 << k) + d for k in range(24) for d in (-1, 0, 1)}
    mantissas = sorted({0, 1, full >> 1, full - 1} | runs)
    mantissas = torch.tensor([m for m in mantissas if 0 <= m < full], dtype=torch.int64)
    bits = (torch.arange(256, dtype=torch.int64)[:, None] << 23 | mantissas[None, :]).reshape(-1)
    amax = bits.to(torch.int32).view(torch.float32)
    for scale_mode in ScaleMode:
        want = scale_fp32_from_bytes(scale_bytes_from_amax(amax, E2M1, scale_mode))
        got = scale_fp32_from_amax(amax, E2M1, scale_mode)
        same = (want.view(torch.int32) == got.view(torch.int32)) | (want.isnan() & got.isnan())
        assert same.all(), (scale_mode, amax[~same][:4])


def _broken_e4m3_scales(x: torch.Tensor, axis: int, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A deliberately broken MXFP4: block scales from E4M3's emax/max instead of E2M1's."""
    blocks = split_blocks(x.float(), axis, BLOCK)
    amax = blocks.abs().amax(axis + 1, keepdim=True)
    scale_bytes = scale_bytes_from_amax(amax, E4M3, ScaleMode(scale_mode))
    codes = encode_e2m1(round_e2m1(blocks * inverse_scale_fp32_from_bytes(scale_bytes))).reshape(x.shape)
    return scale_bytes.squeeze(axis + 1).to(torch.uint8), codes


def _broken_block_16(x: torch.Tensor, axis: int, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A deliberately broken MXFP4: blocks of 16 (codes only; scales reported per 32 from the
    right quantizer so that only the grouping differs)."""
    good = quantize_mxfp4(x, axis, scale_mode=scale_mode)
    return good.scale.view(torch.uint8), quantize_mxfp4(x, axis, scale_mode=scale_mode, block_size=16).codes


@pytest.mark.parametrize("broken", [_broken_e4m3_scales, _broken_block_16])
def test_broken_variants_fail(broken) -> None:
    x = _octave_data(32, 64, seed=5)
    with pytest.raises(AssertionError):
        _check(x, "rceil", 1, quantize=broken)
    with pytest.raises(AssertionError):
        _check(x, "floor", 0, quantize=broken)


_BIG = 3.0000000054977558e38  # fp32(3e38)
_finite = st.floats(min_value=-_BIG, max_value=_BIG, allow_nan=False, width=32)
_octave = st.builds(
    lambda m, e: m * 2.0**e,
    st.sampled_from([1.0, 1.25, 1.5, 1.75, 1.125, -1.0, -1.75, 0.0]),
    st.integers(-30, 30),
)


@SETTINGS
@given(
    st.lists(st.one_of(_finite, _octave), min_size=BLOCK, max_size=BLOCK),
    st.sampled_from(MODES),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_hypothesis_blocks(values, scale_mode, dtype) -> None:
    x = torch.tensor([values], dtype=torch.float32).to(dtype)
    _check(x, scale_mode, 1)


def test_fake_quantize_row_dispatch_and_errors() -> None:
    x = _octave_data(4, 64, seed=1)
    assert torch.equal(fake_quantize_fp4_along(x, 1, MXFP4), fake_quantize_mxfp4_along(x, 1, ScaleMode.RCEIL))
    with pytest.raises(ValueError, match=r"x.shape\[1\]=48 .*block_size=32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="scale_mode='nearest' is not a supported scale mode"):
        quantize_mxfp4(x, scale_mode="nearest")
    with pytest.raises(ValueError, match="rounding='up' is not a supported rounding"):
        quantize_mxfp4(x, rounding="up")
    with pytest.raises(ValueError, match="needs a noise tensor"):
        quantize_mxfp4(x, rounding="stochastic")
    with pytest.raises(ValueError, match="block_2d=True applies to NVFP4 only"):
        fake_quantize_fp4_along(x, 1, MXFP4, block_2d=True)
    with pytest.raises(ValueError, match="t must be an FP4Tensor"):
        dequantize_fp4(x)  # type: ignore[arg-type]
