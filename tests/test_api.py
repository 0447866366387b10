"""The public quantize / GEMM entry points and their kernel switch."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import mxcompile
from mxcompile.numerics import ELEM_FORMATS, MXTensor, ScaleMode
from mxcompile.numerics import mx_matmul as reference_matmul
from mxcompile.numerics import quantize_mx as reference_quantize


def test_auto_and_torch_on_cpu_are_the_numerics_core():
    x = torch.randn(64, 96)
    want = reference_quantize(x, 0)
    for kernel in ("auto", "torch"):
        got = mxcompile.quantize_mx(x, 0, kernel=kernel)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale_bytes, want.scale_bytes)
    a, b = mxcompile.quantize_mx(torch.randn(8, 64)), mxcompile.quantize_mx(torch.randn(64, 16), 0)
    assert torch.equal(mxcompile.mx_matmul(a, b, kernel="torch"), reference_matmul(a, b))


def test_unknown_kernel_and_unavailable_triton_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel='cuda' is not accepted"):
        mxcompile.quantize_mx(torch.randn(32), kernel="cuda")
    import mxcompile.triton_templates as tt

    monkeypatch.setattr(tt, "_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="kernel='triton' cannot run here: .*CUDA"):
        mxcompile.quantize_mx(torch.randn(32), kernel="triton")


def _spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian values whose magnitude varies by 2**+-20 between rows and 2**+-6 between
    columns, a zero block and a block of fp32 subnormals (the scale byte 0 end)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())
    x *= torch.exp2(torch.randint(-6, 7, (1, cols), generator=g).float())
    x[0, :32] = 0.0
    x[1, :32] = 2.0**-140
    return x


def _every_case(x: torch.Tensor, w: torch.Tensor, kernel: str) -> list:
    """Every element format and scale mode: quantize both operands, dequantize, multiply."""
    out = []
    for elem in sorted(ELEM_FORMATS):
        for scale_mode in ScaleMode:
            a = mxcompile.quantize_mx(x, -1, elem=elem, scale_mode=scale_mode.value, kernel=kernel)
            b = mxcompile.quantize_mx(w, 0, elem=elem, scale_mode=scale_mode.value, kernel=kernel)
            out.append((a, b, mxcompile.dequantize_mx(a, kernel=kernel), mxcompile.mx_matmul(a, b, kernel=kernel)))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_public_api_compiles_bit_identical_to_eager(kernel):
    """quantize_mx, dequantize_mx and mx_matmul inside a user's torch.compile region (default
    backend, fullgraph): every scale mode and element format, the same bits as eager, e8m0
    scales in the MXTensors, one compile. "auto" runs the mxcompile ops (opaque to Inductor),
    "torch" the numerics core (fused by Inductor)."""
    x, w = _spread(64, 64, 0), _spread(64, 32, 1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_every_case, backend=counter, fullgraph=True, dynamic=False)
    got, want = compiled(x, w, kernel), _every_case(x, w, kernel)
    assert counter.frame_count == 1
    assert len(got) == len(want) == 2 * len(ScaleMode)
    for (ga, gb, g_deq, g_mm), (wa, wb, w_deq, w_mm) in zip(got, want):
        for g, e in ((ga, wa), (gb, wb)):
            assert isinstance(g, MXTensor) and g.scale.dtype == torch.float8_e8m0fnu
            assert (g.axis, g.elem, g.scale_mode, g.block_size) == (e.axis, e.elem, e.scale_mode, e.block_size)
            assert _same_bits(g.data, e.data) and _same_bits(g.scale, e.scale), (e.elem, e.scale_mode)
        assert _same_bits(g_deq, w_deq) and _same_bits(g_mm, w_mm), (wa.elem, wa.scale_mode)
