"""The cost model sits below the passes: nothing in mxcompile/cost/ imports mxcompile.passes
(the passes import the cost model through the memory plan). Node metadata readers both need
live in mxcompile/graph_meta.py."""

from __future__ import annotations

import ast
from pathlib import Path

import mxcompile.cost

COST_DIR = Path(mxcompile.cost.__file__).parent


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of the mxcompile modules ``path`` imports (relative imports resolved)."""
    package = ["mxcompile", "cost"]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_cost_model_imports_nothing_from_the_passes() -> None:
    sources = sorted(COST_DIR.glob("*.py"))
    assert sources
    upward = {str(p.name): [m for m in _imported_modules(p) if m.startswith("mxcompile.passes")] for p in sources}
    assert not any(upward.values()), upward


def test_relative_imports_resolve_as_python_does() -> None:
    # `from ..graph_meta import x` in mxcompile/cost/graph_costs.py is mxcompile.graph_meta.
    assert "mxcompile.graph_meta" in _imported_modules(COST_DIR / "graph_costs.py")
