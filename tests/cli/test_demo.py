"""`mxcompile demo` end to end with a few steps (two compiles of the tiny GPT)."""

from __future__ import annotations

import re
import subprocess
from typing import Callable

import pytest

Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.slow
def test_demo_few_steps(cli: Cli) -> None:
    result = cli("demo", "--steps", "3", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "MXFP8 rewrite summary" in out
    assert re.search(r"GEMMs converted\s+│\s+\d+ of \d+", out)
    assert "saved activations" in out
    assert "no memory budget set" in out
    assert "MXFP8 (backend='mxfp8'" in out and "bf16 (backend='inductor'" in out
    gap = re.search(r"Final-loss gap, MXFP8 vs bf16: ([+-]\d+\.\d+)%", out)
    assert gap, out
