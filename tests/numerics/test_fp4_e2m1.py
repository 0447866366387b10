"""E2M1 elements: rounding to nearest even, codes, decoding and nibble packing, bit for bit
against `fp4_reference` (the magnitudes enumerated, the nearest picked), and the packing against
what torch.float4_e2m1fn_x2 and Triton's MXFP4 helpers hold."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4_reference as ref
from mxcompile.numerics import (
    E2M1,
    E2M1_VALUES,
    ELEM_FORMATS,
    as_float4_e2m1fn_x2,
    decode_e2m1,
    elem_format,
    encode_e2m1,
    pack_e2m1,
    round_e2m1,
    unpack_e2m1,
)

SETTINGS = settings(max_examples=60, deadline=None)
F32_ULP_AT_ONE = 2.0**-23


def _grid_edges() -> list[float]:
    """Every grid point and midpoint, each +-1 fp32 ulp, both signs, beyond the maximum, tiny
    values and zeros: where a rounding decision flips."""
    points = set(ref.E2M1_MAGNITUDES)
    mags = ref.E2M1_MAGNITUDES
    points.update((a + b) / 2 for a, b in zip(mags, mags[1:]))
    points.update({6.5, 7.0, 1e30, 2.0**-149, 2.0**-126, 0.1, 0.3})
    values = set()
    for p in points:
        for v in (p, math.nextafter(p, math.inf), math.nextafter(p, -math.inf)):
            f = ref.round_fp32(v)
            values.update({f, -f})
    return sorted(values) + [0.0, -0.0, math.inf, -math.inf, math.nan]


def _encoder_matches_reference(encode) -> None:
    """Raise AssertionError when `encode` (values -> codes) disagrees with the reference."""
    values = _grid_edges()
    got = encode(torch.tensor(values, dtype=torch.float32)).tolist()
    want = [ref.e2m1_encode(v) for v in values]
    bad = [(v, g, w) for v, g, w in zip(values, got, want) if g != w]
    assert not bad, bad[:6]


def _implementation(x: torch.Tensor) -> torch.Tensor:
    return encode_e2m1(round_e2m1(x))


def test_e2m1_row_of_the_format_table():
    assert E2M1.max_normal == 6.0 and E2M1.emax == 2 and E2M1.mantissa_bits == 1
    assert E2M1.exponent_bits == 2 and E2M1.bits == 4 and E2M1.elements_per_byte == 2
    assert E2M1.dtype == torch.float4_e2m1fn_x2
    assert "e2m1" not in ELEM_FORMATS  # MXFP8 paths keep taking FP8 only
    with pytest.raises(ValueError, match="elem='e2m1' is not a supported MX element format"):
        elem_format("e2m1")


def test_codes_decode_to_the_enumerated_values():
    codes = torch.arange(16, dtype=torch.uint8)
    got = decode_e2m1(codes)
    assert [math.copysign(1, v) * abs(v) for v in got.tolist()] == [ref.e2m1_decode(c) for c in range(16)]
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # code 0b1000 is -0
    assert list(E2M1_VALUES) == [ref.e2m1_decode(c) for c in range(16)]
    # Every value encodes back to its code (-0 included).
    assert encode_e2m1(got).tolist() == list(range(16))


def test_nearest_even_matches_reference_at_every_edge():
    _encoder_matches_reference(_implementation)


def test_nearest_even_fails_with_ties_away_from_zero():
    """A deliberately broken rounding (ties away from zero: 0.25 -> 0.5, 2.5 -> 3, 5 -> 6) is
    caught by the same check."""

    def ties_away(x: torch.Tensor) -> torch.Tensor:
        m = x.abs().clamp(max=E2M1.max_normal)
        grid = torch.tensor(ref.E2M1_MAGNITUDES)
        distance = (m[:, None] - grid).abs()
        best = torch.where(distance == distance.min(dim=1, keepdim=True).values, torch.arange(8), -1)
        code = best.amax(dim=1).to(torch.uint8)  # the larger of two tied candidates
        code = code | torch.where(torch.signbit(x), 8, 0).to(torch.uint8)
        return torch.where(x.isnan(), 0, code).to(torch.uint8)

    with pytest.raises(AssertionError):
        _encoder_matches_reference(ties_away)


@SETTINGS
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_nearest_even_hypothesis(values):
    got = _implementation(torch.tensor(values, dtype=torch.float32)).tolist()
    assert got == [ref.e2m1_encode(v) for v in values]


def test_nan_inf_and_signed_zero():
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 7.0, -1e38])
    assert _implementation(x).tolist() == [0, 0, 0x7, 0xF, 0x0, 0x8, 0x7, 0xF]


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF], [0x8, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    packed = pack_e2m1(codes, axis=1)
    assert packed.tolist() == [ref.pack(row) for row in codes.tolist()] == [[0x21, 0xF3], [0x08, 0x97]]
    assert torch.equal(unpack_e2m1(packed, axis=1), codes)
    # Along axis 0: pairs of rows.
    packed0 = pack_e2m1(codes, axis=0)
    assert packed0.tolist() == [[0x81, 0x02, 0x73, 0x9F]]
    assert torch.equal(unpack_e2m1(packed0, axis=0), codes)
    with pytest.raises(ValueError, match=r"codes.shape\[1\]=3 must be even"):
        pack_e2m1(codes[:, :3], axis=1)


@SETTINGS
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_pack_hypothesis(codes):
    packed = pack_e2m1(torch.tensor(codes, dtype=torch.uint8))
    assert packed.tolist() == ref.pack(codes)
    assert unpack_e2m1(packed).tolist() == codes == ref.unpack(ref.pack(codes))


def test_packing_is_torch_float4_e2m1fn_x2_and_triton_layout():
    """torch's float4_e2m1fn_x2 is a byte holding val0 in bits 3..0 (its header); Triton's
    MXFP4Tensor (triton/tools/mxfp.py, the helper of its dot_scaled tests) encodes with RNE and
    packs along a dim with the first element in the low nibble. Both agree with ours."""
    x = torch.tensor([[0.5, -6.0, 2.5, 1.25, -0.0, 3.0, 5.0, 0.75]])
    codes = _implementation(x)
    packed = pack_e2m1(codes, axis=1)
    fp4 = as_float4_e2m1fn_x2(packed)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and torch.equal(fp4.view(torch.uint8), packed)
    assert torch.equal(unpack_e2m1(fp4, axis=1), codes)
    mxfp = pytest.importorskip("triton.tools.mxfp")
    triton_fp4 = mxfp.MXFP4Tensor(data=x)
    assert torch.equal(triton_fp4.data, codes)
    assert torch.equal(triton_fp4.to_packed_tensor(dim=1), packed)
