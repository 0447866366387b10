"""The random Hadamard transform: Sylvester's matrix, R R^T = I exactly, the transform bit for
bit against the exact definition (on inputs where it is exact) and against the fp32 model of its
op order (on any input), exact inversion, products unchanged within a stated fp32 bound, seeded
signs; skipping the signs, or giving the two operands different signs, fails."""

from __future__ import annotations

import math

import pytest
import torch

import fp4_reference as ref
from mxcompile.numerics import (
    HADAMARD_SIZE,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    random_hadamard_matrix,
    random_hadamard_transform,
    random_signs,
)

U32 = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53
BUTTERFLY_DEPTH = 4  # log2(16) additions between an input and an output
# The largest |k| of inputs k * 2**q on which the transform and its inverse are exact.
EXACT_INTEGER_BOUND = 2**20


def _grid_data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Integers below 2**20 in magnitude times one power of two per tensor."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-EXACT_INTEGER_BOUND + 1, EXACT_INTEGER_BOUND, shape, generator=g)
    return k.float() * 2.0**-13


def test_hadamard_matrix_is_sylvesters() -> None:
    h = hadamard_matrix()
    assert h.tolist() == [[ref.hadamard_entry(i, j) for j in range(16)] for i in range(16)]
    assert torch.equal(h @ h, HADAMARD_SIZE * torch.eye(HADAMARD_SIZE))
    with pytest.raises(ValueError, match="size=12 must be a positive power of two"):
        hadamard_matrix(12)


def test_random_hadamard_matrix_is_exactly_orthogonal() -> None:
    signs = random_signs(seed=0)
    r = random_hadamard_matrix(signs)
    want = [[signs[i].item() * ref.hadamard_entry(i, j) / 4 for j in range(16)] for i in range(16)]
    assert r.tolist() == want
    assert torch.equal(r @ r.T, torch.eye(HADAMARD_SIZE)) and torch.equal(r.T @ r, torch.eye(HADAMARD_SIZE))


def test_signs_are_seeded() -> None:
    a, b = random_signs(seed=3), random_signs(seed=3)
    assert torch.equal(a, b) and set(a.tolist()) <= {1.0, -1.0} and a.shape == (HADAMARD_SIZE,)
    assert torch.equal(a, random_signs(generator=torch.Generator().manual_seed(3)))
    assert any(not torch.equal(a, random_signs(seed=s)) for s in range(4, 8))
    with pytest.raises(ValueError, match="exactly one of generator= and seed="):
        random_signs()


def _check_against_definition(transform, x: torch.Tensor, axis: int, signs: torch.Tensor) -> None:
    """transform(x, axis, signs) equals sum_i R[i][j] b_i (exact rationals) for every block of
    grid data, where fp32 is exact; raises AssertionError otherwise."""
    got = transform(x, axis, signs).movedim(axis, -1)
    blocks = x.movedim(axis, -1).reshape(-1, HADAMARD_SIZE).tolist()
    got_blocks = got.reshape(-1, HADAMARD_SIZE).tolist()
    s = signs.tolist()
    for block, have in zip(blocks, got_blocks):
        assert [float(v) for v in ref.rht_exact(block, s)] == have, (block, have)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_transform_matches_exact_definition(axis: int) -> None:
    shape = [4, 4, 4]
    shape[axis] = 2 * HADAMARD_SIZE
    x = _grid_data(tuple(shape), seed=1)
    _check_against_definition(random_hadamard_transform, x, axis, random_signs(seed=1))


def test_transform_without_signs_fails_the_definition() -> None:
    """The broken variant: the Hadamard matrix alone (the sign vector skipped)."""

    def without_signs(x: torch.Tensor, axis: int, signs: torch.Tensor) -> torch.Tensor:
        return random_hadamard_transform(x, axis, torch.ones_like(signs))

    signs = random_signs(seed=1)
    assert (signs < 0).any()
    with pytest.raises(AssertionError):
        _check_against_definition(without_signs, _grid_data((4, 32), seed=2), 1, signs)


def test_transform_matches_fp32_op_order_on_any_input() -> None:
    """On general fp32 values (many octaves, subnormals, signed zeros) the bits are those of the
    documented order: signs, butterflies with strides 1, 2, 4, 8, then * 1/4."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 64, generator=g) * 2.0 ** torch.randint(-30, 30, (24, 64), generator=g)
    x[0, :16] = torch.tensor([2.0**-149] * 8 + [-0.0] * 8)
    x[1, :16] = 3.0e38 * torch.linspace(-0.05, 0.05, 16)
    signs = random_signs(seed=5)
    got = random_hadamard_transform(x, 1, signs).reshape(-1, HADAMARD_SIZE)
    want = torch.tensor([ref.rht_fp32(b, signs.tolist()) for b in x.reshape(-1, HADAMARD_SIZE).tolist()])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("axis", [0, 1])
def test_exactly_invertible_where_exact(axis: int) -> None:
    """The sense of "exactly invertible" hadamard.py defines: for blocks of integers below 2**20
    times one power of two, the fp32 transform and its inverse are exact, so the round trip is
    the identity bit for bit; on any input it is within the butterflies' rounding."""
    signs = random_signs(seed=6)
    x = _grid_data((64, 48), seed=7)
    y = random_hadamard_transform(x, axis, signs)
    assert torch.equal(inverse_random_hadamard_transform(y, axis, signs), x)
    # The inverse is not the transform itself (R is not symmetric): applying the forward twice
    # does not give x back.
    assert not torch.equal(random_hadamard_transform(y, axis, signs), x)
    g = torch.Generator().manual_seed(8)
    z = torch.randn(64, 48, generator=g)
    back = inverse_random_hadamard_transform(random_hadamard_transform(z, axis, signs), axis, signs)
    # Each output is 4 roundings from exact (|error| <= gamma_4 * sum |inputs| / 4, twice).
    block_sum = z.abs().double().unflatten(axis, (-1, HADAMARD_SIZE)).sum(axis + 1, keepdim=True)
    gamma4 = BUTTERFLY_DEPTH * U32 / (1 - BUTTERFLY_DEPTH * U32)
    per_element = block_sum.expand(z.unflatten(axis, (-1, HADAMARD_SIZE)).shape).flatten(axis, axis + 1)
    bound = (2 * gamma4 + gamma4**2) * per_element
    assert ((back.double() - z.double()).abs() <= bound).all()


def _product_error_and_bound(
    a: torch.Tensor, b: torch.Tensor, signs_a: torch.Tensor, signs_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """|A'B' - AB| (in float64) and its bound. Each transformed fp32 element is within
    gamma_4 * (sum of its block's |inputs|) / 4 of exact (4 roundings deep), so with
    J = blockdiag(ones(16, 16)) and |R| = 1/4 everywhere:
    |A'B' - AB| <= (2 gamma_4 + gamma_4**2) |A| J |B|, plus the float64 GEMMs' own errors
    (K * 2**-53 times |A'| |B'| and |A| |B|)."""
    a2 = random_hadamard_transform(a, 1, signs_a).double()
    b2 = random_hadamard_transform(b, 0, signs_b).double()
    a64, b64 = a.double(), b.double()
    error = (a2 @ b2 - a64 @ b64).abs()
    k = a.shape[1]
    block_a = a64.abs().unflatten(1, (-1, HADAMARD_SIZE)).sum(2)  # (M, K / 16)
    block_b = b64.abs().unflatten(0, (-1, HADAMARD_SIZE)).sum(1)  # (K / 16, N)
    gamma4 = BUTTERFLY_DEPTH * U32 / (1 - BUTTERFLY_DEPTH * U32)
    bound = (2 * gamma4 + gamma4**2) * (block_a @ block_b)
    bound = bound + 2 * k * U64 * (a2.abs() @ b2.abs() + a64.abs() @ b64.abs())
    return error, bound


def test_product_unchanged_within_fp32_rounding() -> None:
    g = torch.Generator().manual_seed(9)
    a = torch.randn(32, 128, generator=g) * 2.0 ** torch.randint(-8, 8, (1, 128), generator=g)
    b = torch.randn(128, 24, generator=g) * 2.0 ** torch.randint(-8, 8, (128, 1), generator=g)
    signs = random_signs(seed=10)
    error, bound = _product_error_and_bound(a, b, signs, signs)
    assert (error <= bound).all()
    # On grid data every step is exact: the product is unchanged bit for bit (float64 GEMMs of
    # integers below 2**53).
    a, b = _grid_data((8, 64), seed=11), _grid_data((64, 8), seed=12)
    a2, b2 = random_hadamard_transform(a, 1, signs), random_hadamard_transform(b, 0, signs)
    assert torch.equal(a2.double() @ b2.double(), a.double() @ b.double())


def test_different_signs_on_the_two_operands_change_the_product() -> None:
    """The broken variant: each operand transformed with its own signs does not cancel."""
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(32, 128, generator=g), torch.randn(128, 24, generator=g)
    error, bound = _product_error_and_bound(a, b, random_signs(seed=10), random_signs(seed=11))
    assert not (error <= bound).all()


def test_errors() -> None:
    signs = random_signs(seed=0)
    with pytest.raises(ValueError, match=r"x.shape\[1\]=24 .*not divisible by 16"):
        random_hadamard_transform(torch.zeros(2, 24), 1, signs)
    with pytest.raises(ValueError, match=r"signs must be a tensor of shape \(16,\)"):
        random_hadamard_transform(torch.zeros(2, 32), 1, signs[:8])
    with pytest.raises(ValueError, match="signs must hold only"):
        random_hadamard_transform(torch.zeros(2, 32), 1, signs * 2)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        random_hadamard_transform(torch.zeros(2, 32), 2, signs)
    assert math.isclose(float(random_hadamard_matrix(signs).abs().max()), 0.25)
