"""The CUDA kernels of the MX attention ops (`attention_forward_cuda`, `attention_backward_cuda`
in mxcompile/ops/attention.py): the Triton kernels where they support the call, the torch
implementation otherwise.

Numerics: called directly on CPU tensors under the interpreter, the Triton path equals the
torch implementation (the CPU op, the definition) within |got - ref| <= 1e-5 * max|ref| per
output and gradient (the tolerance of the kernel tests; measured over 3 seeds of these cases
and key_tile 32/64/128: output <= 1.5e-7 of max|ref|, logsumexp <= 9.6e-7 absolute with
max|lse| ~ 8, gradients <= 2.4e-7 of max|ref|: fp32 summation order only), whatever the CPU
op's key_tile, since both forwards quantize P relative to an integer running maximum.
Selection: the fallback cases give the torch implementation's result bit for bit without
touching a Triton launcher; with fake CUDA tensors (no GPU here) the support check accepts a
plain call and names the reason for the others; both ops have a CUDA kernel registered.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mxcompile.triton_templates as triton_templates
from mxcompile.ops.attention import attention_backward_cuda, attention_forward_cuda, sequence_major
from mxcompile.ops.attention_checks import triton_attention_unsupported

REL = 1e-5

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # the Triton path on the CPU


def _tensors(heads=2, kv_heads=2, q_len=64, k_len=64, width=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, q_len, width, generator=g) * torch.logspace(-2, 2, width, base=2.0)
    k = torch.randn(1, kv_heads, k_len, width, generator=g)
    v = torch.randn(1, kv_heads, k_len, width, generator=g) * torch.logspace(-3, 3, k_len, base=2.0)[:, None]
    do = torch.randn(1, heads, q_len, width, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def _forward(q, k, v, mask, causal, attention_mode="both", key_tile=32):
    return (q, k, v, mask, causal, 1 / math.sqrt(q.shape[-1]), attention_mode, "e4m3", "rceil", 32, key_tile)


@pytest.mark.parametrize(
    "causal,sequence_major_inputs,key_tile",
    [(False, False, 32), (True, False, 64), (True, True, 32)],
    ids=["full", "causal-key_tile64", "causal-sequence-major"],
)
def test_forward_triton_path_equals_the_cpu_op(causal, sequence_major_inputs, key_tile):
    q, k, v, _ = _tensors()
    if sequence_major_inputs:
        q, k, v = (sequence_major(t) for t in (q, k, v))
    args = _forward(q, k, v, None, causal, key_tile=key_tile)
    assert triton_attention_unsupported(q, k, v, None, causal, "both", "e4m3", 32) is None
    out, lse = attention_forward_cuda(*args)
    ref_out, ref_lse = torch.ops.mxcompile.attention(*args)
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    # The op's layouts (the fake implementation's): output like q, logsumexp sequence-major.
    assert out.stride() == ref_out.stride() and lse.stride() == ref_lse.stride()
    assert _rel_err(out, ref_out) <= REL
    assert (lse - ref_lse).abs().max().item() <= REL * max(1.0, ref_lse.abs().max().item())


def test_forward_triton_path_bf16():
    q, k, v, _ = _tensors(dtype=torch.bfloat16, seed=1)
    args = _forward(q, k, v, None, True)
    out, _ = attention_forward_cuda(*args)
    ref_out, _ = torch.ops.mxcompile.attention(*args)
    assert out.dtype == torch.bfloat16
    # bf16 outputs: within 2 bf16 ulps (the interpreter truncates fp32 -> bf16).
    ulp = torch.finfo(torch.bfloat16).eps * ref_out.float().abs()
    assert ((out.float() - ref_out.float()).abs() <= 2 * ulp + 1e-6).all()


@pytest.mark.parametrize(
    "causal,attention_mode,grad_elem",
    [(False, "both", "e4m3"), (True, "both", "e5m2"), (True, "qk_only", "e4m3"), (False, "off", "e4m3")],
    ids=["full", "causal-e5m2", "causal-qk_only", "off"],
)
def test_backward_triton_path_equals_the_cpu_op(causal, attention_mode, grad_elem):
    q, k, v, do = _tensors(seed=2)
    forward = _forward(q, k, v, None, causal, attention_mode=attention_mode)
    # The forward of modes "qk_only" and "off" falls back to the torch implementation; the
    # backward kernels take its logsumexp all the same.
    out, lse = attention_forward_cuda(*forward)
    options = forward[4:8]
    args = (do, q, k, v, None, out, lse, *options, grad_elem, "rceil", 32, 32)
    assert triton_attention_unsupported(
        q, k, v, None, causal, attention_mode, "e4m3", 32, grad_elem=grad_elem, backward_tensors=(do, out, lse)
    ) is None
    grads = attention_backward_cuda(*args)
    refs = torch.ops.mxcompile.attention_backward(*args)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert got.dtype == ref.dtype and got.stride() == ref.stride(), name  # sequence-major
        assert _rel_err(got, ref) <= REL, name


def _forbid_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched for an unsupported call")

    monkeypatch.setattr(triton_templates, "mx_attention_triton", forbidden)
    monkeypatch.setattr(triton_templates, "mx_attention_backward_triton", forbidden)


@pytest.mark.parametrize(
    "case,reason",
    [
        ("mask", "attn_mask"),
        ("gqa", "grouped-query"),
        ("qk_only", "attention_mode='qk_only'"),
        ("causal-rectangular", "top-left aligned"),
        ("head_dim-96", "power of two"),
    ],
)
def test_unsupported_calls_fall_back_to_the_torch_implementation(monkeypatch, case, reason):
    _forbid_triton(monkeypatch)
    kv_heads = 1 if case == "gqa" else 2
    k_len = 96 if case == "causal-rectangular" else 64
    width = 96 if case == "head_dim-96" else 32
    q, k, v, do = _tensors(kv_heads=kv_heads, k_len=k_len, width=width, seed=3)
    mask = torch.rand(64, k_len, generator=torch.Generator().manual_seed(0)) > 0.3 if case == "mask" else None
    attention_mode = "qk_only" if case == "qk_only" else "both"
    causal = case.startswith("causal")
    why = triton_attention_unsupported(q, k, v, mask, causal, attention_mode, "e4m3", 32)
    assert why is not None and reason in why
    args = _forward(q, k, v, mask, causal, attention_mode=attention_mode)
    out, lse = attention_forward_cuda(*args)
    ref_out, ref_lse = torch.ops.mxcompile.attention(*args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    if case == "qk_only":
        return  # the backward kernels support attention_mode "qk_only" (tested above)
    backward = (do, q, k, v, mask, out, lse, *args[4:8], "e4m3", "rceil", 32, 32)
    for got, ref in zip(attention_backward_cuda(*backward), torch.ops.mxcompile.attention_backward(*backward)):
        assert torch.equal(got, ref) and got.stride() == ref.stride()


def test_selection_on_fake_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA graph's attention nodes would run, decided on fake CUDA tensors (no GPU)."""
    monkeypatch.delenv("TRITON_INTERPRET")  # a GPU-less machine without the interpreter
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kv = torch.empty(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
        mask = torch.empty(128, 128, device="cuda", dtype=torch.bool)
        lse = torch.empty(2, 4, 128, device="cuda")

    def why(*tensors, mask=None, causal=True, attention_mode="both", **kwargs):
        return triton_attention_unsupported(*tensors, mask, causal, attention_mode, "e4m3", 32,
                                            check_device=False, **kwargs)

    # Plain causal or full attention: the Triton kernels, forward and backward (any mode).
    assert why(q, k, v) is None and why(q, k, v, causal=False) is None
    assert why(q, k, v, attention_mode="qk_only", grad_elem="e4m3", backward_tensors=(q, q, lse)) is None
    # The rest: the torch implementation, with the reason.
    assert "attn_mask" in why(q, k, v, mask=mask, causal=False)
    assert "grouped-query" in why(q, kv, kv)
    assert "attention_mode='off'" in why(q, k, v, attention_mode="off")
    # Lengths an MX product contracts in blocks of 32: the keys, and for the backward the queries
    # (not in mode "off", which has no MX product); 96 is not a multiple of the kernels' tiles
    # (64, 128) and runs.
    with FakeTensorMode():
        q80, q96 = (torch.empty(2, 4, n, 64, device="cuda", dtype=torch.bfloat16) for n in (80, 96))
        lse80 = torch.empty(2, 4, 80, device="cuda")
    assert why(q96, q96, q96, causal=False) is None
    assert "key length 80 is not a multiple of block_size=32" in why(q, q80, q80, causal=False)
    backward = dict(grad_elem="e4m3", backward_tensors=(q80, q80, lse80), causal=False)
    assert "query length 80 is not a multiple" in why(q80, k, v, **backward)
    assert why(q80, k, v, attention_mode="off", **backward) is None
    # Checked against the device too: without a GPU, triton_available says why not.
    if not torch.cuda.is_available():
        reason = triton_attention_unsupported(q, k, v, None, True, "both", "e4m3", 32)
        assert "CUDA" in reason
    # The kernels are registered for CUDA, so eager calls and Inductor's fallback kernels reach them.
    for name in ("mxcompile::attention", "mxcompile::attention_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


@pytest.mark.parametrize("axis", [2, 3])
def test_forward_operands_are_quantized_by_the_triton_kernel_bit_exactly(axis: int) -> None:
    """The CUDA forward quantizes Q, K (head_dim) and V (the keys) with one Triton quantize
    kernel each, on the operand as a (rows, head_dim) matrix: the numerics core's bits, for a
    (batch, sequence, heads, head_dim)-major operand as attention modules produce it."""
    from mxcompile.numerics import ELEM_FORMATS, ScaleMode, quantize_along
    from mxcompile.ops.attention import _quantize_operand
    from mxcompile.ops.quantize import triton_quantize_unsupported

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 64, 3, 32, generator=g) * torch.logspace(-8, 8, 32, base=2.0)).transpose(1, 2)
    assert triton_quantize_unsupported(x, "e4m3", 32) is None  # the kernel runs (interpreter)
    data, scale = _quantize_operand(x, axis, "e4m3", "rceil", 32)
    want_data, want_scale = quantize_along(x, axis, ELEM_FORMATS["e4m3"], ScaleMode.RCEIL, 32)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale)
