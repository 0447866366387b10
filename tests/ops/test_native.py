"""The native CPU kernels of the quantize ops (`mxcompile.ops.native`) against the numerics core,
bit for bit: both block layouts, every input and output dtype, both element formats, every
scale mode, widths that are not whole vectors, and the special values (NaN, Inf, signed zeros,
subnormals, values past the element range) mixed into blocks."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mx_testing import bits, same_floats, special_quantize_data
from mxcompile.numerics import ELEM_FORMATS, ScaleMode, dequantize_along, fake_quantize_along, quantize_along
from mxcompile.ops import native
from mxcompile.ops.native import build

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -3e-39, 448.0, -500.0, 3e38, 65504.0)


def _operand(seed: int, shape: tuple[int, ...], dtype: torch.dtype, specials: int, narrow: bool = False) -> torch.Tensor:
    """Normal values whose magnitudes span the dtype's range element by element (or, `narrow`,
    a few binades around one random exponent, as activations and weights do), with `specials`
    special values at random places."""
    g = torch.Generator().manual_seed(seed)
    lowest = {torch.float16: -24, torch.bfloat16: -133, torch.float32: -149}[dtype]
    highest = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127}[dtype]
    if narrow:
        center = int(torch.randint(lowest + 4, highest - 4, (), generator=g))
        lowest, highest = center - 4, center + 4
    exponents = torch.randint(lowest, highest, shape, generator=g).float()
    x = torch.randn(shape, generator=g) * torch.exp2(exponents.clamp(max=highest - 1))
    flat = x.view(-1)
    places = torch.randint(0, flat.numel(), (specials,), generator=g)
    picks = torch.randint(0, len(SPECIALS), (specials,), generator=g)
    for place, pick in zip(places.tolist(), picks.tolist()):
        flat[place] = SPECIALS[pick]
    return x.to(dtype)


def _check(x: torch.Tensor, axis: int, elem: str, mode: ScaleMode, block_size: int) -> None:
    fmt = ELEM_FORMATS[elem]
    want_data, want_scales = quantize_along(x, axis, fmt, mode, block_size)
    data, scales = native.quantize(x, axis, fmt, mode, block_size)
    assert torch.equal(scales, want_scales), "scales"
    assert torch.equal(bits(data), bits(want_data)), "data"
    rounded = fake_quantize_along(x, axis, fmt, mode, block_size)
    for dtype in INPUT_DTYPES:
        fake = native.fake_quantize(x, axis, fmt, mode, block_size, dtype)
        assert same_floats(fake, rounded.to(dtype)), f"fake quantize as {dtype}"
        values = native.dequantize(data, scales, axis, block_size, dtype)
        assert same_floats(values, dequantize_along(want_data, want_scales, axis, block_size, dtype)), \
            f"dequantize as {dtype}"


def test_the_kernels_build_on_this_machine():
    """CI's machine has the C++ compiler that Inductor needs; the kernels must build with it."""
    assert native.available()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 20),  # the kernel takes blocks 16 at a time across rows
    block_size=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from(INPUT_DTYPES),
    elem=st.sampled_from(sorted(ELEM_FORMATS)),
    mode=st.sampled_from(list(ScaleMode)),
    specials=st.integers(0, 6),
    narrow=st.booleans(),
)
def test_rows_layout_equals_the_numerics_core(seed, rows, blocks, block_size, dtype, elem, mode, specials, narrow):
    x = _operand(seed, (rows, blocks * block_size), dtype, specials, narrow)
    _check(x, 1, elem, mode, block_size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    blocks=st.integers(1, 3),
    width=st.integers(1, 40),
    block_size=st.sampled_from([8, 32]),
    dtype=st.sampled_from(INPUT_DTYPES),
    elem=st.sampled_from(sorted(ELEM_FORMATS)),
    mode=st.sampled_from(list(ScaleMode)),
    specials=st.integers(0, 6),
    narrow=st.booleans(),
)
def test_columns_layout_equals_the_numerics_core(seed, batch, blocks, width, block_size, dtype, elem, mode, specials,
                                                 narrow):
    x = _operand(seed, (batch, blocks * block_size, width), dtype, specials, narrow)
    _check(x, 1, elem, mode, block_size)


@pytest.mark.parametrize(("shape", "axis"), [((2, 3, 64), 2), ((2, 64, 3, 5), 1), ((64, 2, 3), 0),
                                           ((3, 2, 32, 1), 2), ((96,), 0)])
def test_operands_of_any_shape_run_in_the_layout_of_their_axis(shape, axis):
    """The kernels take the layout from the shape (no view of the operand): the last axis, or
    an axis with only size-1 axes after it, as rows; any other as (batch, length, width)."""
    x = _operand(3, shape, torch.bfloat16, 4)
    _check(x, axis, "e4m3", ScaleMode.RCEIL, 32)
    data, scales = native.quantize(x, axis - len(shape), ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32)
    want_data, want_scales = native.quantize(x, axis, ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32)
    assert torch.equal(bits(data), bits(want_data)) and torch.equal(scales, want_scales), "negative axis"


def test_last_axis_blocks_of_other_sizes_run_as_columns_of_width_one():
    """The row kernel takes blocks of whole 16-lane vectors; blocks of 8 or 24 along the last
    axis run in the column kernel, as (rows, length, 1)."""
    for block_size in (8, 24):
        _check(_operand(5, (4, 48), torch.float32, 3), 1, "e5m2", ScaleMode.EVEN, block_size)


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
def test_the_quantization_edge_cases_equal_the_numerics_core(elem):
    """The fixed edge cases the compiled graphs are checked on (a zero block with -0.0, NaN,
    Inf, a block below fp32's normal range, e4m3's saturation boundary, a subnormal midpoint),
    under every scale rule, in both layouts and every input dtype."""
    x = special_quantize_data()
    for dtype in INPUT_DTYPES:
        operand = x.to(dtype)
        for mode in ScaleMode:
            _check(operand, 1, elem, mode, 32)  # rows: blocks along the last axis
            _check(operand.view(1, *operand.shape), 1, elem, mode, 32)  # columns: along the first


def _bit_rounding_operand() -> torch.Tensor:
    """bf16 blocks of 32 for bit rounding (`quantize.cpp`) and its fp32
    fallback: random mantissa patterns (ties of every kind, carries into the next binade) in a
    block of every bf16 binade, subnormals included, so that every scale byte occurs; each binade
    twice, once as it is and once with elements 2**-15 to 2**-40 of its largest (the element
    format's subnormal range: bf16 normals, subnormals and zeros) and a zero and a -0.0."""
    g = torch.Generator().manual_seed(17)
    blocks = []
    for exponent in range(-133, 128):
        mantissas = torch.randint(0, 128, (32,), generator=g, dtype=torch.int32)
        signs = torch.randint(0, 2, (32,), generator=g, dtype=torch.int32) << 15
        if exponent >= -126:
            magnitudes = ((exponent + 127) << 7) | mantissas
        else:  # subnormal: the pattern's leading bit below bf16's smallest normal
            magnitudes = (mantissas | 64) >> (-126 - exponent)
        block = (magnitudes | signs).to(torch.int16).view(torch.bfloat16).float()
        blocks.append(block)
        mixed = block.clone()
        largest = block.abs().max()
        for lane, depth in zip((3, 11, 19, 27), (15, 17, 24, 40)):
            mixed[lane] = largest * 2.0**-depth
        mixed[7], mixed[9] = 0.0, -0.0
        blocks.append(mixed)
    return torch.stack(blocks).to(torch.bfloat16)


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
@pytest.mark.parametrize("mode", list(ScaleMode))
def test_bf16_quantization_by_bit_rounding_equals_the_numerics_core(elem, mode):
    """bf16 -> fp8 quantization and bf16 -> bf16 / fp32 fake quantization round the inputs' own
    bits where a block allows it and run the fp32 arithmetic elsewhere: both equal the numerics
    core (fp8 bytes, scales, values), in rows and columns."""
    x = _bit_rounding_operand()  # (522 blocks, 32)
    _check(x, 1, elem, mode, 32)
    _check(x.t().contiguous(), 0, elem, mode, 32)


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
def test_tiny_blocks_whose_dequantized_elements_are_fp32_subnormals(elem):
    """Blocks with scales near 2**-127: their dequantized elements are fp32 subnormals, whose
    conversion to bf16 rounds (the kernels truncate only under larger scales); fp32 inputs,
    since bf16 and fp16 cannot hold such values, and blocks of growing magnitude, so that
    rows and column strips mix both kinds."""
    g = torch.Generator().manual_seed(11)
    magnitudes = torch.exp2(torch.arange(-149, -85, 4, dtype=torch.float32))  # 16 magnitudes
    x = torch.randn(16, 64, generator=g) * magnitudes[:, None]
    for operand in (x, x.t().contiguous().view(1, 64, 16)):
        _check(operand, 1, elem, ScaleMode.RCEIL, 32)
        _check(operand, 1, elem, ScaleMode.FLOOR, 32)
    # Both sides of the truncation bound: the smallest nonzero element 2**(emin - mantissa_bits)
    # times the scale 2**(b - 127) is an fp32 normal from b = 10 (e4m3: 2**-9) or 17 (e5m2: 2**-16).
    bound = {"e4m3": 10, "e5m2": 17}[elem]
    _, scales = native.quantize(x, 1, ELEM_FORMATS[elem], ScaleMode.RCEIL, 32)
    assert scales.min() < bound < scales.max()


def test_threads_split_the_work_without_changing_a_bit():
    """Operands past the kernels' parallel threshold run on torch's threads: the same bytes on
    one thread."""
    fmt = ELEM_FORMATS["e4m3"]
    x = _operand(7, (256, 512), torch.bfloat16, 20)
    threads = torch.get_num_threads()
    results = []
    for count in (1, max(2, threads)):
        torch.set_num_threads(count)
        try:
            results.append((native.quantize(x, 1, fmt, ScaleMode.RCEIL, 32),
                            native.quantize(x.view(8, 32, 512), 1, fmt, ScaleMode.RCEIL, 32)))
        finally:
            torch.set_num_threads(threads)
    one_thread, threads_ = results
    for (one_data, one_scales), (data, scales) in zip(one_thread, threads_, strict=True):
        assert torch.equal(bits(one_data), bits(data)) and torch.equal(one_scales, scales)


def test_cases_the_kernels_do_not_handle_return_none():
    """Lengths that are not whole blocks, non-contiguous operands, other dtypes and empty
    operands: None, so that the caller runs another kernel."""
    fmt = ELEM_FORMATS["e4m3"]
    x = torch.randn(4, 64)
    assert native.quantize(torch.randn(4, 48), 1, fmt, ScaleMode.RCEIL, 32) is None
    assert native.quantize(torch.randn(48, 4), 0, fmt, ScaleMode.RCEIL, 32) is None
    assert native.quantize(x.t(), 1, fmt, ScaleMode.RCEIL, 32) is None
    assert native.quantize(x.double(), 1, fmt, ScaleMode.RCEIL, 32) is None
    assert native.quantize(torch.empty(0, 64), 1, fmt, ScaleMode.RCEIL, 32) is None
    assert native.quantize(torch.tensor(1.0), 0, fmt, ScaleMode.RCEIL, 32) is None
    assert native.fake_quantize(x, 1, fmt, ScaleMode.RCEIL, 32, torch.float64) is None
    data, scales = native.quantize(x, 1, fmt, ScaleMode.RCEIL, 32)
    assert native.dequantize(data, scales.t().contiguous().t(), 1, 32, torch.float32) is None
    assert native.dequantize(data, scales[:, :1], 1, 32, torch.float32) is None
    assert native.dequantize(data, scales.view(torch.int8), 1, 32, torch.float32) is None
    assert native.dequantize(data, scales, 0, 32, torch.float32) is None  # scales of the other axis


def test_the_ops_cpu_kernels_run_the_native_kernels_at_every_size(monkeypatch):
    """Small operands too (the compiled graphs started at 2**16 elements), in the memory order
    of a transposed weight, with the ops' usual output layouts."""
    calls = []
    quantize, fake_quantize = native.quantize, native.fake_quantize
    monkeypatch.setattr(native, "quantize", lambda x, *a: calls.append("quantize") or quantize(x, *a))
    monkeypatch.setattr(native, "fake_quantize", lambda x, *a: calls.append("fake") or fake_quantize(x, *a))
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    for x, axis in ((weight, 1), (weight, 0), (weight.t(), 1)):
        data, scales = torch.ops.mxcompile.quantize(x, axis, "e4m3", "rceil", 32)
        want_data, want_scales = quantize_along(x, axis, ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32)
        assert data.stride() == x.stride() and scales.is_contiguous()
        assert torch.equal(bits(data), bits(want_data)) and torch.equal(scales, want_scales)
        fake = torch.ops.mxcompile.fake_quantize(x, axis, "e4m3", "rceil", 32, torch.bfloat16)
        assert fake.stride() == x.stride()
        assert torch.equal(fake, fake_quantize_along(x, axis, ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32).bfloat16())
    assert calls == ["quantize", "fake"] * 3


def test_a_failed_build_is_reported_once_and_the_ops_still_run(monkeypatch, tmp_path, caplog):
    """No usable compiler: `library()` returns None with a warning naming the compiler and the
    error, and the ops run their other CPU kernels with the same values."""
    import torch._inductor.cpp_builder as cpp_builder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        outcome = build._build_once.__wrapped__()
    assert outcome.library is None and "no-such-compiler" in outcome.failure
    assert "cannot build the native quantize kernels" in caplog.text and "no-such-compiler" in caplog.text
    monkeypatch.setattr(native, "_kernels", lambda: None)
    x = torch.randn(8, 64)
    fake = torch.ops.mxcompile.fake_quantize(x, 1, "e5m2", "floor", 32, torch.float32)
    assert torch.equal(fake, fake_quantize_along(x, 1, ELEM_FORMATS["e5m2"], ScaleMode.FLOOR, 32))


def test_a_compile_error_is_reported_with_the_compilers_message(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build._build_once.__wrapped__().library is None
    assert "cannot build the native quantize kernels" in caplog.text and "error" in caplog.text
    assert not list((tmp_path / build.CACHE_SUBDIR).glob("*.partial"))


def test_a_background_build_and_a_call_build_once(monkeypatch):
    """The backend starts the build in a thread; the first op's call waits for it and gets the
    same outcome, and nothing starts a second build."""
    import functools
    import threading

    calls = []
    outcome = build.NativeBuild(None, failure="stand-in")
    monkeypatch.setattr(build, "_build_once", functools.cache(lambda: calls.append(threading.current_thread().name) or outcome))
    build.build_in_background()
    assert build.build() is outcome
    build.build_in_background()  # built: no thread
    assert build.build() is outcome
    assert len(calls) == 1
