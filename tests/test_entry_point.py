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


# The extras of pyproject's [dev] (and what they pull) that a plain `pip install .` lacks.
DEV_ONLY_MODULES = ("transformers", "torchao", "hypothesis", "pytest")
CLI_IMPORTS = """
import sys
import mxcompile.cli.main, mxcompile.cli.demo, mxcompile.cli.doctor, mxcompile.cli.measure_worker
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))))
"""


def test_cli_imports_no_development_package_nor_matplotlib():
    """Every command's import chain works in a plain install: no [dev] package is imported, and
    matplotlib only when profile draws (so --version, inspect and doctor start without it)."""
    modules = (*DEV_ONLY_MODULES, "matplotlib")
    result = subprocess.run([sys.executable, "-c", CLI_IMPORTS, *modules], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []
