"""Invalid arguments raise ValueError naming the argument (and what is accepted)."""

from __future__ import annotations

import pytest
import torch

from mxcompile.numerics import check_block_size, dequantize_mx, mx_matmul, quantize_mx


def test_axis_not_divisible_by_block_size() -> None:
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match=r"x\.shape\[1\]=48 .*not divisible by block_size=32"):
        quantize_mx(x, -1)
    with pytest.raises(ValueError, match=r"x\.shape\[0\]=4 .*block_size=32"):
        quantize_mx(x, 0)
    quantize_mx(x, -1, block_size=16)  # 48 is a multiple of 16


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.uint8, torch.bool, torch.float64, torch.float8_e4m3fn], ids=str
)
def test_unsupported_input_dtype(dtype: torch.dtype) -> None:
    x = torch.zeros(2, 32, dtype=dtype)
    with pytest.raises(ValueError, match=r"x has dtype .*accepts"):
        quantize_mx(x)


def test_not_a_tensor_and_0d() -> None:
    with pytest.raises(ValueError, match=r"x must be a torch\.Tensor"):
        quantize_mx([1.0] * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x is a 0-d tensor"):
        quantize_mx(torch.tensor(1.0))


@pytest.mark.parametrize("elem", ["e4m3fn", "fp8", "E4M3", "e2m1", None])
def test_unknown_elem(elem) -> None:
    with pytest.raises(ValueError, match=r"elem=.*not a supported MX element format.*e4m3.*e5m2"):
        quantize_mx(torch.randn(2, 32), elem=elem)


@pytest.mark.parametrize("scale_mode", ["nearest", "RCEIL", "round", ""])
def test_unknown_scale_mode(scale_mode: str) -> None:
    with pytest.raises(ValueError, match=r"scale_mode=.*not a supported scale mode.*rceil"):
        quantize_mx(torch.randn(2, 32), scale_mode=scale_mode)


@pytest.mark.parametrize("axis", [2, -3, 7, True, 1.0, None])
def test_wrong_axis(axis) -> None:
    with pytest.raises(ValueError, match=r"axis=.*out of range.*\[-2, 1\]"):
        quantize_mx(torch.randn(32, 32), axis)


@pytest.mark.parametrize("block_size", [0, -32, 12, 33, 4, 32.0, True, "32"])
def test_bad_block_size(block_size) -> None:
    with pytest.raises(ValueError, match=r"block_size=.*positive multiple of 8"):
        quantize_mx(torch.randn(2, 96), block_size=block_size)
    with pytest.raises(ValueError, match=r"block_size="):
        check_block_size(block_size)


@pytest.mark.parametrize("block_size", [8, 16, 24, 32, 64])
def test_good_block_sizes(block_size: int) -> None:
    mx = quantize_mx(torch.randn(2, 192), block_size=block_size)
    assert mx.scale.shape == (2, 192 // block_size)


def test_mx_matmul_wrong_axes() -> None:
    a = torch.randn(8, 64)
    b = torch.randn(64, 16)
    good_a, good_b = quantize_mx(a, -1), quantize_mx(b, 0)
    assert mx_matmul(good_a, good_b).shape == (8, 16)
    with pytest.raises(ValueError, match=r"a is quantized along axis 0 .*contraction axis is 1.*axis=-1"):
        mx_matmul(quantize_mx(torch.randn(64, 64), 0), good_b)
    with pytest.raises(ValueError, match=r"b is quantized along axis 1 .*contraction axis is 0.*axis=-2"):
        mx_matmul(good_a, quantize_mx(torch.randn(64, 32), 1))
    with pytest.raises(ValueError, match=r"a must be an MXTensor"):
        mx_matmul(a, good_b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"b must be an MXTensor"):
        mx_matmul(good_a, b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a has 1 dimension"):
        mx_matmul(quantize_mx(torch.randn(64), 0), good_b)
    with pytest.raises(ValueError, match=r"block_size=16 .*differ"):
        mx_matmul(quantize_mx(a, -1, block_size=16), good_b)
    with pytest.raises(ValueError, match=r"contraction lengths differ"):
        mx_matmul(quantize_mx(torch.randn(8, 32), -1), good_b)


def test_dequantize_errors() -> None:
    with pytest.raises(ValueError, match=r"mx must be an MXTensor"):
        dequantize_mx(torch.randn(2, 32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype=torch\.int32 is not a floating-point dtype"):
        dequantize_mx(quantize_mx(torch.randn(2, 32)), torch.int32)
