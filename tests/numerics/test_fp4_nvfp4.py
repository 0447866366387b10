"""NVFP4 (E2M1 in blocks of 16, E4M3 block scales, an fp32 tensor scale) bit for bit against
`fp4_reference`, which models each fp32 operation of docs/fp4.md's order (Transformer Engine's
reference quantizer) as exact arithmetic rounded once; 16x16 weight blocks (W and W.T give the
same values); special values; broken variants (torchao's order, 1-D blocks) fail."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4_reference as ref
from mxcompile.numerics import (
    E2M1,
    NVFP4,
    NVFP4_BLOCK_SIZE,
    FP4Tensor,
    encode_e2m1,
    fake_quantize_fp4_along,
    fake_quantize_nvfp4_along,
    quantize_nvfp4,
    round_e2m1,
)
from mxcompile.numerics.quantize import split_blocks

BLOCK = NVFP4_BLOCK_SIZE
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = torch.finfo(torch.float32).max


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (block scales, codes, S_dec)


def _implementation(x: torch.Tensor, axis: int, block_2d: bool) -> Quantized:
    t = quantize_nvfp4(x, axis, block_2d=block_2d)
    return t.scale.float(), t.codes, t.tensor_scale


def _check(x: torch.Tensor, axis: int = 1, block_2d: bool = False, quantize=_implementation) -> None:
    """Block scales, codes, S_dec, dequantized and fake-quantized values against the reference,
    row by row along the quantization axis (raises AssertionError on any difference)."""
    rows = x.float().tolist() if axis == 1 else x.float().t().tolist()
    want_scales, want_codes, want_decode = ref.nvfp4_rows(rows, block_2d=block_2d)
    scales, codes, decode = quantize(x, axis, block_2d)
    if axis == 0:
        scales, codes = scales.t(), codes.t()
    assert _same_bits(decode, torch.tensor(want_decode)).all(), (decode, want_decode)
    bad_scales = ~_same_bits(scales, torch.tensor(want_scales))
    assert not bad_scales.any(), (scales[bad_scales][:4], torch.tensor(want_scales)[bad_scales][:4])
    assert codes.tolist() == want_codes, "codes differ"
    if quantize is not _implementation:
        return
    want = torch.tensor(ref.nvfp4_dequantize(want_scales, want_codes, want_decode))
    want = want if axis == 1 else want.t()
    for have in (quantize_nvfp4(x, axis, block_2d=block_2d).dequantize(),
                 fake_quantize_nvfp4_along(x, axis, block_2d=block_2d)):
        same = _same_bits(have, want)
        assert same.all(), (have[~same][:4], want[~same][:4])


def _octave_data(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Magnitudes over many octaves along rows and columns, so block scales span E4M3's range
    (subnormal and underflowing scales included) and a wrong block axis shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    row_scale = 2.0 ** torch.randint(-8, 8, (rows, 1), generator=g)
    return x * row_scale * 2.0 ** torch.randint(-8, 8, (1, cols), generator=g)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_octave_data_matches_reference(axis: int, dtype: torch.dtype) -> None:
    _check(_octave_data(48, 64, seed=11).to(dtype), axis)


@pytest.mark.parametrize("axis", [0, 1])
def test_2d_blocks_match_reference(axis: int) -> None:
    _check(_octave_data(32, 48, seed=12), axis, block_2d=True)


def _with_block(block: list[float], others: float = 1000.0) -> torch.Tensor:
    """A 2 x 32 tensor: one special block, the rest `others` (which set the tensor amax)."""
    row = (block + [0.0] * BLOCK)[:BLOCK] + [others] * BLOCK
    return torch.tensor([row, [others] * (2 * BLOCK)], dtype=torch.float32)


SPECIAL_TENSORS = {
    "all zero": torch.zeros(2, 32),
    "negative zeros": torch.full((2, 32), -0.0),
    "zero block in a nonzero tensor": _with_block([0.0, -0.0]),
    "NaN": _with_block([math.nan, 1.0]),
    "Inf": _with_block([math.inf, 1.0]),
    "-Inf": _with_block([-math.inf]),
    # A block whose E4M3 scale underflows to 0 (a_b * S_enc / 6 < 2**-10): e_b = FLT_MAX, the
    # codes are those of x * FLT_MAX (saturated), and the block dequantizes to signed zeros.
    "block scale underflow": _with_block([1e-4, -2e-4, 3e-6, 0.0, -0.0], others=1e4),
    # Block scales in E4M3's subnormal range (2**-9 .. 2**-6).
    "subnormal block scales": _with_block([0.05, -0.01, 0.02], others=1e4),
    # Ties of the E2M1 grid after scaling: the tensor amax 6 * 448 gives S_enc = 1.
    "E2M1 ties": _with_block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25], others=2688.0),
    # A tiny tensor: S_enc = 2688 / A overflows fp32 and saturates at FLT_MAX; S_dec subnormal.
    "tiny tensor": torch.full((2, 32), 1e-37) * torch.linspace(-1, 1, 32),
    "fp32 subnormals": torch.full((2, 32), 2.0**-149) * torch.arange(32),
    # The top of fp32: S_enc is tiny.
    "huge tensor": torch.full((2, 32), 3.0e38) * torch.linspace(-1, 1, 32),
}


@pytest.mark.parametrize("name", list(SPECIAL_TENSORS))
def test_special_values_match_reference(name: str) -> None:
    x = SPECIAL_TENSORS[name]
    _check(x, 1)
    _check(x.t().contiguous(), 0)


def test_special_values_by_hand() -> None:
    """Worked on paper: amax 2688 gives S_enc = 1 and S_dec = 1; a block with amax 6 gets
    d_b = 6 * fp32(1/6) = 1 (rounded), scale 1; 0.25 and 5 are ties (to 0 and 4)."""
    x = _with_block([6.0, 0.25, 5.0, -3.0], others=2688.0)
    t = quantize_nvfp4(x)
    assert t.tensor_scale.item() == 1.0
    assert t.scale[0, 0].item() == 1.0 and t.codes[0, :4].tolist() == [0x7, 0x0, 0x6, 0xD]
    nan = quantize_nvfp4(_with_block([math.nan]))
    assert nan.tensor_scale.isnan() and (nan.scale.view(torch.uint8) == 0x7F).all()
    assert (nan.codes == 0).all() and nan.dequantize().isnan().all()
    underflow = quantize_nvfp4(SPECIAL_TENSORS["block scale underflow"])
    assert underflow.scale[0, 0].item() == 0.0 and underflow.codes[0, 0].item() == 0x7
    assert underflow.dequantize()[0, :BLOCK].abs().max().item() == 0.0
    zero = quantize_nvfp4(torch.zeros(2, 32))
    assert zero.tensor_scale.item() == ref.round_fp32(1.0 / F32_MAX) and (zero.codes == 0).all()


def _torchao_order(x: torch.Tensor, axis: int, block_2d: bool) -> Quantized:
    """A deliberately different order, torchao 0.18's `nvfp4_quantize` (written from its
    description): S_dec = A / 2688, s_b = E4M3(clamp((a_b / 6) / S_dec, 2**-6, 448)),
    e_b = (1 / S_dec) / s_b."""
    x32 = x.float()
    decode = x32.abs().amax() / 2688.0
    blocks = split_blocks(x32, axis, BLOCK)
    block_amax = blocks.abs().amax(axis + 1, keepdim=True)
    tiny = torch.finfo(torch.float8_e4m3fn).tiny
    scale = ((block_amax / 6.0) / decode).clamp(tiny, 448.0).to(torch.float8_e4m3fn).float()
    encode = (torch.ones_like(decode) / decode) / scale
    codes = encode_e2m1(round_e2m1(blocks * encode)).reshape(x.shape)
    return scale.squeeze(axis + 1), codes, decode


def test_a_different_op_order_fails() -> None:
    with pytest.raises(AssertionError):
        _check(_octave_data(48, 64, seed=11), 1, quantize=_torchao_order)


def test_weight_2d_blocks_give_w_and_wt_the_same_values() -> None:
    """With 16x16 blocks, W quantized along its rows and W.T along its rows hold the same codes
    and scales (transposed), and the values do not depend on the quantization axis."""
    w = _octave_data(64, 48, seed=13)
    along_rows = quantize_nvfp4(w, 1, block_2d=True)
    transposed = quantize_nvfp4(w.t().contiguous(), 0, block_2d=True)
    assert torch.equal(along_rows.codes, transposed.codes.t())
    assert torch.equal(along_rows.scale.view(torch.uint8), transposed.scale.view(torch.uint8).t())
    forward = fake_quantize_nvfp4_along(w, 1, block_2d=True)
    backward = fake_quantize_nvfp4_along(w.t().contiguous(), 1, block_2d=True)
    assert torch.equal(forward.view(torch.int32), backward.t().contiguous().view(torch.int32))
    assert torch.equal(forward, fake_quantize_nvfp4_along(w, 0, block_2d=True))


def test_1d_blocks_give_w_and_wt_different_values() -> None:
    """The broken variant (1x16 blocks for a weight) fails the property above."""
    w = _octave_data(64, 48, seed=13)
    forward = fake_quantize_nvfp4_along(w, 1)
    backward = fake_quantize_nvfp4_along(w.t().contiguous(), 1)
    assert not torch.equal(forward, backward.t())


@st.composite
def _tensors(draw) -> torch.Tensor:
    rows = draw(st.integers(1, 3))
    finite = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32)
    mantissas = st.sampled_from([1.0, 1.5, -1.25, 1.75, 0.0, -0.0])
    octave = st.builds(lambda m, e: m * 2.0**e, mantissas, st.integers(-40, 40))
    values = draw(st.lists(st.one_of(finite, octave), min_size=rows * 2 * BLOCK, max_size=rows * 2 * BLOCK))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, 2 * BLOCK)


@SETTINGS
@given(_tensors(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_hypothesis_tensors(x: torch.Tensor, dtype: torch.dtype) -> None:
    _check(x.to(dtype), 1)


def test_tensor_amax_argument_and_errors() -> None:
    x = _octave_data(16, 32, seed=2)
    amax = x.abs().amax()
    assert torch.equal(fake_quantize_nvfp4_along(x, 1, tensor_amax=amax), fake_quantize_nvfp4_along(x, 1))
    by_row = fake_quantize_fp4_along(x, 0, NVFP4, block_2d=True)
    assert torch.equal(by_row, fake_quantize_nvfp4_along(x, 0, block_2d=True))
    t = quantize_nvfp4(x)
    assert isinstance(t, FP4Tensor) and t.shape == x.shape and t.data.shape == (16, 16)
    assert t.format is NVFP4 and t.format.elem is E2M1
    with pytest.raises(ValueError, match=r"x.shape\[1\]=24 .*block_size=16"):
        quantize_nvfp4(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="block_2d=True needs a 2-D tensor"):
        quantize_nvfp4(torch.zeros(8, 32), block_2d=True)
    with pytest.raises(ValueError, match="block_2d=1 must be a bool"):
        quantize_nvfp4(x, block_2d=1)  # type: ignore[arg-type]
