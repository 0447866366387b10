"""Fixtures of the Triton-kernel tests: every test here runs the kernels on the CPU under the
Triton interpreter (the `triton_interpreter` fixture of tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _under_the_interpreter(triton_interpreter: None) -> None:
    """Applies `triton_interpreter` to every test of this folder."""
