"""`mx_mm_peak_bytes` against the allocator: the memory planner takes the MX GEMM's scratch
from it, so it must be what the eager op really allocates (torch.profiler's allocator events)."""

from __future__ import annotations

import pytest
import torch

from mxcompile.measure.memory import tensor_peak_bytes
from mxcompile.numerics import E4M3, ScaleMode, quantize_along
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
                                        out_dtype)
