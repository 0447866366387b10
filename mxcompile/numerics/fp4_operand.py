"""One operand of an FP4 GEMM as the FP4 training recipes quantize it (issue 48): the optional
random Hadamard transform, the stochastic-rounding draws, 16x16 weight blocks, and the split
at the tensor scale that a block-scaled GEMM takes. The ops (`ops/quantize.py`,
`ops/mx_mm.py`) and nothing else call it; the test oracle (`tests/fp4_oracle.py`) rewrites it
from this docstring.

An operand x is quantized along its GEMM's contraction axis `axis` (a multiple of the block,
the passes zero-pad it), in this order:

1. RHT (when `rht_seed` is not None): x <- `random_hadamard_transform(x, axis,
   random_signs(seed=rht_seed))`. Both operands of a GEMM take the same signs, so the
   transform cancels in the product.
2. Draws (stochastic rounding): u = `operand_uniform(x, axis, seed)`, from x *before* step 1.
   Their seed is a hash of x's values (`operand_draw_seed`), not a generator's state, so that
   the draws depend on the operand alone: the same in a compiled graph and in eager autograd
   whatever order their backward GEMMs run in, the same when the memory planner recomputes a
   quantization, and new at every step (gradients change). x is read in its canonical layout,
   the quantization axis moved last, so a transposed view quantized along the same axis (the
   weight-gradient GEMM's dYt or dY) gets the same draws.
3. 2-D blocks (NVFP4 weights): a side that is not a multiple of 16 is zero-padded to one
   (zeros change no tile's amax, nor the tensor's) and cut off again after quantization.
4. Quantization to the block format row: block values v = q * s (exact in fp32: q in E2M1,
   s an E8M0 power of two or an E4M3 value) and the tensor decode scale S_dec (NVFP4; 1.0 for
   MXFP4). The GEMM multiplies block values with fp32 accumulation and then multiplies its
   fp32 output by fp32(S_dec(a) * S_dec(b)) (`fp4_gemm`), as Blackwell's block-scaled MMA
   applies the tensor scales to the accumulator (`alpha`).
"""

from __future__ import annotations

import torch

from .e2m1 import Rounding, uniform_noise
from .formats import BITS_PER_BYTE, E2M1, NVFP4_BLOCK_SIZE, BlockFormat, ScaleFormat, ScaleMode
from .fp4 import (
    FP4Tensor,
    dequantize_fp4,
    fake_quantize_mxfp4_along,
    nvfp4_block_values,
    quantize_mxfp4,
    quantize_nvfp4,
)
from .hadamard import random_hadamard_transform, random_signs
from .quantize import check_quantizable
from .scales import bytes_from_e8m0, e8m0_from_bytes

# The draw seed: fold the operand's fp32 bit patterns, each times an odd weight 2i + 1 (its
# index i in canonical layout), in int64 arithmetic modulo 2**64 (associative: any summation
# order gives the same), then the shape and the recipe's seed, into [0, 2**63).
DRAW_SEED_BITS = 63
DRAW_SEED_MASK = (1 << DRAW_SEED_BITS) - 1
SHAPE_FOLD_MULTIPLIER = 1_000_003  # a prime; folds each size into the hash
SEED_FOLD_MULTIPLIER = 0x9E3779B97F4A7C15 & DRAW_SEED_MASK  # 2**64 / golden ratio, odd


def canonical(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with its quantization axis moved last, contiguous, in fp32."""
    return x.to(torch.float32).movedim(axis, -1).contiguous()


def operand_draw_seed(x: torch.Tensor, axis: int, seed: int) -> int:
    """The seed of an operand's stochastic-rounding draws (module docstring, step 2)."""
    bits = canonical(x, axis).view(torch.int32).flatten().to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) * 2 + 1
    folded = int((bits * weights).sum()) & DRAW_SEED_MASK
    for size in (*x.movedim(axis, -1).shape, seed):
        folded = (folded * SHAPE_FOLD_MULTIPLIER + size) & DRAW_SEED_MASK
    return (folded ^ (seed * SEED_FOLD_MULTIPLIER)) & DRAW_SEED_MASK


def operand_uniform(x: torch.Tensor, axis: int, seed: int) -> torch.Tensor:
    """Draws in [0, 1) of x's shape: `uniform_noise` of the canonical shape seeded with
    `operand_draw_seed`, moved back to x's axes."""
    canonical_shape = x.movedim(axis, -1).shape
    draws = uniform_noise(canonical_shape, seed=operand_draw_seed(x, axis, seed), device=x.device)
    return draws.movedim(-1, axis)


def _pad_to_tiles(x: torch.Tensor) -> torch.Tensor:
    """2-D x zero-padded on each side to a multiple of the NVFP4 tile (16)."""
    rows, cols = x.shape
    return torch.nn.functional.pad(x, (0, -cols % NVFP4_BLOCK_SIZE, 0, -rows % NVFP4_BLOCK_SIZE))


def _prepared(x: torch.Tensor, axis: int, fmt: BlockFormat, block_2d: bool, stochastic: bool, seed: int,
              rht_seed: int | None) -> tuple[torch.Tensor, torch.Tensor | None, Rounding]:
    """Steps 1 and 2: (x in fp32, transformed; the draws or None; the rounding)."""
    if fmt.elem.bits >= BITS_PER_BYTE:
        raise ValueError(f"fmt={fmt.name!r} is not an FP4 block format")
    if block_2d and (fmt.scale_format is not ScaleFormat.E4M3 or x.ndim != 2):
        raise ValueError(f"block_2d=True needs NVFP4 and a 2-D operand; got {fmt.name}, {x.ndim}-D")
    check_quantizable(x, axis, fmt.block_size)
    x32 = x.to(torch.float32)
    uniform = operand_uniform(x32, axis, seed) if stochastic else None
    if rht_seed is not None:
        x32 = random_hadamard_transform(x32, axis, random_signs(seed=rht_seed))
    return x32, uniform, Rounding.STOCHASTIC if stochastic else Rounding.NEAREST


def fp4_operand(
    x: torch.Tensor,
    axis: int,
    fmt: BlockFormat,
    *,
    scale_mode: ScaleMode = ScaleMode.RCEIL,
    block_2d: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    rht_seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values q * s in fp32 of x's shape, S_dec 0-d fp32) of x quantized along a
    non-negative `axis` to the FP4 row `fmt` by the module docstring's steps."""
    x32, uniform, rounding = _prepared(x, axis, fmt, block_2d, stochastic, seed, rht_seed)
    if fmt.scale_format is ScaleFormat.E8M0:
        values = fake_quantize_mxfp4_along(x32, axis, scale_mode, fmt.block_size, rounding=rounding,
                                           uniform=uniform)
        return values, torch.ones((), dtype=torch.float32, device=x.device)
    if not block_2d:
        return nvfp4_block_values(x32, axis, rounding=rounding, uniform=uniform)
    rows, cols = x32.shape
    padded_uniform = None if uniform is None else _pad_to_tiles(uniform)
    values, tensor_decode = nvfp4_block_values(_pad_to_tiles(x32), axis, block_2d=True, rounding=rounding,
                                               uniform=padded_uniform)
    return values[:rows, :cols], tensor_decode


def quantize_fp4_operand(
    x: torch.Tensor,
    axis: int,
    fmt: BlockFormat,
    *,
    scale_mode: ScaleMode = ScaleMode.RCEIL,
    block_2d: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    rht_seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp4_operand` as stored: (uint8 data, two E2M1 codes per byte packed along `axis`;
    uint8 scale bytes, E8M0 or E4M3 bits, one per block; S_dec, 0-d fp32, 1.0 for MXFP4).
    `fp4_block_values_from_bytes` reads the block values back bit for bit."""
    x32, uniform, rounding = _prepared(x, axis, fmt, block_2d, stochastic, seed, rht_seed)
    if fmt.scale_format is ScaleFormat.E8M0:
        t = quantize_mxfp4(x32, axis, scale_mode=scale_mode, block_size=fmt.block_size, rounding=rounding,
                           uniform=uniform)
        return t.data, bytes_from_e8m0(t.scale), torch.ones((), dtype=torch.float32, device=x.device)
    if not block_2d:
        t = quantize_nvfp4(x32, axis, rounding=rounding, uniform=uniform)
        return t.data, t.scale.view(torch.uint8), t.tensor_scale
    rows, cols = x32.shape
    padded_uniform = None if uniform is None else _pad_to_tiles(uniform)
    t = quantize_nvfp4(_pad_to_tiles(x32), axis, block_2d=True, rounding=rounding, uniform=padded_uniform)
    packed = [rows, cols]
    packed[axis] //= E2M1.elements_per_byte
    blocks = [rows, cols]
    blocks[axis] //= fmt.block_size
    return (t.data[:packed[0], :packed[1]].contiguous(), t.scale.view(torch.uint8)[:blocks[0], :blocks[1]].contiguous(),
            t.tensor_scale)


def fp4_block_values_from_bytes(data: torch.Tensor, scale: torch.Tensor, axis: int, fmt: BlockFormat,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The block values q * s of `quantize_fp4_operand`'s data and scale bytes (exact), as dtype."""
    if fmt.scale_format is ScaleFormat.E8M0:
        scales, scale_mode = e8m0_from_bytes(scale), ScaleMode.RCEIL
    else:
        scales, scale_mode = scale.view(torch.float8_e4m3fn), None
    unit = torch.ones((), dtype=torch.float32, device=data.device)  # S_dec left to the GEMM
    stored = FP4Tensor(data=data, scale=scales, tensor_scale=unit, axis=axis, format=fmt, scale_mode=scale_mode,
                       block_2d=False, orig_dtype=torch.float32)
    return dequantize_fp4(stored, dtype)


def fp4_gemm(a_values: torch.Tensor, a_decode: torch.Tensor, b_values: torch.Tensor, b_decode: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The FP4 GEMM of block values a (..., M, K) and b (..., K, N): their fp32 product times
    fp32(S_dec(a) * S_dec(b)), cast to out_dtype."""
    product = torch.matmul(a_values.to(torch.float32), b_values.to(torch.float32))
    return (product * (a_decode.to(torch.float32) * b_decode.to(torch.float32))).to(out_dtype)


__all__ = [
    "canonical",
    "fp4_block_values_from_bytes",
    "fp4_gemm",
    "fp4_operand",
    "operand_draw_seed",
    "operand_uniform",
    "quantize_fp4_operand",
]
