"""An MX GEMM whose output is directly another MX GEMM's operand (Linear -> residual add ->
Linear: in the backward, the out-projection's input gradient is the MLP's output gradient) lowers
on CPU, through the real backend, with gradients within INDUCTOR_BOUND of the eager MX oracle.
Before the fix the lowered product had no fake value and Inductor's lowering failed with
KeyError: 'val' (mxcompile/lowering.py `_replace_gemm`)."""

from __future__ import annotations

import torch
from torch import nn

from gradient_blocks import INDUCTOR_BOUND, compiled_distances

TOKENS, WIDTH, HIDDEN = 64, 64, 256


class _ResidualMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))

    def forward(self, x):
        h = self.proj_in(x)
        return self.proj_out(h + self.mlp(h))


def test_gemm_output_feeding_a_gemm_lowers_with_the_oracles_gradients():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH)
    distances = compiled_distances(_ResidualMLP(), lambda module: module(x).square().mean(), "mxfp8")
    worst = max(distances, key=distances.get)
    assert distances[worst] <= INDUCTOR_BOUND, distances
