"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 recipe, in blocks of 16 along an axis.

R = diag(s) H / 4, with H the 16x16 Sylvester Hadamard matrix (H_1 = [1],
H_2n = [[H_n, H_n], [H_n, -H_n]]; symmetric, H H = 16 I) and s a seeded random vector of +-1.
R's entries are +-1/4, and R R^T = diag(s) H H diag(s) / 16 = I exactly: R is orthogonal.

`random_hadamard_transform(x, axis, signs)` replaces each block b of 16 consecutive elements
along `axis` by R^T b = H (s * b) / 4, i.e. y_j = sum_i R[i, j] b_i. Applied along the
contracted axis of both operands of a product, it cancels: for A (M, K) along axis 1 and
B (K, N) along axis 0, A' = A R_K and B' = R_K^T B (R_K: block-diagonal copies of R), so
A' B' = A R_K R_K^T B = A B. The inverse is b = R y = s * (H y) / 4
(`inverse_random_hadamard_transform`).

The order of fp32 operations is fixed, so that every implementation (eager, compiled, kernel)
can give the same bits: multiply by the signs (exact), then H v by the fast Walsh-Hadamard
butterflies (a, b) -> (a + b, a - b) over pairs i, i + h for h = 1, 2, 4, 8 in that order,
then multiply by 1/4 (exact unless the result is an fp32 subnormal). No matmul: a BLAS dot
product's summation order (and FMA use) depends on the CPU. Each output is at most 4 roundings
(the butterfly depth) from exact, and none when the block's values are integer multiples of one
power of two 2**q (q >= -147) below 2**(q + 20) in magnitude: every partial sum of the forward
butterflies is then a multiple of 2**q below 2**(q + 24), and every partial sum of the inverse's
(after t stages it is 2**t (H_(16/2**t) kron I) (s * b) / 4, at most 4 max|b|) a multiple of
2**(q - 2) below 2**(q + 22). There the transform and its inverse are exact and invert each
other bit for bit (tests/numerics/test_fp4_hadamard.py).
"""

from __future__ import annotations

import torch

from .quantize import normalize_axis, split_blocks

HADAMARD_SIZE = 16  # NVIDIA's NVFP4 recipe: 16x16, one NVFP4 block
# 1 / sqrt(16): normalises H to an orthogonal matrix; a power of two, so the multiply is exact.
HADAMARD_NORMALIZATION = 0.25
# The butterfly strides, in the order applied: 1, 2, 4, 8.
BUTTERFLY_STRIDES = tuple(1 << k for k in range(HADAMARD_SIZE.bit_length() - 1))


def hadamard_matrix(size: int = HADAMARD_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Sylvester Hadamard matrix of a power-of-two `size`, entries +-1."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size & (size - 1):
        raise ValueError(f"size={size!r} must be a positive power of two")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def random_signs(
    *, generator: torch.Generator | None = None, seed: int | None = None, size: int = HADAMARD_SIZE
) -> torch.Tensor:
    """`size` fp32 signs +-1, each -1 with probability 1/2, from `generator` or a fresh generator
    seeded with `seed` (exactly one): the same seed gives the same signs on every machine."""
    if (generator is None) == (seed is None):
        raise ValueError("give exactly one of generator= and seed= for the random signs")
    if generator is None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an int")
        generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (size,), generator=generator, device=generator.device)
    return (1 - 2 * bits).to(torch.float32).cpu()


def random_hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """R = diag(signs) H / 4 (fp32, exact), the matrix the transform multiplies blocks by."""
    _check_signs(signs)
    return signs.to(torch.float32)[:, None] * hadamard_matrix(HADAMARD_SIZE) * HADAMARD_NORMALIZATION


def _check_signs(signs: torch.Tensor) -> None:
    if not isinstance(signs, torch.Tensor) or signs.shape != (HADAMARD_SIZE,):
        shape = tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__
        raise ValueError(f"signs must be a tensor of shape ({HADAMARD_SIZE},), got {shape}")
    # A value check reads the tensor: skipped while compiling, where it would break the graph.
    if not torch.compiler.is_compiling() and not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError("signs must hold only +1 and -1")


def _walsh_hadamard(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """H v for every length-16 vector v along `dim`, by butterflies with strides 1, 2, 4, 8."""
    v = blocks
    for stride in BUTTERFLY_STRIDES:
        # Split dim into (groups, 2, stride): pairs (i, i + stride) inside groups of 2 * stride.
        shape = v.shape
        pairs = v.reshape(*shape[:dim], HADAMARD_SIZE // (2 * stride), 2, stride, *shape[dim + 1 :])
        a, b = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
        v = torch.stack((a + b, a - b), dim=dim + 1).reshape(shape)
    return v


def _prepare(x: torch.Tensor, axis: int, signs: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    axis = normalize_axis(axis, x.ndim)
    if x.shape[axis] % HADAMARD_SIZE:
        raise ValueError(
            f"x.shape[{axis}]={x.shape[axis]} (the transform's axis) is not divisible by "
            f"{HADAMARD_SIZE}; pad that axis to a multiple of {HADAMARD_SIZE}"
        )
    _check_signs(signs)
    blocks = split_blocks(x.to(torch.float32), axis, HADAMARD_SIZE)
    # The signs along the block's inner dimension (axis + 1), broadcast over the others.
    broadcast = [1] * blocks.ndim
    broadcast[axis + 1] = HADAMARD_SIZE
    return blocks, axis, signs.to(device=x.device, dtype=torch.float32).reshape(broadcast)


def random_hadamard_transform(x: torch.Tensor, axis: int, signs: torch.Tensor) -> torch.Tensor:
    """Each block b of 16 along `axis` replaced by R^T b = H (signs * b) / 4, in fp32 (the
    module's op order). Apply it with the same signs along the contracted axis of both operands
    of a product to leave the product unchanged."""
    blocks, axis, s = _prepare(x, axis, signs)
    return (_walsh_hadamard(blocks * s, axis + 1) * HADAMARD_NORMALIZATION).reshape(x.shape)


def inverse_random_hadamard_transform(y: torch.Tensor, axis: int, signs: torch.Tensor) -> torch.Tensor:
    """The inverse: each block b of 16 along `axis` replaced by R b = signs * (H b) / 4, in fp32."""
    blocks, axis, s = _prepare(y, axis, signs)
    return (s * (_walsh_hadamard(blocks, axis + 1) * HADAMARD_NORMALIZATION)).reshape(y.shape)


__all__ = [
    "BUTTERFLY_STRIDES",
    "HADAMARD_SIZE",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "random_hadamard_matrix",
    "random_hadamard_transform",
    "random_signs",
]
