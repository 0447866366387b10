"""The CPU MX attention ops (mxcompile/ops/attention.py, attention_reference.py) on their own: exactness of the tiling and
online softmax (attention_mode "off" against torch's SDPA), agreement with a materialized reference
written from the spec, accuracy of MXFP8 against fp32, tile-size independence, memory growth,
and the registered fake / autograd implementations. No torch.compile here: these run in
seconds.

Measured on this suite's inputs (i.i.d. N(0, 1) q, k, v; B=2, Hq=4, T=256, d=64), SQNR of MX
attention ("both") against fp32 SDPA, output / dq, dk, dv: non-causal 25.5 / 23.4, 23.5, 25.4 dB;
causal 26.2 / 23.2, 23.3, 26.1; float mask 25.8 / 23.7, 23.8, 25.8; bool mask 25.6 / 23.4, 23.5,
25.4; GQA causal 26.1 / 23.4, 23.5, 26.4. "qk_only": output 28.3 to 30.1 dB, gradients 25.1 to
30.1 dB. Against the materialized spec reference below the tiled ops agree to 79 to 160 dB (fp32
summation order). A reference that quantizes the normalized P gets the same output SQNR within
0.1 dB: ~25.3 dB is the floor of four e4m3-quantized operands on Gaussian data, not a loss of
the tiling.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mx_testing import fake_quantize, sqnr_db
from mxcompile.attention import mx_attention
from mxcompile.ops.attention import sequence_major
from mxcompile.ops.attention_reference import AttentionOptions, attention_backward_impl, attention_forward_impl

B, HQ, T, D = 2, 4, 256, 64
OUT_SQNR_DB, GRAD_SQNR_DB = 25.0, 20.0


def _qkv(seed: int, batch=B, heads=HQ, kv_heads=HQ, q_len=T, k_len=T, width=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, width, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, k_len, width, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, k_len, width, generator=g).to(dtype)
    do = torch.randn(batch, heads, q_len, width, generator=g).to(dtype)
    return q, k, v, do


def _run(fn, q, k, v, do, **kwargs):
    """Output and (dq, dk, dv) of fn(q, k, v, **kwargs) for upstream gradient do."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), grads


def _sdpa(q, k, v, attn_mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "float_mask": dict(attn_mask="float"),
    "bool_mask": dict(attn_mask="bool"),
    "gqa_causal": dict(is_causal=True, kv_heads=2),
}


def _case(name: str, seed: int = 0, **shape):
    spec = dict(CASES[name])
    kv_heads = spec.pop("kv_heads", HQ)
    q, k, v, do = _qkv(seed, kv_heads=kv_heads, **shape)
    mask = spec.pop("attn_mask", None)
    g = torch.Generator().manual_seed(seed + 100)
    if mask == "float":
        spec["attn_mask"] = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2], generator=g)
    elif mask == "bool":
        spec["attn_mask"] = torch.rand(q.shape[2], k.shape[2], generator=g) > 0.3
    return (q, k, v, do), spec


@pytest.mark.parametrize("name", sorted(CASES))
def test_high_precision_mode_equals_torch_sdpa(name):
    """attention_mode="off" runs the same tiles, online softmax and backward recomputation without
    quantization: it must be fp32 attention, so the tiling itself is exact."""
    (q, k, v, do), kwargs = _case(name, q_len=96, k_len=96)
    ref_out, ref_grads = _run(_sdpa, q, k, v, do, **kwargs)
    out, grads = _run(mx_attention, q, k, v, do, attention_mode="off", key_tile=32, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_high_precision_mode_cross_attention_lengths():
    q, k, v, do = _qkv(3, q_len=64, k_len=160)
    ref_out, ref_grads = _run(_sdpa, q, k, v, do, is_causal=True)
    out, grads = _run(mx_attention, q, k, v, do, attention_mode="off", key_tile=64, is_causal=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mxfp8_attention_sqnr_against_fp32(name):
    (q, k, v, do), kwargs = _case(name)
    ref_out, ref_grads = _run(_sdpa, q, k, v, do, **kwargs)
    out, grads = _run(mx_attention, q, k, v, do, **kwargs)
    out_db = sqnr_db(ref_out, out)
    grad_db = [sqnr_db(want, got) for got, want in zip(grads, ref_grads)]
    assert out_db >= OUT_SQNR_DB, (name, out_db)
    assert min(grad_db) >= GRAD_SQNR_DB, (name, grad_db)


def _reference(q, k, v, do, attn_mask=None, is_causal=False, mx_pv=True):
    """MX attention written from the module docstring with whole (T x T) matrices and
    mx_testing's quantizer: the specification the tiled ops must meet."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    pv = fake_quantize if mx_pv else (lambda x, axis: x)
    log2e = math.log2(math.e)
    s = fake_quantize(q, -1) @ fake_quantize(k, -1).transpose(-1, -2) * scale
    if attn_mask is not None:
        s = s + (attn_mask if attn_mask.dtype != torch.bool
                 else torch.zeros(()).masked_fill(~attn_mask, float("-inf")))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    s2 = s * log2e
    exponent = torch.ceil(s2.amax(-1, keepdim=True))
    p_unnormalized = torch.exp2(s2 - exponent)
    row_sum = p_unnormalized.sum(-1, keepdim=True)
    out = pv(p_unnormalized, -1) @ pv(v, -2) / row_sum
    p = p_unnormalized / row_sum
    dv = pv(p, -2).transpose(-1, -2) @ pv(do, -2)
    dp = pv(do, -1) @ pv(v, -1).transpose(-1, -2)
    ds = p * (dp - (do * out).sum(-1, keepdim=True))
    dq = fake_quantize(ds, -1) @ fake_quantize(k, -2) * scale
    dk = fake_quantize(ds, -2).transpose(-1, -2) @ fake_quantize(q, -2) * scale

    def ungroup(x):
        return x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2)

    return out, (dq, ungroup(dk), ungroup(dv))


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_ops_equal_materialized_reference(name):
    (q, k, v, do), kwargs = _case(name, q_len=128, k_len=128)
    ref_out, ref_grads = _reference(q, k, v, do, **kwargs)
    out, grads = _run(mx_attention, q, k, v, do, key_tile=32, **kwargs)
    # Equal up to fp32 summation order (which may flip a rare FP8 rounding).
    assert sqnr_db(ref_out, out) >= 60
    for got, want in zip(grads, ref_grads):
        assert sqnr_db(want, got) >= 60


def test_qk_only_quantizes_only_the_score_path():
    q, k, v, do = _qkv(5, q_len=128, k_len=128)
    ref_out, ref_grads = _reference(q, k, v, do, is_causal=True, mx_pv=False)
    out, grads = _run(mx_attention, q, k, v, do, is_causal=True, attention_mode="qk_only")
    assert sqnr_db(ref_out, out) >= 60
    for got, want in zip(grads, ref_grads):
        assert sqnr_db(want, got) >= 60
    fp32_out, _ = _run(_sdpa, q, k, v, do, is_causal=True)
    both_out, _ = _run(mx_attention, q, k, v, do, is_causal=True)
    assert sqnr_db(fp32_out, out) > sqnr_db(fp32_out, both_out) + 1.0


def test_result_does_not_depend_on_the_key_tile():
    """P is quantized relative to a power-of-two running maximum, and MX quantization commutes
    with power-of-two scaling, so tiles of 32 and one tile of all keys agree to fp32 rounding."""
    q, k, v, do = _qkv(7)
    out_small, grads_small = _run(mx_attention, q, k, v, do, key_tile=32)
    out_one, grads_one = _run(mx_attention, q, k, v, do, key_tile=T)
    assert sqnr_db(out_one, out_small) >= 100
    for a, b in zip(grads_one, grads_small):
        assert sqnr_db(a, b) >= 100


class _LargestAllocation(TorchDispatchMode):
    """Records the largest numel of any tensor an op allocates (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out



class _OnlyDevice(TorchDispatchMode):
    """Records every op that takes or makes a tensor on another device than `device` (0-dim
    CPU tensors included: PyTorch accepts them as arguments beside tensors of any device, but
    an out-of-place op on one, e.g. `torch.zeros(()).masked_fill(mask, x)`, stays on the CPU)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.elsewhere: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
        devices = {t.device for t in leaves if isinstance(t, torch.Tensor)} - {self.device}
        if devices:
            self.elsewhere.append(f"{func}: {sorted(map(str, devices))}")
        return out


@pytest.mark.parametrize("case", ["causal", "bool mask", "float mask gqa"])
def test_impls_create_working_tensors_on_the_inputs_device(case):
    """The torch implementations are what the CUDA kernels fall back to: every tensor they
    create must follow the inputs' device. Run on the `meta` device (no data; a tensor created
    without `device=` shows up on the CPU), with every op's devices checked."""
    kv_heads = 1 if "gqa" in case else 2
    q, k, v, do = (t.to("meta") for t in _qkv(0, batch=1, heads=2, kv_heads=kv_heads, q_len=64, k_len=64, width=32))
    mask = None
    if "mask" in case:
        mask = torch.ones(64, 64, dtype=torch.bool, device="meta")
        if "float" in case:
            mask = torch.zeros(1, 2, 64, 64, device="meta")
    is_causal = case == "causal"
    args = (is_causal, 0.2, "both", "e4m3")
    with _OnlyDevice("meta") as mode:
        options = AttentionOptions(*args, "rceil", 32, 32, grad_elem="e4m3")
        out, lse = attention_forward_impl(q, k, v, mask, options)
        grads = attention_backward_impl(do, q, k, v, mask, out, lse, options)
    assert mode.elsewhere == []
    assert [t.device.type for t in (out, lse, *grads)] == ["meta"] * 5

@pytest.mark.parametrize("is_causal", [False, True])
def test_working_memory_grows_with_sequence_length_not_its_square(is_causal):
    seq, width, tile = 1024, 32, 64
    q, k, v, do = _qkv(0, batch=1, heads=2, kv_heads=2, q_len=seq, k_len=seq, width=width)
    args = (is_causal, 1 / math.sqrt(width), "both", "e4m3")
    options = AttentionOptions(*args, "rceil", 32, tile, grad_elem="e4m3")
    with _LargestAllocation() as forward:
        out, lse = attention_forward_impl(q, k, v, None, options)
    with _LargestAllocation() as backward:
        attention_backward_impl(do, q, k, v, None, out, lse, options)
    per_row = 2 * seq  # batch * heads rows of queries
    assert forward.largest <= per_row * max(tile, width)
    assert backward.largest <= per_row * max(tile, width)
    assert forward.largest * 8 <= per_row * seq  # a (T x T) score matrix would be 16x larger


def test_causal_caveat_a_future_key_in_the_same_block_changes_rounding_only():
    """The documented caveat: V is quantized along the keys in blocks of 32, so a future key in
    query 0's block (key 31) changes query 0's output through V's scale, by a rounding step;
    a key in the next block (key 32) cannot."""
    q, k, v, _ = _qkv(8, q_len=64, k_len=64)
    base = mx_attention(q, k, v, is_causal=True)
    same_block, next_block = v.clone(), v.clone()
    same_block[..., 31, :] *= 64
    next_block[..., 32, :] *= 64
    moved = mx_attention(q, k, same_block, is_causal=True)
    unmoved = mx_attention(q, k, next_block, is_causal=True)
    assert not torch.equal(moved[..., 0, :], base[..., 0, :])
    assert torch.equal(unmoved[..., :32, :], base[..., :32, :])
    # Only rounding moved (a 64x larger block maximum keeps the others in e4m3's normal range).
    assert sqnr_db(base[..., 0, :], moved[..., 0, :]) >= 60
    fp32 = mx_attention(q, k, same_block, is_causal=True, attention_mode="off")
    torch.testing.assert_close(fp32[..., 0, :], mx_attention(q, k, v, is_causal=True, attention_mode="off")[..., 0, :])


def test_rows_without_any_attended_key_give_zero_output_and_finite_gradients():
    q, k, v, do = _qkv(2, q_len=64, k_len=64)
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) > 0.5
    mask[5] = False
    out, grads = _run(mx_attention, q, k, v, do, attn_mask=mask)
    assert torch.all(out[:, :, 5] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, 5] == 0)
    ref_out, _ = _run(_sdpa, q, k, v, do, attn_mask=mask)
    keep = torch.ones(64, dtype=torch.bool)
    keep[5] = False
    assert sqnr_db(ref_out[:, :, keep], out[:, :, keep]) >= OUT_SQNR_DB


def test_bfloat16_inputs_keep_their_dtype():
    q, k, v, do = _qkv(4, q_len=128, k_len=128, dtype=torch.bfloat16)
    out, grads = _run(mx_attention, q, k, v, do, is_causal=True)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    ref_out, ref_grads = _run(_sdpa, *(t.float() for t in (q, k, v, do)), is_causal=True)
    assert sqnr_db(ref_out, out) >= OUT_SQNR_DB - 1  # bf16 output rounding on top of MX
    assert min(sqnr_db(w, g) for g, w in zip(grads, ref_grads)) >= GRAD_SQNR_DB


@pytest.mark.parametrize("sequence_major_inputs", [False, True])
def test_ops_return_the_layouts_of_aten_cpu_flash_attention(sequence_major_inputs):
    """The graph after a replaced aten op was traced against its output strides: output like
    the query, logsumexp and gradients in (B, T, H, ...) memory order."""
    q, k, v, do = _qkv(0, q_len=64, k_len=64)
    if sequence_major_inputs:
        q, k, v, do = (sequence_major(t) for t in (q, k, v, do))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    ref_out, ref_lse = flash(q, k, v)
    ref_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, ref_out, ref_lse, 0.0, False)
    options = (False, 0.125, "off", "e4m3")
    out, lse = torch.ops.mxcompile.attention(q, k, v, None, *options, "rceil", 32, 32)
    grads = torch.ops.mxcompile.attention_backward(do, q, k, v, None, out, lse, *options, "e4m3", "rceil", 32, 32)
    assert out.stride() == ref_out.stride() and lse.stride() == ref_lse.stride()
    assert [g.stride() for g in grads] == [g.stride() for g in ref_grads]
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # natural-log units
    with torch._subclasses.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v, do)]
        fake_out, fake_lse = torch.ops.mxcompile.attention(*fakes[:3], None, *options, "rceil", 32, 32)
        fake_grads = torch.ops.mxcompile.attention_backward(
            fakes[3], *fakes[:3], None, fake_out, fake_lse, *options, "e4m3", "rceil", 32, 32)
    assert fake_out.stride() == out.stride() and fake_lse.stride() == lse.stride()
    assert [g.stride() for g in fake_grads] == [g.stride() for g in grads]


def test_opcheck_fake_and_autograd_registrations():
    q, k, v, do = _qkv(0, batch=1, heads=2, kv_heads=2, q_len=64, k_len=64, width=32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.randn(1, 1, 64, 64)
    forward_args = (q, k, v, mask, False, 0.2, "both", "e4m3", "rceil", 32, 32)
    torch.library.opcheck(torch.ops.mxcompile.attention.default, forward_args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, lse = torch.ops.mxcompile.attention(*forward_args)
    backward_args = (do, q.detach(), k.detach(), v.detach(), mask, out.detach(), lse.detach(),
                     False, 0.2, "both", "e4m3", "e5m2", "rceil", 32, 32)
    torch.library.opcheck(torch.ops.mxcompile.attention_backward.default, backward_args,
                          test_utils=("test_schema", "test_faketensor"))
    # The registered autograd of the raw op agrees with mx_attention (e4m3 gradients).
    direct = torch.autograd.grad(out, (q, k, v), do)
    _, wrapped = _run(mx_attention, q, k, v, do, attn_mask=mask, scale=0.2, key_tile=32)
    for a, b in zip(direct, wrapped):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(width=48), "head_dim 48 is not divisible by block_size=32"),
        (dict(k_len=80), "key length 80 is not divisible by block_size=32"),
        (dict(q_len=40), "query length 40 is not divisible by block_size=32"),
        (dict(kv_heads=3), "4 query heads are not a multiple of 3 key/value heads"),
    ],
)
def test_mx_attention_rejects_ineligible_shapes_naming_the_reason(change, message):
    q, k, v, _ = _qkv(0, **{"q_len": 64, "k_len": 64, **change})
    with pytest.raises(ValueError, match=message):
        mx_attention(q, k, v)


def test_mx_attention_rejects_bad_options():
    q, k, v, _ = _qkv(0, q_len=64, k_len=64)
    with pytest.raises(ValueError, match="attention_mode='fp4'"):
        mx_attention(q, k, v, attention_mode="fp4")
    with pytest.raises(ValueError, match="key_tile=48"):
        mx_attention(q, k, v, key_tile=48)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        mx_attention(q, k, v, attn_mask=torch.zeros(64, 64), is_causal=True)


def _counting_compiled_rounding(monkeypatch) -> list:
    """Replace cpu_kernels.compiled_rounding by a wrapper recording its calls."""
    import mxcompile.ops.cpu_kernels as cpu_kernels

    calls, compiled = [], cpu_kernels.compiled_rounding
    monkeypatch.setattr(cpu_kernels, "compiled_rounding", lambda *key: calls.append(key) or compiled(*key))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rounding_equals_the_eager_rounding_bit_for_bit(monkeypatch, dtype, without_native_kernels):
    """Large CPU operands are rounded by a compiled graph (COMPILED_MIN_NUMEL): the same fp32
    values as numerics.fake_quantize_along, along either axis, on strided inputs."""
    from mxcompile.numerics import E4M3, E5M2, ScaleMode, fake_quantize_along
    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.ops.attention_reference import _mx_rounded
    from mxcompile.ops.cpu_kernels import COMPILED_MIN_NUMEL, BlockLayout

    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", COMPILED_MIN_NUMEL)  # these sizes compile
    calls = _counting_compiled_rounding(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 4, 1, 256, 64, generator=g) * torch.logspace(-30, 30, 64)).to(dtype)
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-40, 448.0, -500.0]).to(dtype)
    assert x.numel() >= COMPILED_MIN_NUMEL
    for operand in (x, x.transpose(-1, -2)):
        for axis in (-1, -2):
            for fmt, elem in ((E4M3, "e4m3"), (E5M2, "e5m2")):
                got = _mx_rounded(operand, axis, elem, "rceil", 32)
                want = fake_quantize_along(operand, axis % operand.ndim, fmt, ScaleMode.RCEIL, 32)
                assert got.shape == want.shape
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (axis, elem)
    assert len(calls) == 8
    # Blocks along the last axis of the memory order: ROWS, along another: COLUMNS (no copy).
    assert {key[-2] for key in calls} == {BlockLayout.ROWS, BlockLayout.COLUMNS}
    assert {key[-1] for key in calls} == {torch.float32}


def test_compiled_rounding_traces_one_graph_per_dtype_whatever_the_dispatch_state(monkeypatch):
    """The ops' kernels run below ADInplaceOrView when called through torch.library and above
    it when the backward is called directly: the compiled rounding must not trace a graph for
    each (Dynamo guards on the input's dispatch keys), which cost every process about 0.4 s of
    tracing per extra graph, warm caches included."""
    from torch._dynamo.utils import counters

    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.numerics import E5M2, ScaleMode
    from mxcompile.ops.cpu_kernels import COMPILED_MIN_NUMEL, BlockLayout, compiled_rounding

    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", COMPILED_MIN_NUMEL)  # these sizes compile
    # A key no other test uses (functools.cache), so that its first call traces here.
    round_rows = compiled_rounding(E5M2, ScaleMode.EVEN, 64, BlockLayout.ROWS, torch.float32)
    rows = torch.randn(COMPILED_MIN_NUMEL // 128, 128)
    first = round_rows(rows)  # traced, or loaded from the precompiled file of an earlier run
    traced = counters["stats"]["unique_graphs"]
    with torch._C._AutoDispatchBelowADInplaceOrView():
        second = round_rows(rows.clone())
    assert counters["stats"]["unique_graphs"] == traced
    assert torch.equal(first, second)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_compiled_rounding_computes_block_scales_once_per_block(monkeypatch, layout):
    """Speed without timing: the compiled rounding computes the block scales in a loop over
    blocks and makes two passes over the elements (the block maximum, the rounding). With the
    scale inlined into the element loop, its scalar chain ran in every element vector and the
    2-D result took extra passes (a copy): 2.4x slower. Reads the loop bodies Inductor traces,
    their point counts evaluated at this call's sizes (both sizes are dynamic)."""
    import sympy
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import loop_body
    from torch._inductor.virtualized import V

    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.numerics import E5M2, ScaleMode
    from mxcompile.ops.cpu_kernels import COMPILED_MIN_NUMEL, BlockLayout, compiled_rounding

    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", COMPILED_MIN_NUMEL)  # these sizes compile
    points: dict[int, int] = {}
    traced = loop_body.LoopBody.__call__

    def recording(self, *args, **kwargs):
        points.setdefault(id(self), V.graph.sizevars.optimization_hint(sympy.Mul(*self.var_ranges.values())))
        return traced(self, *args, **kwargs)

    monkeypatch.setattr(loop_body.LoopBody, "__call__", recording)
    x = torch.randn(512, 128)
    assert x.numel() >= COMPILED_MIN_NUMEL
    if layout == "columns":
        x = x.view(4, -1, 128)
    # A key no other test uses (functools.cache), so that its first call compiles here.
    rounded = compiled_rounding(E5M2, ScaleMode.FLOOR, 32, BlockLayout(layout), torch.float32)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        rounded(x)
    counts = list(points.values())
    assert x.numel() // 32 in counts, counts
    assert counts.count(x.numel()) == 2, counts


def test_attention_ops_agree_with_the_compiled_rounding_and_without(monkeypatch):
    """The ops' outputs with the native rounding, with the compiled rounding (large operands,
    the native kernels off) and with the eager one: the same operand values, so equal up to
    the summation order of the GEMMs on other layouts."""
    import mxcompile.ops.cpu_kernels as cpu_kernels
    from mxcompile.ops import native

    (q, k, v, do), _ = _case("gqa_causal")
    options = AttentionOptions(True, 0.125, "both", "e4m3", "rceil", 32, 128, grad_elem="e4m3")

    def run():
        out, lse = attention_forward_impl(q, k, v, None, options)
        return (out, lse, *attention_backward_impl(do, q, k, v, None, out, lse, options))

    assert native.available()
    calls = _counting_compiled_rounding(monkeypatch)
    with_native = run()
    assert not calls
    monkeypatch.setattr(native, "_kernels", lambda: None)
    monkeypatch.setattr(cpu_kernels, "COMPILE_MIN_NUMEL", cpu_kernels.COMPILED_MIN_NUMEL)
    compiled = run()
    assert calls, "the operands are large enough for the compiled rounding"
    monkeypatch.setattr(cpu_kernels, "COMPILED_MIN_NUMEL", math.inf)
    calls.clear()
    eager = run()
    assert not calls
    for a, b, c in zip(with_native, compiled, eager, strict=True):
        assert sqnr_db(a, c) >= 100 and sqnr_db(b, c) >= 100  # fp32 outputs: summation order only


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_batch_chunk_changes_no_value(kv_heads):
    """The ops' torch implementation run 1, 2 or all 3 batch elements at a time: equal outputs
    and gradients, bit for bit (MX blocks lie within one batch element and head), in the same
    layouts (one chunk returns the implementation's own sequence-major gradients)."""
    q, k, v, do = _qkv(5, batch=3, heads=2, kv_heads=kv_heads, q_len=96, k_len=96, width=32)
    options = (True, 0.2, "both", "e4m3", "rceil", 32, 32)
    results = []
    for chunk in (1, 2, 3):
        out, lse = torch.ops.mxcompile.attention(q, k, v, None, *options, chunk)
        grads = torch.ops.mxcompile.attention_backward(do, q, k, v, None, out, lse, *options[:4], "e5m2",
                                                       *options[4:], chunk)
        results.append((out, lse, *grads))
    for other in results[1:]:
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(results[0], other))


def test_a_batch_chunk_below_one_is_an_error_naming_it():
    q, k, v, _ = _qkv(0, batch=2, heads=2, kv_heads=2, q_len=64, k_len=64, width=32)
    with pytest.raises(ValueError, match="batch_chunk=0: give a positive int"):
        torch.ops.mxcompile.attention(q, k, v, None, True, 0.2, "both", "e4m3", "rceil", 32, 32, 0)
