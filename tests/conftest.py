"""Shared fixtures. Compiles are the expensive part of this suite (seconds each on 2 cores), so
tests about the rewrite use `mx_testing.eager_mxfp8_backend`, which skips Inductor."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with dynamo's caches empty, so compiles of one test don't leak into the
    next (recompile counts, configs)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the Triton kernels on the CPU under the Triton interpreter, for one test.

    TRITON_INTERPRET is set per test (not for the whole process, where it would also turn
    Inductor's Triton kernels into interpreter code on a GPU machine): Triton 3.9 reads it when a
    kernel is decorated (when `mxcompile.triton_templates.loader` imports the kernel files), and
    the kernels use no `@jit` function of
    `triton.language.standard` (decorated when triton is imported), so setting it after other
    tests imported triton works. `triton_templates/test_kernel_files.py` checks this in a
    subprocess that imports triton first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The interpreter evaluates masked lanes too (numpy warns on exp overflow and 0/0 there).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@pytest.fixture
def without_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantize ops' CPU kernels as on a machine where the native ones cannot be built
    (`mxcompile.ops.native`): the compiled graphs of `ops.cpu_kernels`, then the reference."""
    from mxcompile.ops import native

    monkeypatch.setattr(native, "_kernels", lambda: None)
