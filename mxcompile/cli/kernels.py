"""`mxcompile inspect --kernels`: rendered Triton kernel sources, when mxcompile uses any.

The CPU lowering compiles MX ops through Inductor's C++ code generation, so no Triton kernel
runs there. `mxcompile.triton_templates` may expose a function listing the kernels it rendered
(one of `LISTING_FUNCTIONS`, returning a mapping name -> source or (name, source) pairs); when
it does and the list is not empty, its sources are shown.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from .views import SYNTAX_THEME

TEMPLATES_MODULE = "mxcompile.triton_templates"
LISTING_FUNCTIONS = ("rendered_sources", "list_rendered_sources", "rendered_kernel_sources")
NO_KERNELS_ON_CPU = (
    "No Triton kernels are used on CPU: mxcompile lowers MX quantize and MX GEMM through "
    "Inductor's C++ code generation here, so there is no rendered kernel source to show."
)


def _listing_function() -> Any | None:
    try:
        module = importlib.import_module(TEMPLATES_MODULE)
    except Exception:  # an absent or broken optional package: nothing to list
        return None
    for name in LISTING_FUNCTIONS:
        function = getattr(module, name, None)
        if callable(function):
            return function
    return None


def _pairs(listing: Any) -> list[tuple[str, str]]:
    """(name, source) pairs from a mapping or a sequence of pairs; anything else is skipped."""
    items: Iterable[Any] = listing.items() if isinstance(listing, dict) else listing or ()
    return [(str(item[0]), str(item[1])) for item in items
            if isinstance(item, (tuple, list)) and len(item) == 2]


def rendered_kernel_sources() -> list[tuple[str, str]]:
    """(name, source) of every kernel the templates package reports as rendered; [] if none."""
    function = _listing_function()
    return _pairs(function()) if function is not None else []


def kernels_view() -> RenderableType:
    sources = rendered_kernel_sources()
    if not sources:
        return Text(NO_KERNELS_ON_CPU)
    return Group(*(
        Panel(Syntax(source, "python", theme=SYNTAX_THEME, line_numbers=True), title=f"Triton kernel: {name}",
              title_align="left")
        for name, source in sources
    ))
