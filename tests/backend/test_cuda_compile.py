"""Compiled CUDA graphs, on a GPU only (skipped elsewhere; `benchmarks/gpu_session.sh` runs them).

- `quantize_with_casts` and `fake_quantize_with_casts`, compiled by Inductor for CUDA (Triton
  code, FMA contraction on), give the numerics core's bits (computed eagerly on the CPU) in every scale mode, both
  element formats, along either axis, with zeros, NaN, Inf and subnormal blocks.
- A linear layer compiled with each `gemm_kernel` equals the recipe's independent emulation
  (`mx_testing.MXLinearFunction`) in output and gradients within fp32 summation order,
  |got - ref| <= 1e-5 * max|ref| (the Triton GEMM kernel tests' bound; TF32 is off by default,
  so cuBLAS multiplies in fp32). The loss is linear in the output, so the output gradient
  is exact and every GEMM sees the same quantized operands in both; the dequantized lowering
  runs the layer's three GEMMs as GEMMs of dequantized operands (counted), "triton" none.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mx_testing import MXLinearFunction
from mx_testing import special_quantize_data as _special_data
from mxcompile.numerics import ELEM_FORMATS, ScaleMode, dequantize_along, quantize_along
from mxcompile.ops.quantize import fake_quantize_with_casts, quantize_with_casts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REL = 1e-5
GEMMS_PER_LINEAR_STEP = 3  # Y = X Wt, dX = dY W, dW = dYt X


def _both_cuda_forms(x: torch.Tensor, axis: int, elem: str, scale_mode: str):
    """The CUDA lowering's quantize and fake-quantize in one graph (one compile per case)."""
    return (quantize_with_casts(x, axis, elem, scale_mode, 32),
            fake_quantize_with_casts(x, axis, elem, scale_mode, 32, torch.float32))


def test_compiled_cuda_quantize_forms_give_the_numerics_core_bits() -> None:
    x = _special_data()
    for elem in sorted(ELEM_FORMATS):
        for scale_mode in ScaleMode:
            torch._dynamo.reset()  # a fresh compile per case (dynamo's recompile limit is 8)
            axis = 0 if scale_mode in (ScaleMode.FLOOR, ScaleMode.EVEN) else 1
            compiled = torch.compile(_both_cuda_forms, fullgraph=True, dynamic=False)
            (data, scale), fake = compiled(x.cuda(), axis, elem, scale_mode.value)
            want_data, want_scale = quantize_along(x, axis, ELEM_FORMATS[elem], scale_mode, 32)
            assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8)), (elem, scale_mode)
            assert torch.equal(scale.cpu(), want_scale), (elem, scale_mode)
            want = dequantize_along(want_data, want_scale, axis, 32, torch.float32)
            got = fake.cpu()
            same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
            assert same.all(), (elem, scale_mode, axis, int((~same).sum()))


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).abs().max() <= REL * ref.abs().max())


@pytest.mark.parametrize("gemm_kernel", ["dequantized", "triton"])
def test_compiled_linear_equals_the_recipe_emulation(gemm_kernel: str) -> None:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, 192).cuda()
    x = (torch.randn(128, 256, generator=g) * 3).cuda().requires_grad_()
    target = torch.randn(128, 192, generator=g).cuda()
    ref_x = x.detach().clone().requires_grad_()
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_b = layer.bias.detach().clone().requires_grad_()
    ref = MXLinearFunction.apply(ref_x, ref_w, ref_b)
    (ref * target).sum().backward()

    before = counters["mxcompile"]["dequantized_mx_gemms"]
    with torch._inductor.config.patch(force_disable_caches=True):  # the lowering runs every time
        compiled = torch.compile(layer, backend="mxfp8", options={"gemm_kernel": gemm_kernel, "fallback": False})
        out = compiled(x)
        (out * target).sum().backward()
    lowered = counters["mxcompile"]["dequantized_mx_gemms"] - before
    assert lowered == (GEMMS_PER_LINEAR_STEP if gemm_kernel == "dequantized" else 0)
    assert _close(out.detach(), ref.detach())
    for got, want in ((x.grad, ref_x.grad), (layer.weight.grad, ref_w.grad), (layer.bias.grad, ref_b.grad)):
        assert _close(got, want)
