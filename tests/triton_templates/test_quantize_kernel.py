"""The quantize kernel against the numerics core, bit for bit, under the Triton interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from mxcompile.numerics import ELEM_FORMATS, ScaleMode, elem_format, quantize_along
from mxcompile.triton_templates import (
    quantize_mx_triton,
    quantize_mx_triton_rowcol,
    triton_available,
)

MODES = ("rceil", "floor", "ceil", "even")
TILES = {"BLOCK_M": 64, "BLOCK_N": 64}  # divides neither 96 nor 160: masked edge tiles


def _special_values_tensor(rows: int = 96, cols: int = 160) -> torch.Tensor:
    """Magnitudes spanning many octaves along both axes (so a wrong block axis shows), plus
    blocks built around the edge cases of the scale rules and of the FP8 cast."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, cols, generator=g)
    x = (
        x
        * torch.logspace(-6, 6, cols, base=2.0)[None, :]
        * torch.logspace(-9, 9, rows, base=2.0)[:, None]
    )
    # Row 0 (row-wise blocks) and column 0 (column-wise blocks) carry the special values.
    two = torch.tensor(2.0)
    pow2 = torch.tensor([2.0**e for e in (-130, -126, -20, 0, 8, 9, 15, 16, 100, 127)])
    special = torch.cat(
        [
            torch.tensor([0.0, -0.0, float("nan")]),  # block 0 of row 0: a NaN block
            torch.zeros(29),
            torch.tensor([float("inf")]),  # block 1: an Inf block
            torch.randn(31, generator=g),
            torch.zeros(32),  # block 2: all zeros
            torch.tensor([1e-40, -3e-42, 1.4e-45, 1e-39]),  # block 3: fp32 subnormals only
            torch.tensor([2.0**-133] * 28),
            pow2,  # block 4: powers of two and their neighbours (±1 ulp)
            torch.nextafter(pow2, two * pow2),
            torch.nextafter(pow2, torch.zeros(10)),
            torch.tensor([-0.0, 1.0]),
        ]
    )
    x[0, :] = special[:cols]
    x[: special.numel() - 64, 0] = special[64:]  # column-wise: zero, subnormal, pow2 blocks
    x[40, 0] = float("nan")  # a column-wise NaN block
    # Saturation: amax values that round up past the format's max in floor mode, and values
    # just below/above the power-of-two boundaries the rceil/ceil/even rules care about.
    for i, v in enumerate([448.0, 479.0, 480.0, 500.0, 57344.0, 61440.0, 65000.0, 3.0e38]):
        r, c = 1 + i // (cols // 32), 32 * (i % (cols // 32))
        x[r, c] = v
        x[r, c + 1] = -v * 0.75
        x[64 + i % 32, 1 + i] = v
    return x


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_same(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    (d, s), (rd, rs) = got, want
    assert d.dtype == rd.dtype and s.dtype == torch.uint8 and s.shape == rs.shape, what
    bad_s = (s != rs).nonzero()
    assert bad_s.numel() == 0, f"{what}: scale bytes differ at {bad_s[:5].tolist()}"
    bad_d = (_bytes(d) != _bytes(rd)).nonzero()
    assert bad_d.numel() == 0, f"{what}: data bytes differ at {bad_d[:5].tolist()}"


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_mode", MODES)
def test_rowcol_bit_exact_special_values(elem: str, scale_mode: str) -> None:
    x = _special_values_tensor()
    fmt, smode = elem_format(elem), ScaleMode(scale_mode)
    rd, rs, cd, cs = quantize_mx_triton_rowcol(x, elem, scale_mode, 32, tiles=TILES)
    _assert_same((rd, rs), quantize_along(x, 1, fmt, smode, 32), f"row-wise {elem} {scale_mode}")
    _assert_same((cd, cs), quantize_along(x, 0, fmt, smode, 32), f"column-wise {elem} {scale_mode}")
    assert rs[0, 0] == 0xFF and rs[0, 1] == 0xFF and (_bytes(rd[0, :64]) == 0x7F).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    x = _special_values_tensor()
    x = x.clamp(-60000, 60000).to(dtype) if dtype == torch.float16 else x.to(dtype)
    fmt = elem_format("e4m3")
    rd, rs, cd, cs = quantize_mx_triton_rowcol(x, "e4m3", "rceil", 32, tiles=TILES)
    _assert_same((rd, rs), quantize_along(x, 1, fmt, ScaleMode.RCEIL, 32), f"row-wise {dtype}")
    _assert_same((cd, cs), quantize_along(x, 0, fmt, ScaleMode.RCEIL, 32), f"column-wise {dtype}")


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_cast_rounding_exhaustive(elem: str) -> None:
    """Every FP8 value, the midpoints between neighbours (ties to even) and their fp32
    neighbours, in blocks whose scale is exactly 1 (amax = max_normal)."""
    fmt = ELEM_FORMATS[elem]
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    values = codes.view(fmt.dtype).float()
    values = values[values.isfinite() & (values <= fmt.max_normal)]
    mids = (values[:-1] + values[1:]) / 2  # exact in fp32
    probes = torch.cat(
        [values, mids, torch.nextafter(mids, values[1:]), torch.nextafter(mids, values[:-1])]
    )
    probes = torch.cat([probes, -probes])
    per_block = 31
    blocks = math.ceil(probes.numel() / per_block)
    blocks += blocks % 2  # two blocks per row
    body = torch.zeros(blocks * per_block)
    body[: probes.numel()] = probes
    # rceil: descale = max * fp32(1/max) = 1 -> scale byte 127 in every block.
    head = torch.full((blocks, 1), fmt.max_normal)
    x = torch.cat([head, body.reshape(blocks, per_block)], dim=1).reshape(-1, 64)
    d, s = quantize_mx_triton(x, -1, elem, "rceil", 32, tiles={"BLOCK_M": 64, "BLOCK_N": 64})
    _assert_same((d, s), quantize_along(x, 1, fmt, ScaleMode.RCEIL, 32), f"cast {elem}")
    assert (s == 127).all()


def test_ragged_non_quantized_axis_and_strides() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 96, generator=g) * torch.logspace(-5, 5, 96)[None, :]
    fmt = elem_format("e4m3")
    got = quantize_mx_triton(x, -1, tiles={"BLOCK_M": 32, "BLOCK_N": 64})
    _assert_same(got, quantize_along(x, 1, fmt, ScaleMode.RCEIL, 32), "50x96 row-wise")
    xt = x.t()  # (96, 50), non-contiguous: quantize along axis 0 (the 96)
    got = quantize_mx_triton(xt, 0, tiles={"BLOCK_M": 64, "BLOCK_N": 32})
    _assert_same(got, quantize_along(xt, 0, fmt, ScaleMode.RCEIL, 32), "96x50 column-wise, strided")
    x3 = x.reshape(5, 10, 96)
    d, s = quantize_mx_triton(x3, -1, block_size=16)
    assert d.shape == (5, 10, 96) and s.shape == (5, 10, 6)
    _assert_same((d, s), quantize_along(x3, 2, fmt, ScaleMode.RCEIL, 16), "3-d, block 16")


def test_default_tiles_and_block_64() -> None:
    x = _special_values_tensor(128, 128)
    fmt = elem_format("e5m2")
    got = quantize_mx_triton_rowcol(x, "e5m2", "even", 64)
    _assert_same(got[:2], quantize_along(x, 1, fmt, ScaleMode.EVEN, 64), "row-wise block 64")
    _assert_same(got[2:], quantize_along(x, 0, fmt, ScaleMode.EVEN, 64), "column-wise block 64")


def test_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="not divisible by block_size"):
        quantize_mx_triton(torch.randn(4, 40), -1)
    with pytest.raises(ValueError, match="supports the last axis"):
        quantize_mx_triton(torch.randn(32, 32, 32), 1)
    with pytest.raises(ValueError, match="not a supported MX element format"):
        quantize_mx_triton(x, -1, elem="e2m1")
    with pytest.raises(RuntimeError, match="power of two"):
        quantize_mx_triton(torch.randn(4, 48), -1, block_size=24)
    with pytest.raises(ValueError, match="tiles\\['BLOCK_N'\\]"):
        quantize_mx_triton(x, -1, tiles={"BLOCK_M": 64, "BLOCK_N": 16})
    ok, reason = triton_available("cpu", elem="e3m2")
    assert not ok and "unsupported element format" in reason
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, reason = triton_available("cpu")
    assert not ok and "TRITON_INTERPRET=1" in reason
    with pytest.raises(RuntimeError, match="cannot run: tensors are on 'cpu'"):
        quantize_mx_triton(x, -1)


def test_empty_tensors() -> None:
    d, s = quantize_mx_triton(torch.empty(0, 64), -1)
    assert d.shape == (0, 64) and s.shape == (0, 2)
    rd, rs, cd, cs = quantize_mx_triton_rowcol(torch.empty(32, 0))
    assert rd.shape == (32, 0) and cs.shape == (1, 0)
