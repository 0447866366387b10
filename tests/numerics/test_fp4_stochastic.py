"""Stochastic rounding to E2M1: bit for bit against `fp4_reference` for given draws, reproducible
from a seed or a generator, and unbiased (the mean over many draws is the exact value within a
Hoeffding bound); round-to-nearest and round-down in its place fail the unbiasedness check."""

from __future__ import annotations

import math

import pytest
import torch

import fp4_reference as ref
from mxcompile.numerics import (
    E2M1,
    Rounding,
    ScaleMode,
    fake_quantize_mxfp4_along,
    fake_quantize_nvfp4_along,
    quantize_mxfp4,
    quantize_nvfp4,
    round_e2m1,
    uniform_noise,
)
from mxcompile.numerics.e2m1 import e2m1_gap, round_e2m1_stochastic

UNIFORM_RESOLUTION = 2.0**-24  # torch.rand's fp32 draws on the CPU are k * 2**-24
# Probability that a correct implementation fails the unbiasedness test for an arbitrary seed
# (Hoeffding's inequality, union bound over the values tested).
FALSE_ALARM = 1e-9
DRAWS = 1 << 14


def test_cpu_draws_are_multiples_of_two_to_the_minus_24() -> None:
    """What the unbiasedness statement relies on (uniform_noise's docstring)."""
    u = uniform_noise((1 << 16,), seed=0).double()
    assert ((u * 2**24) == torch.floor(u * 2**24)).all() and (u >= 0).all() and (u < 1).all()


def _values() -> list[float]:
    """Grid points, points between them at several fractions, subnormal-range values, beyond
    +-6, both signs, zeros and NaN."""
    mags = ref.E2M1_MAGNITUDES
    points = set(mags) | {7.0, 100.0, 2.0**-30, 0.1, 0.3}
    for a, b in zip(mags, mags[1:]):
        points.update(a + (b - a) * f for f in (0.125, 0.3, 0.5, 0.7, 0.999))
    points = {ref.round_fp32(p) for p in points}
    return sorted(points | {-p for p in points}) + [-0.0, math.nan]


def test_matches_reference_for_given_draws() -> None:
    """For each value, draws at 0, just below / at / just above its fraction, and 1 - 2**-24."""
    values, draws = [], []
    for v in _values():
        m = min(abs(v), E2M1.max_normal) if not math.isnan(v) else 0.0
        gap = e2m1_gap(torch.tensor([m])).item()
        frac = (m - math.floor(m / gap) * gap) / gap
        for u in (0.0, frac - UNIFORM_RESOLUTION, frac, frac + UNIFORM_RESOLUTION, 1 - UNIFORM_RESOLUTION):
            if 0.0 <= u < 1.0:
                values.append(v)
                draws.append(ref.round_fp32(u))
    got = round_e2m1_stochastic(torch.tensor(values), torch.tensor(draws))
    want = torch.tensor([ref.e2m1_stochastic(v, u) for v, u in zip(values, draws)])
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    bad = list(zip(torch.tensor(values)[~same].tolist(), torch.tensor(draws)[~same].tolist()))
    assert same.all(), bad[:5]


def _octave_data(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-6, 6, (1, cols), generator=g)


def test_mxfp4_and_nvfp4_stochastic_match_reference() -> None:
    x = _octave_data(8, 64, seed=21)
    u = uniform_noise(x.shape, seed=7)
    for scale_mode in ("rceil", "floor"):
        t = quantize_mxfp4(x, scale_mode=scale_mode, rounding="stochastic", uniform=u)
        want_scales, want_codes = [], []
        for row, urow in zip(x.tolist(), u.tolist()):
            blocks = [
                ref.mxfp4_block(row[s : s + 32], scale_mode, urow[s : s + 32]) for s in range(0, 64, 32)
            ]
            want_scales.append([b for b, _ in blocks])
            want_codes.append([c for _, codes in blocks for c in codes])
        assert t.scale.view(torch.uint8).tolist() == want_scales and t.codes.tolist() == want_codes
        fake = fake_quantize_mxfp4_along(x, 1, ScaleMode(scale_mode), rounding=Rounding.STOCHASTIC, uniform=u)
        assert torch.equal(fake, t.dequantize())
    n = quantize_nvfp4(x, rounding="stochastic", uniform=u)
    want_scales, want_codes, _ = ref.nvfp4_rows(x.tolist(), uniforms=u.tolist())
    assert n.scale.float().tolist() == want_scales and n.codes.tolist() == want_codes
    fake = fake_quantize_nvfp4_along(x, 1, rounding=Rounding.STOCHASTIC, uniform=u)
    assert torch.equal(fake, n.dequantize())
    # Along axis 0 the draws are read in x's own layout too.
    n0 = quantize_nvfp4(x.t().contiguous(), 0, rounding="stochastic", uniform=u.t().contiguous())
    assert torch.equal(n0.codes.t(), n.codes)


def test_reproducible_from_seed_or_generator() -> None:
    x = _octave_data(4, 64, seed=22)
    a = quantize_nvfp4(x, rounding="stochastic", uniform=uniform_noise(x.shape, seed=5))
    generator = torch.Generator().manual_seed(5)
    b = quantize_nvfp4(x, rounding="stochastic", uniform=uniform_noise(x.shape, generator=generator))
    c = quantize_nvfp4(x, rounding="stochastic", uniform=uniform_noise(x.shape, seed=6))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    with pytest.raises(ValueError, match="exactly one of generator= and seed="):
        uniform_noise(x.shape)
    with pytest.raises(ValueError, match="seed=1.5 must be an int"):
        uniform_noise(x.shape, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uniform has shape"):
        quantize_nvfp4(x, rounding="stochastic", uniform=torch.rand(3))
    with pytest.raises(ValueError, match="rounding='nearest' uses no noise"):
        round_e2m1(x, Rounding.NEAREST, torch.rand(x.shape))


def _assert_unbiased(rounder) -> None:
    """Mean of DRAWS roundings of each value against the value. Each rounding is lo or lo + gap,
    so by Hoeffding P(|mean - E| >= t) <= 2 exp(-2 N t**2 / gap**2); with t chosen so that the
    union over all values is FALSE_ALARM, plus the draws' resolution bias (gap * 2**-24)."""
    values = torch.tensor([v for v in _values() if math.isfinite(v) and abs(v) <= E2M1.max_normal])
    g = torch.Generator().manual_seed(1234)
    draws = torch.rand(DRAWS, values.numel(), generator=g)
    rounded = rounder(values.expand(DRAWS, -1).contiguous(), draws)
    mean = rounded.double().mean(dim=0)
    gap = e2m1_gap(values.abs()).double()
    t = gap * math.sqrt(math.log(2 * values.numel() / FALSE_ALARM) / (2 * DRAWS)) + gap * UNIFORM_RESOLUTION
    error = (mean - values.double()).abs()
    assert (error <= t).all(), list(zip(values[error > t].tolist(), error[error > t].tolist()))[:5]


def test_stochastic_rounding_is_unbiased() -> None:
    _assert_unbiased(round_e2m1_stochastic)


@pytest.mark.parametrize("broken", ["nearest", "round down"])
def test_unbiasedness_check_fails_on_broken_variants(broken: str) -> None:
    def nearest(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return round_e2m1(v)

    def round_down(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return round_e2m1_stochastic(v, torch.ones_like(u) - UNIFORM_RESOLUTION)

    with pytest.raises(AssertionError):
        _assert_unbiased(nearest if broken == "nearest" else round_down)


def test_mxfp4_fake_quantize_is_unbiased() -> None:
    """E[fake_quantize(x)] = x for MXFP4 with stochastic rounding (power-of-two scales: the
    scaled value's expectation maps back exactly), in rceil mode (nothing saturates)."""
    x = _octave_data(1, 64, seed=23)
    draws = 4096
    xs = x.expand(draws, -1).contiguous()
    fq = fake_quantize_mxfp4_along(
        xs, 1, ScaleMode.RCEIL, rounding=Rounding.STOCHASTIC, uniform=uniform_noise(xs.shape, seed=9)
    )
    scale = quantize_mxfp4(x).scale.float().repeat_interleave(32, dim=1)[0].double()
    gap = e2m1_gap((x[0] / scale.float()).abs()).double() * scale
    t = gap * math.sqrt(math.log(2 * x.numel() / FALSE_ALARM) / (2 * draws)) + gap * UNIFORM_RESOLUTION
    assert ((fq.double().mean(dim=0) - x[0].double()).abs() <= t).all()
