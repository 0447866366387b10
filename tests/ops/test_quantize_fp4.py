"""The FP4 ops (issue 48): `mxcompile::quantize_fp4`, `dequantize_fp4`, `fake_quantize_fp4`,
`mx_mm_fp4`, against the numerics core and each other, bit for bit; the stochastic draws
reproducible per seed, new for another seed, and the same for a transposed view of an operand."""

from __future__ import annotations

import pytest
import torch

from mxcompile.numerics import fake_quantize_nvfp4_along, random_hadamard_transform, random_signs
from mxcompile.numerics.fp4_operand import fp4_gemm, operand_uniform
from mxcompile.ops import DEQUANTIZE_FP4, FAKE_QUANTIZE_FP4, MX_MM_FP4, QUANTIZE_FP4

SEED, OTHER_SEED, RHT_SEED = 3, 4, 5
# (format, block_2d, stochastic, rht_seed): every operand form the recipes emit
FORMS = [("nvfp4", False, False, None), ("nvfp4", True, False, None), ("nvfp4", False, True, None),
         ("nvfp4", False, True, RHT_SEED), ("mxfp4", False, False, None), ("mxfp4", False, True, RHT_SEED)]


def _operand(shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("fmt, block_2d, stochastic, rht_seed", FORMS)
@pytest.mark.parametrize("axis", [0, 1])
def test_fake_quantize_is_dequantize_of_quantize(fmt, block_2d, stochastic, rht_seed, axis):
    x = _operand((64, 40) if axis == 0 else (40, 64))  # 40: a side of partial 16x16 tiles
    args = (x, axis, fmt, "rceil", block_2d, stochastic, SEED, rht_seed)
    data, scale, tensor_scale = QUANTIZE_FP4(*args)
    values, decode = FAKE_QUANTIZE_FP4(*args, torch.float32)
    assert torch.equal(DEQUANTIZE_FP4(data, scale, axis, fmt, torch.float32), values)
    assert torch.equal(decode, tensor_scale)
    torch.library.opcheck(torch.ops.mxcompile.quantize_fp4, args)
    torch.library.opcheck(torch.ops.mxcompile.fake_quantize_fp4, (*args, torch.float32))


def test_nvfp4_values_times_the_tensor_scale_are_the_numerics_core():
    x = _operand((32, 64))
    values, decode = FAKE_QUANTIZE_FP4(x, 1, "nvfp4", "rceil", False, False, SEED, None, torch.float32)
    assert torch.equal(values * decode, fake_quantize_nvfp4_along(x, 1))


def test_rht_is_the_transform_then_the_quantizer():
    x = _operand((32, 64))
    values, decode = FAKE_QUANTIZE_FP4(x, 0, "nvfp4", "rceil", False, False, SEED, RHT_SEED, torch.float32)
    transformed = random_hadamard_transform(x, 0, random_signs(seed=RHT_SEED))
    assert torch.equal(values * decode, fake_quantize_nvfp4_along(transformed, 0))


@pytest.mark.parametrize("shape", [(48, 32), (48, 40)])  # 40: partial tiles, zero-padded
def test_weight_2d_blocks_are_one_quantization_of_w_and_wt(shape):
    """W along either axis (the forward's Wt, the backward's W) gives the same values."""
    w = _operand(shape)
    axes = (0, 1) if shape[1] % 16 == 0 else (0,)
    values = [FAKE_QUANTIZE_FP4(w, axis, "nvfp4", "rceil", True, False, SEED, None, torch.float32)[0]
              for axis in axes]
    values += [FAKE_QUANTIZE_FP4(w.t(), 1 - axis, "nvfp4", "rceil", True, False, SEED, None, torch.float32)[0].t()
               for axis in axes]
    assert all(torch.equal(values[0], v) for v in values[1:])
    one_d, _ = FAKE_QUANTIZE_FP4(w, 0, "nvfp4", "rceil", False, False, SEED, None, torch.float32)
    assert not torch.equal(values[0], one_d)  # the 2-D switch changes the values


def test_stochastic_draws_are_seeded_per_operand():
    x = _operand((32, 48))
    assert torch.equal(operand_uniform(x, 0, SEED), operand_uniform(x.clone(), 0, SEED))  # reproducible
    assert not torch.equal(operand_uniform(x, 0, SEED), operand_uniform(x, 0, OTHER_SEED))
    assert not torch.equal(operand_uniform(x, 0, SEED), operand_uniform(x + 1, 0, SEED))  # new operand, new draws
    assert torch.equal(operand_uniform(x.t(), 1, SEED), operand_uniform(x, 0, SEED).t())  # layout-free
    args = (x, 0, "nvfp4", "rceil", False, True)
    first, again = (FAKE_QUANTIZE_FP4(*args, SEED, None, torch.float32)[0] for _ in range(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, FAKE_QUANTIZE_FP4(*args, OTHER_SEED, None, torch.float32)[0])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mx_mm_fp4_is_the_block_value_gemm_times_the_tensor_scales(fmt):
    a, b = _operand((24, 64)), _operand((64, 40)) / 7
    qa = QUANTIZE_FP4(a, 1, fmt, "rceil", False, True, SEED, RHT_SEED)
    qb = QUANTIZE_FP4(b, 0, fmt, "rceil", False, False, SEED, RHT_SEED)
    va, da = FAKE_QUANTIZE_FP4(a, 1, fmt, "rceil", False, True, SEED, RHT_SEED, torch.float32)
    vb, db = FAKE_QUANTIZE_FP4(b, 0, fmt, "rceil", False, False, SEED, RHT_SEED, torch.float32)
    out = MX_MM_FP4(*qa, *qb, fmt, torch.float32)
    assert torch.equal(out, fp4_gemm(va, da, vb, db, torch.float32))
    assert torch.equal(out, (va @ vb) * (da * db))
    torch.library.opcheck(torch.ops.mxcompile.mx_mm_fp4, (*qa, *qb, fmt, torch.float32))


def test_a_length_that_is_not_a_whole_block_raises():
    with pytest.raises(ValueError, match="not divisible by block_size=32"):
        QUANTIZE_FP4(_operand((4, 48)), 1, "mxfp4", "rceil", False, False, SEED, None)
