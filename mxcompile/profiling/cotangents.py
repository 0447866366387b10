"""The seeded output gradient that the profiled backward passes start from: the same in every
run and of the scale of a mean loss's gradient."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

DEFAULT_COTANGENT_SEED = 0


def make_cotangents(outputs: Sequence[Tensor], seed: int = DEFAULT_COTANGENT_SEED) -> list[Tensor]:
    """One seeded Gaussian cotangent per output, scaled by 1/numel like the gradient of a mean."""
    generator = torch.Generator().manual_seed(seed)
    cotangents = []
    for out in outputs:
        noise = torch.randn(out.shape, generator=generator, dtype=torch.float32)
        cotangents.append((noise / max(out.numel(), 1)).to(device=out.device, dtype=out.dtype))
    return cotangents


def differentiable_outputs(output: Any) -> list[Tensor]:
    """The floating-point tensors of a model's output (any pytree) that carry a gradient."""
    return [
        t for t in pytree.tree_leaves(output)
        if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad
    ]

