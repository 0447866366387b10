"""Fixtures of the Triton-kernel tests.

The kernels run on the CPU under the Triton interpreter. TRITON_INTERPRET is set per test (not
for the whole process, where it would also turn Inductor's Triton kernels into interpreter code
on a GPU machine): Triton 3.9 reads it when a kernel is decorated (when
`mxcompile.triton_templates.loader` imports the kernel files), and the kernels use no `@jit`
function of `triton.language.standard` (decorated when triton is imported), so setting it after
other tests imported triton works. `test_kernel_files.py` checks this in a subprocess that
imports triton first.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The interpreter evaluates masked lanes too (numpy warns on exp overflow and 0/0 there).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
