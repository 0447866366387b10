"""`torch.compile(model, backend="mxfp8")` finds the backend through the installed
torch_dynamo_backends entry point, in a process that never imports mxcompile itself."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import torch
from torch._dynamo.backends.registry import lookup_backend
assert "mxcompile" not in sys.modules
backend = lookup_backend("mxfp8")
print(backend.__module__, backend.__name__)
"""


def test_backend_is_found_without_importing_mxcompile():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mxcompile.backend", "mxfp8_backend"]
