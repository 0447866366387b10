"""The torch.library ops: fake implementations, and the Inductor forms of quantize and the GEMM
operand path, which must give the numerics core's bits."""

from __future__ import annotations

import pytest
import torch

from mxcompile.ops.quantize import (
    DEQUANTIZE,
    FAKE_QUANTIZE,
    QUANTIZE,
    dequantize_for_inductor,
    fake_quantize_with_casts,
    quantize_for_inductor,
)
from mxcompile.numerics import ELEM_FORMATS, ScaleMode, dequantize_along, quantize_along
from mx_testing import same_floats
from mx_testing import special_quantize_data as _special_data

# opcheck's schema test compares inputs bitwise with an op that fp8 tensors lack in torch 2.13
# ("mul_cpu_reduced_float not implemented for Float8_e4m3fn"): skipped for fp8 inputs only.
FP8_INPUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
def test_cpu_kernels_are_bit_identical_to_the_numerics_core(elem, monkeypatch, without_native_kernels):
    """The quantize ops' compiled-graph CPU kernels (`ops.cpu_kernels`: their Inductor forms
    compiled with dynamic sizes, where the native kernels are not built) against the numerics core on the edge cases of quantization: every scale
    mode along the last axis (ROWS) in fp32; a bf16 input along the first axis (COLUMNS) once,
    since the layout and the dtype change only the loads (12 compiles per format, to keep CI
    within its time budget)."""
    import mxcompile.ops.cpu_kernels as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "COMPILED_MIN_NUMEL", 0)  # compiled at any size
    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", 0)
    fmt = ELEM_FORMATS[elem]
    x = _special_data()
    cases = [(x, 1, mode) for mode in ScaleMode]
    cases.append((x.bfloat16(), 0, ScaleMode.RCEIL))
    for operand, axis, scale_mode in cases:
        case = (operand.dtype, axis, scale_mode)
        want_data, want_scale = quantize_along(operand, axis, fmt, scale_mode, 32)
        want = dequantize_along(want_data, want_scale, axis, 32, torch.float32)
        data, scale = QUANTIZE(operand, axis, elem, scale_mode.value, 32)
        assert _same_bits(scale, want_scale), case
        assert _same_bits(data, want_data), case
        assert same_floats(FAKE_QUANTIZE(operand, axis, elem, scale_mode.value, 32, torch.float32), want), case
        assert same_floats(DEQUANTIZE(data, scale, axis, 32, torch.float32), want), case
    # A transposed-contiguous operand (a linear layer's weight as its GEMM sees it) is taken in
    # its memory order (the ROWS graph above), its outputs in the layouts the fakes give.
    weight_t = x.t().contiguous().t()
    want_data, want_scale = quantize_along(weight_t, 0, fmt, ScaleMode.RCEIL, 32)
    data, scale = QUANTIZE(weight_t, 0, elem, "rceil", 32)
    assert data.stride() == weight_t.stride() and scale.is_contiguous()
    assert _same_bits(data, want_data) and _same_bits(scale, want_scale)
    fake = FAKE_QUANTIZE(weight_t, 0, elem, "rceil", 32, torch.float32)
    assert fake.stride() == weight_t.stride()
    assert same_floats(fake, dequantize_along(want_data, want_scale, 0, 32, torch.float32))


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
def test_cuda_fake_quantize_form_is_the_numerics_core_in_memory_order(elem):
    """`fake_quantize_with_casts` (the CUDA lowering's operand form; compiled on a GPU in
    tests/backend/test_cuda_compile.py) eagerly: dequantize(quantize(x)) bit for bit, for a
    plain input and for a transposed-contiguous one, which it rounds in its memory order."""
    x = _special_data()
    for scale_mode in ScaleMode:
        for source in (x, x.t().contiguous().t()):
            for axis in (0, 1):
                got = fake_quantize_with_casts(source, axis, elem, scale_mode.value, 32, torch.bfloat16)
                data, scale = quantize_along(x, axis, ELEM_FORMATS[elem], scale_mode, 32)
                want = dequantize_along(data, scale, axis, 32, torch.bfloat16)
                assert got.stride() == source.stride()
                assert _same_bits(got, want), (scale_mode, axis, source.stride())


def _dequantize_three_ways(row_data, row_scale, col_data, col_scale, transposed, transposed_scale):
    """Inductor's dequantize of blocks along the last axis, along the first axis, and of a
    transposed-contiguous input (the saved transposed weight): one compile per element format."""
    return (dequantize_for_inductor(row_data, row_scale, 1, 32, torch.bfloat16),
            dequantize_for_inductor(col_data, col_scale, 0, 32, torch.float32),
            dequantize_for_inductor(transposed, transposed_scale, 0, 32, torch.float32))


@pytest.mark.parametrize("elem", sorted(ELEM_FORMATS))
def test_inductor_dequantize_is_bit_identical_to_the_numerics_core(elem):
    """Compiled `dequantize_for_inductor` (block scales stored once per block) gives
    `dequantize_along`'s values bit for bit (NaN for NaN) on the edge-case data (NaN blocks,
    subnormals, the E8M0 extremes), blocks along either axis."""
    x, fmt = _special_data(), ELEM_FORMATS[elem]
    row = quantize_along(x, 1, fmt, ScaleMode.RCEIL, 32)
    col = quantize_along(x, 0, fmt, ScaleMode.FLOOR, 32)
    # A transposed-contiguous operand quantized along its first axis, as the backward saves Wt.
    wt = quantize_along(x.t().contiguous(), 1, fmt, ScaleMode.RCEIL, 32)
    transposed, transposed_scale = wt[0].t(), wt[1].t()
    got = torch.compile(_dequantize_three_ways, dynamic=False)(*row, *col, transposed, transposed_scale)
    want = (dequantize_along(*row, 1, 32, torch.bfloat16), dequantize_along(*col, 0, 32, torch.float32),
            dequantize_along(transposed, transposed_scale, 0, 32, torch.float32))
    for name, g, w in zip(("last axis", "first axis", "transposed"), got, want):
        assert same_floats(g, w), name


# Ops that Inductor's CPU code runs element by element (a scalar loop over a vector's lanes):
# int/float bitcasts and isnan.
SCALAR_LOOP_OPS = ("to_dtype_bitcast", "isnan")


def test_inductor_forms_run_scalar_loop_ops_once_per_block(monkeypatch):
    """Speed without timing: in the compiled quantize and dequantize along either axis, the ops
    Inductor cannot vectorize (SCALAR_LOOP_OPS) appear only in loops over blocks, never in the
    element loops (a per-element scale bitcast made dequantize 3.2x slower, a per-element isnan
    halved the first-axis quantize). Reads each loop body Inductor traces and its trip count."""
    import math

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import loop_body

    bodies: list[tuple[int, dict]] = []
    traced = loop_body.LoopBody.__call__

    def recording(self, *args, **kwargs):
        bodies.append((math.prod(int(size) for size in self.var_ranges.values()), dict(self.op_counts)))
        return traced(self, *args, **kwargs)

    monkeypatch.setattr(loop_body.LoopBody, "__call__", recording)

    def both_axes(x, col_data, col_scale, row_data, row_scale):
        return (quantize_for_inductor(x, 0, "e4m3", "rceil", 32), quantize_for_inductor(x, 1, "e4m3", "rceil", 32),
                dequantize_for_inductor(col_data, col_scale, 0, 32, torch.bfloat16),
                dequantize_for_inductor(row_data, row_scale, 1, 32, torch.bfloat16))

    x = torch.randn(256, 256, dtype=torch.bfloat16)
    fmt = ELEM_FORMATS["e4m3"]
    col, row = quantize_along(x, 0, fmt, ScaleMode.RCEIL, 32), quantize_along(x, 1, fmt, ScaleMode.RCEIL, 32)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        torch.compile(both_axes, dynamic=False)(x, *col, *row)
    blocks = x.numel() // 32
    scalar = [(points, ops) for points, ops in bodies if any(op in ops for op in SCALAR_LOOP_OPS)]
    assert scalar, "no loop body bitcasts scale bytes: the test measured nothing"
    assert all(points <= blocks for points, _ in scalar), scalar


def test_ops_fake_implementations_match_the_real_ones():
    x = torch.randn(64, 96)
    for args in ((x, 0, "e4m3", "rceil", 32), (x, 1, "e5m2", "floor", 32), (x.t(), 0, "e4m3", "even", 32)):
        torch.library.opcheck(torch.ops.mxcompile.quantize, args)
    for args in ((x, 0, "e4m3", "rceil", 32, torch.bfloat16), (x.t(), 0, "e5m2", "floor", 32, torch.float32)):
        torch.library.opcheck(torch.ops.mxcompile.fake_quantize, args)
    data, scale = torch.ops.mxcompile.quantize(x, 0, "e4m3", "rceil", 32)
    torch.library.opcheck(torch.ops.mxcompile.dequantize, (data, scale, 0, 32, torch.bfloat16),
                          test_utils=FP8_INPUT_CHECKS)
    a, a_scale = torch.ops.mxcompile.quantize(torch.randn(16, 64), 1, "e4m3", "rceil", 32)
    torch.library.opcheck(torch.ops.mxcompile.mx_mm, (a, a_scale, data, scale, 32, torch.float32),
                          test_utils=FP8_INPUT_CHECKS)


def test_mx_ops_trace_with_fullgraph():
    def step(x, w):
        xd, xs = torch.ops.mxcompile.quantize(x, 1, "e4m3", "rceil", 32)
        wd, ws = torch.ops.mxcompile.quantize(w, 0, "e4m3", "rceil", 32)
        return torch.ops.mxcompile.mx_mm(xd, xs, wd, ws, 32, torch.float32)

    x, w = torch.randn(32, 64), torch.randn(64, 32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), step(x, w), rtol=0, atol=0)


# Nodes in the largest loop body Inductor traces for one fake-quantized GEMM operand: 96 with
# the per-block scales stored once per block; 3548 when Inductor re-expanded the scale
# computation at every use (its code generation time grew with it: a 2-layer MLP's first
# step 131 s cold, 28 s after). The bound sits between the two.
MAX_LOOP_BODY_NODES = 500


def test_inductor_quantize_loop_bodies_stay_small(monkeypatch):
    """Compile time: the scale computation is not re-expanded at every use. Counts the nodes
    of each loop body Inductor's C++ code generation runs (torch._inductor.loop_body.LoopBody)
    for the fake-quantize op's CPU kernel."""
    from torch._inductor import loop_body

    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.numerics import E4M3
    from mxcompile.ops.cpu_kernels import BlockLayout, compiled_rounding

    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", 0)  # this small operand compiles its graph
    sizes: list[int] = []
    traced = loop_body.LoopBody.__call__

    def counting(self, *args, **kwargs):
        blocks = [self.root_block, *self.subblocks.values()]
        sizes.append(sum(len(block.graph.nodes) for block in blocks))
        return traced(self, *args, **kwargs)

    monkeypatch.setattr(loop_body.LoopBody, "__call__", counting)

    # A key no other test uses (functools.cache: a function loaded earlier would not compile).
    rounded = compiled_rounding(E4M3, ScaleMode.CEIL, 32, BlockLayout.ROWS, torch.bfloat16)
    # Cached compiled code would skip code generation (and the count): compile afresh.
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        rounded(torch.randn(64, 64))
    assert sizes, "Inductor traced no loop body: the test measured nothing"
    assert max(sizes) <= MAX_LOOP_BODY_NODES, sizes


def test_cpu_kernels_run_eagerly_while_fx_traces():
    """make_fx of real tensors runs the ops' CPU kernels inside FX tracing, where Dynamo refuses
    to compile ("FX to symbolically trace a dynamo-optimized function"): the kernels take the
    reference there. The operand is large enough for a compiled graph, and its block grid has a
    dim of size 1 (one block along axis 0), so a compiled kernel would go through torch.compile."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mxcompile.ops.cpu_kernels import COMPILED_MIN_NUMEL

    x = torch.randn(32, 4096)
    assert x.numel() >= COMPILED_MIN_NUMEL
    traced = make_fx(lambda t: QUANTIZE(t, 0, "e4m3", "rceil", 32))(x)
    assert QUANTIZE in {n.target for n in traced.graph.nodes}
    want_data, want_scale = quantize_along(x, 0, ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32)
    data, scale = traced(x)
    assert _same_bits(data, want_data) and _same_bits(scale, want_scale)


@pytest.mark.parametrize("size", [64, 4096], ids=["reference", "compiled"])
def test_cpu_kernels_name_a_length_that_is_not_a_multiple_of_the_block_size(size):
    """Called directly (torch.ops.mxcompile.*), the ops' CPU kernels say which axis to pad, on
    operands small enough for the reference and large enough for a compiled graph alike."""
    from mxcompile.ops.cpu_kernels import COMPILED_MIN_NUMEL

    x = torch.randn(size, 48)
    assert (x.numel() >= COMPILED_MIN_NUMEL) == (size == 4096)
    with pytest.raises(ValueError, match=r"x.shape\[1\]=48 .* not divisible by block_size=32; pad that axis"):
        QUANTIZE(x, -1, "e4m3", "rceil", 32)
    with pytest.raises(ValueError, match=r"x.shape\[1\]=48 .* not divisible by block_size=32; pad that axis"):
        FAKE_QUANTIZE(x, -1, "e4m3", "rceil", 32, torch.float32)


def test_medium_operands_run_a_graph_at_hand_and_never_compile_one(monkeypatch, tmp_path, without_native_kernels):
    """Without the native kernels, an operand between COMPILED_MIN_NUMEL and COMPILE_MIN_NUMEL elements runs the reference
    while no graph for it is at hand (no compile: the demo's first step 29.7 -> 10.5 s), and the
    graph once a larger operand has compiled it; the same bits either way."""
    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.ops.precompiled import Precompiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing saved by other runs
    runs, compiles = [], []  # the compiled graphs' calls (operand sizes), and their compiles
    call, load_or_compile = Precompiled.__call__, Precompiled._load_or_compile
    monkeypatch.setattr(Precompiled, "__call__", lambda self, *xs: runs.append(xs[0].numel()) or call(self, *xs))
    monkeypatch.setattr(Precompiled, "_load_or_compile",
                        lambda self, xs: compiles.append(xs[0].numel()) or load_or_compile(self, xs))
    medium = torch.randn(cpu_kernels.COMPILED_MIN_NUMEL // 128, 256)
    large = torch.randn(cpu_kernels.COMPILE_MIN_NUMEL // 256, 256)
    assert cpu_kernels.COMPILED_MIN_NUMEL <= medium.numel() < cpu_kernels.COMPILE_MIN_NUMEL <= large.numel()
    fmt = ELEM_FORMATS["e5m2"]  # a key (format, rule, block 64) no other test compiles

    def check(x):
        want = dequantize_along(*quantize_along(x, 1, fmt, ScaleMode.CEIL, 64), 1, 64, torch.float32)
        assert same_floats(FAKE_QUANTIZE(x, 1, "e5m2", "ceil", 64, torch.float32), want)

    check(medium)
    assert runs == []
    check(large)
    assert runs == [large.numel()]
    check(medium)
    assert runs == [large.numel(), medium.numel()]
    # A block grid with a dim of 1 would go through a plain torch.compile (a compile of its
    # own): a medium operand of that shape takes the reference even with the graph at hand.
    check(medium.reshape(1, -1))
    assert runs == [large.numel(), medium.numel()]
    assert compiles == [large.numel()]
