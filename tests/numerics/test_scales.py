"""The bitcast-free scale form (`scale_fp32_from_amax`) against the bitcast reference
(`scale_fp32_from_bytes(scale_bytes_from_amax(...))`), bit for bit, for every format and rule."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxcompile.numerics import (
    ELEM_FORMATS,
    ScaleMode,
    scale_bytes_from_amax,
    scale_fp32_from_amax,
    scale_fp32_from_bytes,
)

MANTISSA_BITS = 23


def _edge_mantissas() -> list[int]:
    """Mantissas where a rule's decision flips: 0, 1, the half point, and all-ones runs from the
    top (the carries of the `even` rule at every mantissa width), each +-1."""
    full = 1 << MANTISSA_BITS
    points = {0, 1, 2, full >> 1, full - 1}
    for k in range(MANTISSA_BITS + 1):
        points.update({full - (1 << k), full - (1 << k) - 1, full - (1 << k) + 1})
    return sorted(m for m in points if 0 <= m < full)


def _amax_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _assert_same(amax: torch.Tensor) -> None:
    for fmt in ELEM_FORMATS.values():
        for scale_mode in ScaleMode:
            want = scale_fp32_from_bytes(scale_bytes_from_amax(amax, fmt, scale_mode))
            got = scale_fp32_from_amax(amax, fmt, scale_mode)
            same = (want.view(torch.int32) == got.view(torch.int32)) | (want.isnan() & got.isnan())
            bad = amax[~same]
            assert bad.numel() == 0, (fmt.name, scale_mode, bad[:4].tolist())


def test_every_exponent_with_edge_mantissas_and_specials():
    exponents = torch.arange(256, dtype=torch.int64)  # 0: zero / subnormals, 255: Inf / NaN
    mantissas = torch.tensor(_edge_mantissas(), dtype=torch.int64)
    bits = ((exponents[:, None] << MANTISSA_BITS) | mantissas[None, :]).reshape(-1)
    _assert_same(_amax_from_bits(bits))


def test_random_bit_patterns():
    g = torch.Generator().manual_seed(0)
    _assert_same(_amax_from_bits(torch.randint(0, 2**31, (1 << 18,), generator=g, dtype=torch.int64)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=64))
def test_hypothesis_values(values):
    _assert_same(torch.tensor(values, dtype=torch.float32).abs())


def test_compiled_form_matches_the_reference():
    """Inductor's vectorized code gives the reference's bits (no reassociation of the Veltkamp
    split), for every format and rule; one compile for all of them."""
    exponents = torch.arange(256, dtype=torch.int64)
    mantissas = torch.tensor(_edge_mantissas(), dtype=torch.int64)
    amax = _amax_from_bits(((exponents[:, None] << MANTISSA_BITS) | mantissas[None, :]).reshape(-1))
    cases = [(fmt, scale_mode) for fmt in ELEM_FORMATS.values() for scale_mode in ScaleMode]

    def every_case(a: torch.Tensor) -> list[torch.Tensor]:
        return [scale_fp32_from_amax(a, fmt, scale_mode) for fmt, scale_mode in cases]

    for (fmt, scale_mode), got in zip(cases, torch.compile(every_case, dynamic=False)(amax)):
        want = scale_fp32_from_bytes(scale_bytes_from_amax(amax, fmt, scale_mode))
        same = (want.view(torch.int32) == got.view(torch.int32)) | (want.isnan() & got.isnan())
        assert same.all(), (fmt.name, scale_mode, amax[~same][:4].tolist())
