"""Cross-check against torchao 0.18's `to_mx` (a second, independent implementation).

Agreement is bit-exact on finite data whose blocks all get a scale byte >= 1. torchao differs
from the definitions mxcompile implements (checked on torchao 0.18.0) in three places, so the
comparison is restricted to data that avoids them:
  * blocks with scale byte 0 (amax below about 2**-119 for e4m3): torchao divides by 2**-126
    instead of 2**-127 (it clamps the fp32 scale to the smallest normal) in floor / ceil /
    even mode, and multiplies by 1.0 instead of 2**127 in rceil mode, so its elements are
    halved or flushed to zero;
  * a block holding an Inf: torchao treats it as finite (scale 247, or 254 in rceil mode; the
    Inf saturates to 448, the other elements flush to zero), where the definition makes the
    whole block NaN (scale 0xFF);
  * a block holding a NaN: torchao sets scale 0xFF but keeps a NaN only where the input had
    one (in floor / ceil / even mode), where the definition writes 0x7F in every element.

rceil: torchao (and cuDNN's documentation) compute the descale as amax / max_elem; NVIDIA's
kernels (TransformerEngine's MXFP8 cast: `amax * Quantized_Limits<OType>::max_norm_rcp`, the
cuBLAS block-scaling recipe) multiply by fp32(1 / max_elem), as mxcompile does. For e4m3
(max 448) and e5m2 (max 57344) the two give the same scale byte for every fp32 amax: checked
exhaustively below over every mantissa of representative binades (the scale byte only depends
on the mantissa, except where the descale is an fp32 subnormal, which has its own binades).
"""

from __future__ import annotations

import math

import pytest
import torch

from mxcompile.numerics import ELEM_FORMATS, ScaleMode, quantize_mx, scale_bytes_from_amax

torchao_mx = pytest.importorskip(
    "torchao.prototype.mx_formats.mx_tensor", reason="torchao (0.18) is not installed"
)
torchao_config = pytest.importorskip("torchao.prototype.mx_formats.config")

MODES = ("floor", "rceil", "ceil", "even")
ELEM_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _octave_data(dtype: torch.dtype, rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian data whose magnitude varies by up to 2**+-12 along rows and along columns (a
    wrong blocking axis changes scales), with mode-separating values planted in it: exact
    powers of two, 448 * 2**k and 57344 * 2**k (rceil boundaries), 1.9375 * 2**k and
    1.875 * 2**k (even-mode ties), and their neighbours. All blocks get a scale byte >= 1."""
    gen = torch.Generator().manual_seed(seed)
    row_exp = torch.randint(-12, 13, (rows, 1), generator=gen)
    col_exp = torch.randint(-12, 13, (1, cols), generator=gen)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * torch.exp2(
        (row_exp + col_exp).double()
    )
    plant = torch.tensor([1.0, 448.0 / 256, 57344.0 / 2**15, 1.9375, 1.875, 1.5, 1.75])
    n = rows * cols // 16
    idx = torch.randint(0, rows * cols, (n,), generator=gen)
    vals = plant[torch.randint(0, len(plant), (n,), generator=gen)].double()
    vals = vals * torch.exp2(torch.randint(-10, 11, (n,), generator=gen).double())
    nudge = torch.randint(-1, 2, (n,), generator=gen).double() * 2.0**-7  # one bf16 ulp
    signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    x.view(-1)[idx] = signs * vals * (1 + nudge) * 8  # large enough to be the block's amax often
    return x.to(dtype)


def _torchao(x: torch.Tensor, elem: str, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = torchao_mx.to_mx(
        x.contiguous(), ELEM_DTYPES[elem], 32, torchao_config.ScaleCalculationMode(scale_mode)
    )
    return scale.view(torch.uint8), data.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_mode", MODES)
def test_matches_torchao_to_mx(dtype: torch.dtype, elem: str, scale_mode: str) -> None:
    x = _octave_data(dtype)
    # Along the last axis (torchao's only axis) ...
    want_scale, want_data = _torchao(x, elem, scale_mode)
    assert int(want_scale.min()) >= 1, "test data must avoid scale byte 0 (see module doc)"
    mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode)
    _assert_equal_rows_and_columns(mx.scale.view(torch.uint8), want_scale, "scale")
    _assert_equal_rows_and_columns(mx.data.view(torch.uint8), want_data, "data")
    # ... and along axis 0, against torchao on the transposed tensor.
    want_scale0, want_data0 = _torchao(x.t(), elem, scale_mode)
    mx0 = quantize_mx(x, 0, elem=elem, scale_mode=scale_mode)
    _assert_equal_rows_and_columns(mx0.scale.view(torch.uint8), want_scale0.t(), "scale axis 0")
    _assert_equal_rows_and_columns(mx0.data.view(torch.uint8), want_data0.t(), "data axis 0")


def _assert_equal_rows_and_columns(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} mismatches, first at {bad[:5].tolist()}: "
        f"got {got[tuple(bad[0])].item():#x}, torchao {want[tuple(bad[0])].item():#x}"
    )


def test_octave_data_tells_axes_apart() -> None:
    """The cross-check data is sensitive to the blocking axis: quantizing along the wrong axis
    gives different bytes (guards against a test that cannot fail; see FACTS.md)."""
    x = _octave_data(torch.bfloat16)
    square = x[:, :64]
    along_rows = quantize_mx(square, -1)
    along_cols = quantize_mx(square, 0)
    assert not torch.equal(along_rows.data.view(torch.uint8), along_cols.data.view(torch.uint8))
    differing_rows = (along_rows.data.view(torch.uint8) != along_cols.data.view(torch.uint8)).any(1)
    assert differing_rows.float().mean() > 0.5


def _frexp_ceil_log2_bytes(descale: torch.Tensor) -> torch.Tensor:
    """clamp(ceil(log2(descale)) + 127, 0, 254) via torch.frexp (exact, subnormals included);
    a descale that underflowed to 0 gives byte 0."""
    mantissa, exponent = torch.frexp(descale)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    byte = (ceil_log2 + 127).clamp(0, 254).to(torch.int32)
    return torch.where(descale == 0, 0, byte)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("where", ["descale_crosses_1", "descale_crosses_2^-126", "descale_crosses_2^-127"])
def test_rceil_reciprocal_multiply_equals_division_on_every_mantissa(elem: str, where: str) -> None:
    """For every fp32 amax of one binade [2**b, 2**(b+1)) (2**23 values), mxcompile's rceil
    byte equals clamp(ceil(log2(fp32(amax / max))) + 127, 0, 254), the division form used by
    torchao and cuDNN's documentation. All binades whose descales are fp32 normals behave alike
    (scaling by a power of two is exact), so one of them (the one holding max_elem, where the
    descale crosses 1) stands for all; the others are where the descale becomes an fp32
    subnormal (2**-126) and where it crosses 2**-127, the boundary between bytes 0 and 1."""
    fmt = ELEM_FORMATS[elem]
    crossing = {"descale_crosses_1": 0, "descale_crosses_2^-126": -126, "descale_crosses_2^-127": -127}
    binade = math.floor(math.log2(fmt.max_normal)) + crossing[where]
    if where == "descale_crosses_2^-127":
        binade = math.floor(math.log2(fmt.max_normal * 2.0**-127))
    bits = torch.arange(1 << 23, dtype=torch.int32) | ((binade + 127) << 23)
    amax = bits.view(torch.float32)
    got = scale_bytes_from_amax(amax, fmt, ScaleMode.RCEIL)
    descale = amax / fmt.max_normal  # torch fp32 division, correctly rounded
    assert descale.min() < 2.0 ** crossing[where] <= descale.max()
    want = _frexp_ceil_log2_bytes(descale)
    mismatches = (got != want).sum().item()
    assert mismatches == 0, f"{mismatches} amax values differ, e.g. {amax[got != want][:3]}"
