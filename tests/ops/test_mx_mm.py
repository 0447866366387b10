"""`mx_mm_peak_bytes` against the allocator: the memory planner takes the MX GEMM's scratch
from it, so it must be what the eager op really allocates (torch.profiler's allocator events)."""

from __future__ import annotations

import pytest
import torch

from mxcompile.measure.memory import tensor_peak_bytes
from mxcompile.numerics import E4M3, ScaleMode, dequantize_along, quantize_along
from mxcompile.ops import MX_MM, mx_mm_peak_bytes

BLOCK = 32


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("a_shape", "b_shape", "a_transposed", "b_transposed"), [
    ((512, 1024), (1024, 256), False, False),  # a GEMM of a GPT's MLP down-projection
    ((4, 128, 256), (256, 768), False, False),  # batched activations times a weight
    ((256, 512), (512, 64), True, True),  # column-major operands, as in weight gradients
])
def test_peak_bytes_match_the_allocator(a_shape, b_shape, a_transposed, b_transposed, out_dtype) -> None:
    x = torch.randn(*a_shape)
    w = torch.randn(*b_shape)
    if a_transposed:
        x = x.mT.contiguous().mT
    if b_transposed:
        w = w.mT.contiguous().mT
    a, a_scale = quantize_along(x, x.ndim - 1, E4M3, ScaleMode.RCEIL, BLOCK)
    b, b_scale = quantize_along(w, 0, E4M3, ScaleMode.RCEIL, BLOCK)
    outputs = []

    def step() -> None:
        outputs.append(MX_MM(a, a_scale, b, b_scale, BLOCK, out_dtype))

    step()
    out = outputs.pop()
    measured = tensor_peak_bytes(step)
    assert measured == mx_mm_peak_bytes(a.numel(), a_scale.numel(), b.numel(), b_scale.numel(), out.numel(),
                                        out_dtype, a.device)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_operand_dtype_follows_the_host_bf16_gemm(monkeypatch, native_bf16: bool) -> None:
    """bf16 operands only where bf16 GEMMs are native (CUDA, CPUs with AVX512-BF16 or AMX);
    fp32 outputs always multiply fp32 operands. The eager op's product agrees with the exact
    product of the dequantized values either way (both operand dtypes hold them exactly here)."""
    from mxcompile.ops import mx_mm

    monkeypatch.setattr(mx_mm, "cpu_has_native_bf16_gemm", lambda: native_bf16)
    expected_cpu = torch.bfloat16 if native_bf16 else torch.float32
    assert mx_mm.gemm_operand_dtype(torch.bfloat16, "cpu") == expected_cpu
    assert mx_mm.gemm_operand_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert mx_mm.gemm_operand_dtype(torch.float32, "cpu") == torch.float32
    torch.manual_seed(0)
    x, w = torch.randn(64, 64), torch.randn(64, 48)
    a, a_scale = quantize_along(x, 1, E4M3, ScaleMode.RCEIL, BLOCK)
    b, b_scale = quantize_along(w, 0, E4M3, ScaleMode.RCEIL, BLOCK)
    exact = (dequantize_along(a, a_scale, 1, BLOCK, torch.float64)
             @ dequantize_along(b, b_scale, 0, BLOCK, torch.float64))
    out = MX_MM(a, a_scale, b, b_scale, BLOCK, torch.bfloat16)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=0)  # one bf16 rounding
