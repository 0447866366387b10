"""A traced MX GEMM for the cost model's tests, which price its nodes without running them."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from mxcompile.config import MXConfig
from mxcompile.ops.mx_mm import MX_MM
from mxcompile.ops.quantize import QUANTIZE

MX_GEMM_SHAPE = (64, 128, 96)  # (M, K, N)


def traced_mx_gemm(config: MXConfig = MXConfig()) -> fx.GraphModule:
    """x (M x K) quantized along K, w (K x N) quantized along K, and their `mxcompile::mx_mm`
    (fp32 out), traced, every node with its fake value (``MX_GEMM_SHAPE``)."""

    def quantize_and_mm(x, w):
        a, a_scale = QUANTIZE(x, 1, config.forward_elem.value, config.scale_mode.value, config.block_size)
        b, b_scale = QUANTIZE(w, 0, config.forward_elem.value, config.scale_mode.value, config.block_size)
        return MX_MM(a, a_scale, b, b_scale, config.block_size, torch.float32)

    m, k, n = MX_GEMM_SHAPE
    gm = fx.symbolic_trace(quantize_and_mm)
    FakeTensorProp(gm).propagate(torch.randn(m, k), torch.randn(k, n))
    return gm
