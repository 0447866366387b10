"""`mxcompile inspect --kernels`: the Triton kernel sources, when mxcompile uses any.

The CPU lowering compiles MX ops through Inductor's C++ code generation, so no Triton kernel
runs there. `mxcompile.triton_templates.loaded_kernel_sources` lists the kernel modules loaded in
this process (their plain `.py` files); when it lists any, their sources are shown.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from ..triton_templates import loaded_kernel_sources
from .views import SYNTAX_THEME

NO_KERNELS_ON_CPU = (
    "No Triton kernels are used on CPU: mxcompile lowers MX quantize and MX GEMM through "
    "Inductor's C++ code generation here, so there is no Triton kernel source to show."
)


def kernels_view() -> RenderableType:
    sources = loaded_kernel_sources()
    if not sources:
        return Text(NO_KERNELS_ON_CPU)
    return Group(*(
        Panel(Syntax(source, "python", theme=SYNTAX_THEME, line_numbers=True), title=f"Triton kernel: {name}",
              title_align="left")
        for name, source in sources.items()
    ))
