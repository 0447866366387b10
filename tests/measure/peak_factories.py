"""Step factories for tests of `mxcompile.measure.fresh_process` (imported by name in the child)."""

from __future__ import annotations

from typing import Callable

import torch

FLOAT32_BYTES = 4


def allocate_step(nbytes: int) -> Callable[[], None]:
    """A step that fills a fresh float32 tensor of ``nbytes`` (so every page is touched) and
    frees it."""
    def step() -> None:
        buffer = torch.ones(nbytes // FLOAT32_BYTES)
        del buffer

    return step
