"""Property tests (hypothesis) of quantize_mx / dequantize_mx on small random tensors.

The values drawn cover fp32's whole finite range (subnormals and values near the maximum
included) and blocks whose elements span many octaves. Expectations are derived from the
definitions in `mx_reference`, never from mxcompile itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mx_reference as ref
from mxcompile.numerics import dequantize_mx, elem_format, fake_quantize_along, quantize_mx, scale_mode_named

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

INPUT_DTYPES = (torch.float32, torch.bfloat16)
# Largest magnitude drawn: finite in bf16 too (bf16's max is 3.3895e38).
MAX_DRAWN = 2.0**128 - 2.0**121  # bf16 max (2 - 2**-7) * 2**127

_finite_fp32 = st.floats(
    min_value=-MAX_DRAWN, max_value=MAX_DRAWN, allow_nan=False, allow_infinity=False, width=32
)
# Values a few octaves around 1, with "interesting" mantissas (the element grid points, ties).
_octaves = st.builds(
    lambda m, e, s: s * math.ldexp(m, e),
    st.sampled_from([1.0, 1.0625, 1.125, 1.1875, 1.5, 1.75, 1.875, 1.9375, 1.96875, 1.3, 1.99]),
    st.integers(-24, 24),
    st.sampled_from([1.0, -1.0]),
)
_specials = st.sampled_from(
    [0.0, -0.0, 448.0, -448.0, 480.0, 57344.0, 2.0**-126, 2.0**-133, -(2.0**-149), 1.0]
)
element = st.one_of(_finite_fp32, _octaves, _specials)

# Block maxima at the places where the scale modes differ: powers of two and their fp32
# neighbours, the even-mode ties of e4m3 (1.9375) and e5m2 (1.875), the rceil boundary 448/256
# = 57344/2**15 = 1.75, and their neighbours.
_ULP = 2.0**-23
BOUNDARY_MANTISSAS = [
    1.0, 1.0 + _ULP, 2.0 - _ULP, 1.875, 1.875 - _ULP, 1.875 + _ULP, 1.9375, 1.9375 - _ULP,
    1.9375 + _ULP, 1.75, 1.75 + _ULP, 1.75 - _ULP, 1.5,
]
# Exponents around 1, at the bottom of the range (scale byte 0, fp32 subnormals) and near the top.
_block_exponent = st.one_of(st.integers(-24, 24), st.integers(-149, -110), st.integers(100, 126))


@st.composite
def structured_block(draw, block_size: int) -> list[float]:
    """One block whose amax is a mode boundary: the other elements are the amax times
    fractions in [-1, 1], so they span many octaves below it (or underflow)."""
    amax = draw(st.sampled_from(BOUNDARY_MANTISSAS)) * 2.0 ** draw(_block_exponent)
    amax = math.copysign(amax, draw(st.sampled_from([1.0, -1.0])))
    fractions = draw(
        st.lists(st.floats(-1.0, 1.0, width=32), min_size=block_size - 1, max_size=block_size - 1)
    )
    block = [amax * f for f in fractions]
    block.insert(draw(st.integers(0, block_size - 1)), amax)
    return block


@st.composite
def mx_case(
    draw,
    max_rows: int = 3,
    max_blocks: int = 3,
    finite_below: float | None = None,
    elem: str | None = None,
    scale_mode: str | None = None,
):
    """(x, elem, scale_mode, block_size) with x of shape (rows, blocks * block_size); elem and scale_mode
    are drawn unless given."""
    dtype = draw(st.sampled_from(INPUT_DTYPES))
    elem = elem or draw(st.sampled_from(["e4m3", "e5m2"]))
    scale_mode = scale_mode or draw(st.sampled_from(ref.SCALE_MODES))
    block_size = draw(st.sampled_from([8, 16, 32]))
    rows = draw(st.integers(1, max_rows))
    cols = block_size * draw(st.integers(1, max_blocks))
    if draw(st.booleans()):
        values = [v for _ in range(rows * cols // block_size) for v in draw(structured_block(block_size))]
    else:
        values = draw(st.lists(element, min_size=rows * cols, max_size=rows * cols))
    if finite_below is not None:
        values = [v if abs(v) < finite_below else math.copysign(finite_below / 2, v) for v in values]
    x = torch.tensor(values, dtype=torch.float64).reshape(rows, cols).to(dtype)
    assert torch.isfinite(x).all()
    return x, elem, scale_mode, block_size


def _assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equal fp32 tensors, except that any NaN matches any NaN (NaN payloads depend
    on the order of operands in the generated code)."""
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    keep = ~torch.isnan(a)
    assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def _bytes(mx) -> tuple[list, list]:
    return mx.scale.view(torch.uint8).tolist(), mx.data.view(torch.uint8).tolist()


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_mode", ref.SCALE_MODES)
def test_matches_reference(elem: str, scale_mode: str) -> None:
    """Differential test against the pure-Python model, bit for bit (more examples than the
    other properties: one run per element format and scale mode)."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mx_case(elem=elem, scale_mode=scale_mode))
    def check(case) -> None:
        _check_matches_reference(*case)

    check()


def _check_matches_reference(x: torch.Tensor, elem: str, scale_mode: str, block_size: int) -> None:
    mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    want = ref.quantize_rows(x.tolist(), ref.FP8_SPECS[elem], scale_mode, block_size)
    assert _bytes(mx) == want


@pytest.mark.parametrize("axis", [0, 1])
def test_fake_quantize_along_matches_reference(axis: int) -> None:
    """The fp32-arithmetic fake quantize (what MX attention's CPU path multiplies) gives the
    reference's decoded values bit for bit, along either axis; NaN blocks only where the
    reference's scale is NaN (none here: inputs are finite)."""

    @SETTINGS
    @given(mx_case())
    def check(case) -> None:
        x, elem, scale_mode, block_size = case
        x = x.mT.contiguous() if axis == 0 else x  # blocks run down the columns
        got = fake_quantize_along(x, axis, elem_format(elem), scale_mode_named(scale_mode), block_size)
        rows = (x.mT if axis == 0 else x).tolist()
        scales, data = ref.quantize_rows(rows, ref.FP8_SPECS[elem], scale_mode, block_size)
        want = []
        for row_scales, row_data in zip(scales, data):
            row = []
            for i, byte in enumerate(row_scales):
                row += ref.dequantize_block(byte, row_data[i * block_size : (i + 1) * block_size], ref.FP8_SPECS[elem])
            want.append(row)
        want = torch.tensor(want, dtype=torch.float64).float()
        _assert_same_values(got, want.mT if axis == 0 else want)

    check()


@SETTINGS
@given(mx_case())
def test_scales_are_powers_of_two_bracketing_amax(case) -> None:
    """Each scale is a power of two 2**(b-127), and amax / scale lands in the window that
    defines the mode (unless the byte is clamped at 0)."""
    x, elem, scale_mode, block_size = case
    fmt = ref.FP8_SPECS[elem]
    mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    scale_bytes = mx.scale.view(torch.uint8).flatten().tolist()
    scale_values = mx.scale.to(torch.float32).flatten().tolist()
    amaxes = x.float().abs().reshape(-1, block_size).amax(dim=1).tolist()
    top = 2.0**fmt.emax
    for byte, value, amax in zip(scale_bytes, scale_values, amaxes):
        assert byte != 0xFF
        assert value == 2.0 ** (byte - 127)
        assert math.frexp(value)[0] == 0.5
        if byte == 0 or amax == 0.0:
            continue
        ratio = amax / value  # exact: division by a power of two
        if scale_mode == "floor":
            assert top <= ratio < 2 * top
        elif scale_mode == "ceil":
            assert top / 2 < ratio <= top
        elif scale_mode == "rceil":
            # The descale is rounded to fp32 before rounding up: allow one fp32 ulp of it
            # (relative 2**-22 where the descale is subnormal, 2**-23 above).
            assert fmt.max_normal / 2 * (1 - 2.0**-22) < ratio <= fmt.max_normal * (1 + 2.0**-22)
        else:
            # even: amax rounded half-up to the mantissa width lands in [2**emax, 2**(emax+1)):
            # from the binade below, ratios from 2**emax minus half that binade's quantum round
            # up to 2**emax; ratios from 2**(emax+1) minus half this binade's quantum round up
            # out of it.
            low = top - 2.0 ** (fmt.emax - 1 - fmt.mantissa_bits - 1)
            high = 2 * top - 2.0 ** (fmt.emax - fmt.mantissa_bits - 1)
            assert low <= ratio < high


@SETTINGS
@given(mx_case())
def test_error_bound(case) -> None:
    """|x - q| <= half an element ulp at x's magnitude, in units of the block scale; values
    beyond the element's max occur in floor and even mode (and in rceil within one fp32 ulp of
    the descale) and saturate to +-max."""
    x, elem, scale_mode, block_size = case
    fmt = ref.FP8_SPECS[elem]
    mx = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    scale_bytes = mx.scale.view(torch.uint8).repeat_interleave(block_size, dim=-1).flatten()
    data_bytes = mx.data.view(torch.uint8).flatten().tolist()
    deq = dequantize_mx(mx, torch.float32).flatten().tolist()
    for value, byte, d, got in zip(x.flatten().tolist(), scale_bytes.tolist(), data_bytes, deq):
        scale = 2.0 ** (byte - 127)
        q = ref.fp8_decode(d, fmt) * scale  # exact in binary64
        assert got == ref.round_fp32(q)  # dequantize_mx is exact (overflow to inf aside)
        assert math.copysign(1.0, q) == math.copysign(1.0, value)  # signs kept, zeros too
        m = abs(value) / scale
        if m > fmt.max_normal:
            # rceil rounds the fp32 product amax * fp32(1/max) before rounding it up, so a
            # product that rounds down onto a power of two saturates by under one fp32 ulp of
            # the descale (relative 2**-22 at worst, where the descale is subnormal); e.g. e5m2,
            # amax 3.370377632266403e-34: exact descale 2**-127 * (1 + 1.1e-7) rounds to 2**-127.
            rceil_edge = scale_mode == "rceil" and m <= fmt.max_normal * (1 + 2.0**-22)
            assert scale_mode in ("floor", "even") or rceil_edge, f"{scale_mode} saturated {value}"
            assert m < 2.0 ** (fmt.emax + 1)
            assert abs(q) == fmt.max_normal * scale
            continue
        if m == 0.0:
            assert q == 0.0
            continue
        ulp = 2.0 ** (max(ref.floor_log2(m), fmt.emin) - fmt.mantissa_bits)
        assert abs(abs(value) - abs(q)) <= ulp / 2 * scale


@SETTINGS
@given(mx_case(finite_below=2.0**127))
def test_requantizing_dequantized_values(case) -> None:
    """Dequantized values always re-quantize to the same values. The bytes are the same in
    floor and even mode only: in rceil and ceil mode a block whose amax rounds *down* onto
    half the element max (rceil: 224 for e4m3) or onto a power of two (ceil) gets a scale one
    smaller on the second pass, with every element doubled (see the explicit examples below).
    Inputs stay below 2**127 so that no dequantized value overflows fp32."""
    x, elem, scale_mode, block_size = case
    first = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    deq = dequantize_mx(first, torch.float32)
    second = quantize_mx(deq, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    _assert_same_values(dequantize_mx(second, torch.float32), deq)
    if scale_mode in ("floor", "even"):
        assert _bytes(second) == _bytes(first)


@pytest.mark.parametrize(
    "scale_mode,elem,value,first,second",
    [
        # 229 -> scale 1, element 224 (RNE); 224 * fp32(1/448) rounds to 0.5 exactly, so the
        # second pass takes scale 1/2 and element 448.
        ("rceil", "e4m3", 229.0, (127, 0x76), (126, 0x7E)),
        # 30000 -> scale 1, element 28672 = 57344 / 2; the second pass halves the scale.
        ("rceil", "e5m2", 30000.0, (127, 0x77), (126, 0x7B)),
        # 257 -> ceil(log2) = 9, scale 2, element 128 (so 256); log2(256) = 8 on the second pass.
        ("ceil", "e4m3", 257.0, (128, 0x70), (127, 0x78)),
    ],
)
def test_requantizing_changes_bytes_in_rceil_and_ceil(
    scale_mode: str, elem: str, value: float, first: tuple[int, int], second: tuple[int, int]
) -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = value
    mx1 = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode)
    mx2 = quantize_mx(dequantize_mx(mx1), -1, elem=elem, scale_mode=scale_mode)
    assert (mx1.scale.view(torch.uint8).item(), mx1.data.view(torch.uint8)[0, 0].item()) == first
    assert (mx2.scale.view(torch.uint8).item(), mx2.data.view(torch.uint8)[0, 0].item()) == second
    assert torch.equal(dequantize_mx(mx1), dequantize_mx(mx2))


@SETTINGS
@given(mx_case())
def test_sign_symmetry(case) -> None:
    """quantize(-x): same scales, every data byte with its sign bit flipped (zeros included)."""
    x, elem, scale_mode, block_size = case
    pos = quantize_mx(x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    neg = quantize_mx(-x, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    assert torch.equal(neg.scale.view(torch.uint8), pos.scale.view(torch.uint8))
    assert torch.equal(neg.data.view(torch.uint8), pos.data.view(torch.uint8) ^ 0x80)


@st.composite
def mx_case_3d(draw):
    x2d, elem, scale_mode, block_size = draw(mx_case(max_rows=2, max_blocks=2))
    axis = draw(st.sampled_from([0, 1, 2, -1, -2, -3]))
    other = draw(st.integers(1, 3))
    # Shape (3d): put the blocked extent on `axis`, the others small.
    flat = x2d.flatten()
    n_block_axis = x2d.shape[1]
    sizes = [other, x2d.shape[0]]
    sizes.insert(axis % 3, n_block_axis)
    numel = math.prod(sizes)
    values = flat.repeat(math.ceil(numel / flat.numel()))[:numel]
    # Vary magnitudes along every axis so that a wrong blocking axis changes the result.
    scale = torch.logspace(-6, 6, numel, base=2.0).to(x2d.dtype)
    return (values * scale).reshape(sizes), axis, elem, scale_mode, block_size


@SETTINGS
@given(mx_case_3d())
def test_any_axis_equals_moving_the_axis_last(case) -> None:
    x, axis, elem, scale_mode, block_size = case
    mx = quantize_mx(x, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    moved = x.movedim(axis, -1).contiguous()
    want = quantize_mx(moved, -1, elem=elem, scale_mode=scale_mode, block_size=block_size)
    assert mx.axis == axis % x.ndim
    assert mx.data.shape == x.shape
    assert torch.equal(mx.data.view(torch.uint8), want.data.view(torch.uint8).movedim(-1, axis))
    assert torch.equal(mx.scale.view(torch.uint8), want.scale.view(torch.uint8).movedim(-1, axis))
    _assert_same_values(dequantize_mx(mx), dequantize_mx(want).movedim(-1, axis))


@SETTINGS
@given(mx_case(), st.sampled_from([0, 1]))
def test_input_never_modified(case, axis: int) -> None:
    x, elem, scale_mode, block_size = case
    if axis == 0:
        x = x.t().contiguous()  # the blocked extent on axis 0
    bits_dtype = torch.int32 if x.dtype == torch.float32 else torch.int16
    before = x.view(bits_dtype).clone()
    quantize_mx(x, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    assert torch.equal(x.view(bits_dtype), before)


@SETTINGS
@given(mx_case(), st.sampled_from(["transposed", "strided", "offset"]))
def test_non_contiguous_input(case, layout: str) -> None:
    x, elem, scale_mode, block_size = case
    if layout == "transposed":
        view, axis = x.t().contiguous().t(), -1  # same values, column-major storage
    elif layout == "strided":
        big = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
        big[:, ::2] = x
        view, axis = big[:, ::2], -1
    else:
        big = torch.zeros(x.shape[0] + 1, x.shape[1] + 3, dtype=x.dtype)
        big[1:, 3:] = x
        view, axis = big[1:, 3:], -1
    assert torch.equal(view, x)
    if x.shape[0] > 1:  # a single row is contiguous in any of these layouts
        assert not view.is_contiguous()
    got = quantize_mx(view, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    want = quantize_mx(x.contiguous(), axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    assert _bytes(got) == _bytes(want)
    # Along axis 0 of the transposed storage as well.
    got0 = quantize_mx(view.t(), 0, elem=elem, scale_mode=scale_mode, block_size=block_size)
    assert torch.equal(got0.data.view(torch.uint8), want.data.view(torch.uint8).t())
