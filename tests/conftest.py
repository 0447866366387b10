"""Shared fixtures. Compiles are the expensive part of this suite (seconds each on 2 cores), so
tests about the rewrite use `mx_testing.eager_mxfp8_backend`, which skips Inductor."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with dynamo's caches empty, so compiles of one test don't leak into the
    next (recompile counts, configs)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
