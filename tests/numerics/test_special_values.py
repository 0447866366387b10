"""Bit-exact special values: every case x scale mode x element format x input dtype.

Expectations come from `mx_reference` (pure Python, written from the definitions) and, for a
hand-checked subset, from literal bytes worked out on paper (`LITERAL_CASES`), which also pins
the reference itself.
"""

from __future__ import annotations

import math

import pytest
import torch

import mx_reference as ref
from mx_reference import BLOCK, pad_block, special_cases
from mxcompile.numerics import (
    dequantize_mx,
    inverse_scale_fp32_from_bytes,
    quantize_mx,
    scale_fp32_from_bytes,
)

MODES = ref.SCALE_MODES
ELEMS = ("e4m3", "e5m2")
INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _tensor(rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


def _check_against_reference(
    x: torch.Tensor, names: list[str], elem: str, scale_mode: str, block_size: int, axis: int
) -> None:
    fmt = ref.FP8_SPECS[elem]
    rows = x.tolist() if axis == -1 else x.t().tolist()
    want_scales, want_data = ref.quantize_rows(rows, fmt, scale_mode, block_size)
    mx = quantize_mx(x, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    got_scales = mx.scale.view(torch.uint8)
    got_data = mx.data.view(torch.uint8)
    if axis == 0:
        got_scales, got_data = got_scales.t(), got_data.t()
    got_scales, got_data = got_scales.tolist(), got_data.tolist()
    for name, ws, wd, gs, gd, row in zip(names, want_scales, want_data, got_scales, got_data, rows):
        assert gs == ws, f"{name}: scale bytes {gs} != expected {ws} for {row}"
        assert gd == wd, (
            f"{name}: data bytes {[hex(b) for b in gd]} != expected {[hex(b) for b in wd]} "
            f"for {row}"
        )
    # Dequantize: exact in fp32; a NaN-scale block is all NaN.
    deq = dequantize_mx(mx, torch.float32)
    if axis == 0:
        deq = deq.t()
    for name, ws, wd, got in zip(names, want_scales, want_data, deq.tolist()):
        for start in range(0, len(wd), block_size):
            want = ref.dequantize_block(ws[start // block_size], wd[start : start + block_size], fmt)
            want = [ref.round_fp32(w) for w in want]  # 2**128 (from an input at max) is inf
            have = got[start : start + block_size]
            for w, h in zip(want, have):
                assert (math.isnan(w) and math.isnan(h)) or (
                    w == h and math.copysign(1, w) == math.copysign(1, h)
                ), f"{name}: dequantized {have} != expected {want}"


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("scale_mode", MODES)
def test_special_values_match_reference(dtype: torch.dtype, elem: str, scale_mode: str) -> None:
    cases = special_cases(dtype)
    names = [name for name, _ in cases]
    x = _tensor([values for _, values in cases], dtype)
    _check_against_reference(x, names, elem, scale_mode, BLOCK, axis=-1)
    # The same blocks laid out down the columns, quantized along axis 0.
    _check_against_reference(x.t().contiguous(), names, elem, scale_mode, BLOCK, axis=0)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("scale_mode", MODES)
def test_special_values_block_size_8(elem: str, scale_mode: str) -> None:
    """Blocks of 8 split every special block in four: each part gets its own scale."""
    cases = special_cases(torch.float32)
    x = _tensor([values for _, values in cases], torch.float32)
    _check_against_reference(x, [n for n, _ in cases], elem, scale_mode, 8, axis=-1)


def test_negative_nan_input_gives_positive_nan_bytes() -> None:
    """A NaN with the sign bit set still yields scale 0xFF and the positive NaN byte 0x7F."""
    for dtype, bits_dtype, neg_nan_bits in (
        (torch.bfloat16, torch.int16, -64),  # 0xFFC0
        (torch.float32, torch.int32, -4194304),  # 0xFFC00000
    ):
        x = torch.ones(2, BLOCK, dtype=dtype)
        x.view(bits_dtype)[0, 3] = neg_nan_bits
        assert torch.isnan(x[0, 3]) and x.view(bits_dtype)[0, 3] < 0
        for elem in ELEMS:
            for scale_mode in MODES:
                mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode)
                assert mx.scale.view(torch.uint8)[0].tolist() == [0xFF]
                assert mx.data.view(torch.uint8)[0].tolist() == [0x7F] * BLOCK
                # The NaN does not leak into the neighbouring block.
                want_scale, want_data = ref.quantize_block([1.0] * BLOCK, ref.FP8_SPECS[elem], scale_mode)
                assert mx.scale.view(torch.uint8)[1].tolist() == [want_scale]
                assert mx.data.view(torch.uint8)[1].tolist() == want_data


# Hand-worked expectations: (case, dtype, elem, mode) -> (scale byte, leading data bytes).
# The remaining elements of each block are zeros (data 0x00) unless listed.
LITERAL_CASES: list[tuple[str, list[float], torch.dtype, str, str, int, list[int]]] = []
for _dtype in (torch.bfloat16, torch.float32):
    for _mode in MODES:
        # 2**-133 (bf16's smallest subnormal): scale byte 0 (2**-127) and data 2**-6,
        # e4m3 0b0_0001_000 and e5m2 0b0_01001_00.
        LITERAL_CASES.append(("2^-133", [2.0**-133], _dtype, "e4m3", _mode, 0, [0x08]))
        LITERAL_CASES.append(("2^-133", [2.0**-133], _dtype, "e5m2", _mode, 0, [0x24]))
        LITERAL_CASES.append(("all_nan", [math.nan] * BLOCK, _dtype, "e4m3", _mode, 0xFF, [0x7F] * BLOCK))
        LITERAL_CASES.append(("inf", [1.0, math.inf], _dtype, "e5m2", _mode, 0xFF, [0x7F] * BLOCK))
        LITERAL_CASES.append(("signed_zero", [0.0, -0.0], _dtype, "e4m3", _mode, 0, [0x00, 0x80]))
        # 57344 = 1.75 * 2**15 is e5m2's max: scale 1, bytes 0b0_11110_11 = 0x7B / 0xFB, except
        # in ceil mode, which rounds log2 up to 16: scale 2, 28672 = 0b0_11101_11 = 0x77.
        LITERAL_CASES.append(
            ("pm57344", [57344.0, -57344.0], _dtype, "e5m2", _mode,
             128 if _mode == "ceil" else 127, [0x77, 0xF7] if _mode == "ceil" else [0x7B, 0xFB])
        )
    # +-448: floor, rceil and even keep scale 1 (e4m3 max 0x7E); ceil rounds log2(448) up to 9,
    # scale 2, and 224 = 1.75 * 2**7 is 0b0_1110_110 = 0x76.
    for _mode, _scale, _bytes in (
        ("floor", 127, [0x7E, 0xFE]),
        ("rceil", 127, [0x7E, 0xFE]),
        ("even", 127, [0x7E, 0xFE]),
        ("ceil", 128, [0x76, 0xF6]),
    ):
        LITERAL_CASES.append(("pm448", [448.0, -448.0], _dtype, "e4m3", _mode, _scale, _bytes))
    # 510: floor keeps scale 1 (exponent 8) and saturates to 448 (0x7E); the other modes go to
    # scale 2 and 255 rounds to 256 = 2**8, 0b0_1111_000 = 0x78.
    for _mode, _scale, _bytes in (
        ("floor", 127, [0x7E]),
        ("rceil", 128, [0x78]),
        ("ceil", 128, [0x78]),
        ("even", 128, [0x78]),
    ):
        LITERAL_CASES.append(("510", [510.0], _dtype, "e4m3", _mode, _scale, _bytes))
# fp32 max (2 - 2**-23) * 2**127: floor scale 254 - 8 = 246 leaves ~512, saturating to 448; the
# other modes reach 2**128 -> byte 247 and the element (2 - 2**-23) * 2**7 rounds to 256.
_F32_MAX = torch.finfo(torch.float32).max
for _mode, _scale, _bytes in (
    ("floor", 246, [0x7E, 0xFE]),
    ("rceil", 247, [0x78, 0xF8]),
    ("ceil", 247, [0x78, 0xF8]),
    ("even", 247, [0x78, 0xF8]),
):
    LITERAL_CASES.append(("f32max", [_F32_MAX, -_F32_MAX], torch.float32, "e4m3", _mode, _scale, _bytes))
# bf16 max (2 - 2**-7) * 2**127: floor leaves 510 -> saturates; others: 255 -> 256.
_BF16_MAX = torch.finfo(torch.bfloat16).max
for _mode, _scale, _bytes in (
    ("floor", 246, [0x7E]),
    ("rceil", 247, [0x78]),
    ("ceil", 247, [0x78]),
    ("even", 247, [0x78]),
):
    LITERAL_CASES.append(("bf16max", [_BF16_MAX], torch.bfloat16, "e4m3", _mode, _scale, _bytes))
# Powers of two and their neighbours, e4m3 (emax 8), bf16 input:
#   256 (2**8): byte 127 in every mode (rceil: 256/448 rounds up to 2**0).
#   257 (next bf16 after 256 is 258): floor 127, ceil 128, even 127, rceil 127 (258/448 < 1).
#   255 (bf16 255): floor 126, ceil 127, even 127 (255 rounds half-up to 256), rceil 127.
#   448 * 2**-2 = 112: rceil exactly 2**-2 -> 125; next bf16 up (112.5) -> 126.
for _amax, _expected in (
    (256.0, {"floor": 127, "ceil": 127, "even": 127, "rceil": 127}),
    (258.0, {"floor": 127, "ceil": 128, "even": 127, "rceil": 127}),
    (255.0, {"floor": 126, "ceil": 127, "even": 127, "rceil": 127}),
    (240.0, {"floor": 126, "ceil": 127, "even": 126, "rceil": 127}),
    (248.0, {"floor": 126, "ceil": 127, "even": 127, "rceil": 127}),
    (112.0, {"floor": 125, "ceil": 126, "even": 125, "rceil": 125}),
    (112.5, {"floor": 125, "ceil": 126, "even": 125, "rceil": 126}),
):
    for _mode, _scale in _expected.items():
        _lead = ref.fp8_encode(_amax * 2.0 ** (127 - _scale), ref.E4M3)
        LITERAL_CASES.append((f"amax{_amax}", [_amax], torch.bfloat16, "e4m3", _mode, _scale, [_lead]))


@pytest.mark.parametrize(
    "name,values,dtype,elem,scale_mode,scale,lead",
    LITERAL_CASES,
    ids=[f"{c[0]}-{c[2]}-{c[3]}-{c[4]}".replace("torch.", "") for c in LITERAL_CASES],
)
def test_literal_bytes(
    name: str, values: list[float], dtype: torch.dtype, elem: str, scale_mode: str, scale: int,
    lead: list[int]
) -> None:
    block = pad_block(values)
    want_data = lead + [0x00] * (BLOCK - len(lead))
    # The reference agrees with the hand-worked bytes ...
    x = _tensor([block], dtype)
    assert ref.quantize_block(x[0].tolist(), ref.FP8_SPECS[elem], scale_mode) == (scale, want_data)
    # ... and so does mxcompile.
    mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode)
    assert mx.scale.view(torch.uint8).tolist() == [[scale]]
    assert mx.data.view(torch.uint8).tolist() == [want_data]


def test_subnormal_example_dequantizes_exactly() -> None:
    """bf16 2**-133 -> scale 2**-127, element 2**-6 -> back to exactly 2**-133."""
    x = _tensor([pad_block([2.0**-133])], torch.bfloat16)
    mx = quantize_mx(x, -1, elem="e4m3", scale_mode="rceil")
    assert mx.data.float()[0, 0].item() == 2.0**-6
    assert dequantize_mx(mx, torch.float32)[0, 0].item() == 2.0**-133
    assert dequantize_mx(mx, torch.bfloat16)[0, 0].item() == 2.0**-133


def test_scale_values_of_every_byte() -> None:
    """2**(b - 127) and its inverse 2**(127 - b) for all 255 finite bytes (2**-127 is an fp32
    subnormal and must not flush), NaN for 0xFF. Bytes 247..254 never come out of quantizing
    fp32 data, so only this direct check covers them."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale = scale_fp32_from_bytes(b).tolist()
    inverse = inverse_scale_fp32_from_bytes(b).tolist()
    for byte in range(255):
        assert scale[byte] == 2.0 ** (byte - 127), byte
        assert inverse[byte] == 2.0 ** (127 - byte), byte
    assert math.isnan(scale[255]) and math.isnan(inverse[255])
