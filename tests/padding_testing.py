"""Shared by the padding tests: data whose magnitude varies along every axis, and training an HF
causal LM at several sequence lengths through the eager mxfp8 pipeline, counting how often
dynamo called the backend (once per compile)."""

from __future__ import annotations

import torch

from mx_testing import eager_mxfp8_backend
from mxcompile.report import Report


def octaves(*shape: int, seed: int) -> torch.Tensor:
    """Values whose magnitude varies over several octaves along every axis, so that a wrong
    quantization axis or a block straddling the padding changes the result (FACTS.md)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    for axis, size in enumerate(shape):
        view = [1] * len(shape)
        view[axis] = size
        x = x * 2.0 ** torch.randint(-6, 7, (size,), generator=g).float().view(view)
    return x


def train_at_lengths(model: torch.nn.Module, report: Report, lengths: tuple[int, ...],
                     vocab: int = 128, batch: int = 2) -> int:
    """One training step (forward with labels, backward) per length; returns the compiles."""
    calls = []
    backend = eager_mxfp8_backend(report=report)

    def counting(gm, example_inputs):
        calls.append(gm)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    for tokens in lengths:
        ids = torch.randint(0, vocab, (batch, tokens))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), tokens
    return len(calls)
