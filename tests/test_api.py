"""The public quantize / GEMM entry points and their kernel switch."""

from __future__ import annotations

import pytest
import torch

import mxcompile
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
