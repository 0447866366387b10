"""Imports the kernel package (`kernels/`) in the mode a launch needs: interpreter functions
(TRITON_INTERPRET=1, CPU tensors) or compiled-mode `JITFunction`s (GPU launches, tracing with
fake tensors, ahead-of-time compiles).

Triton 3.9's `@triton.jit` reads TRITON_INTERPRET when it decorates a function, i.e. when its
module is imported, and an interpreted kernel can only call interpreted helpers. So the package
is imported once per mode, under its own name (`mxcompile_triton_kernels_interpret` /
`..._jit`), with the flag set for the duration of that import only. Nothing is generated: both
imports execute the same files of `kernels/`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

KERNEL_MODULES = (
    "mx_tile", "quantize", "mx_gemm", "mx_gemm_fp4", "attention", "attention_backward", "flash_attention",
)  # fmt: skip
_KERNELS_DIR = Path(__file__).with_name("kernels")
_packages: dict[bool, ModuleType] = {}
_lock = threading.Lock()


def interpreter_enabled() -> bool:
    """Whether `@triton.jit` would give interpreter functions now (TRITON_INTERPRET=1)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def package_name(interpret: bool) -> str:
    return f"mxcompile_triton_kernels_{'interpret' if interpret else 'jit'}"


def _import_package(interpret: bool) -> ModuleType:
    from triton import knobs

    name = package_name(interpret)
    spec = importlib.util.spec_from_file_location(
        name, _KERNELS_DIR / "__init__.py", submodule_search_locations=[str(_KERNELS_DIR)]
    )
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import the Triton kernel package from {_KERNELS_DIR}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package  # Triton resolves a kernel's globals through its module
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(package)
            for module in KERNEL_MODULES:
                importlib.import_module(f"{name}.{module}")
    except BaseException:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        raise
    return package


def kernel_module(module: str, *, interpret: bool | None = None) -> ModuleType:
    """The kernel module `module` (one of KERNEL_MODULES) decorated for `interpret` (None:
    follow TRITON_INTERPRET now). Each mode's package is imported once per process."""
    if module not in KERNEL_MODULES:
        raise ValueError(f"no kernel module {module!r}; accepted: {list(KERNEL_MODULES)}")
    if interpret is None:
        interpret = interpreter_enabled()
    with _lock:
        if interpret not in _packages:
            _packages[interpret] = _import_package(interpret)
    return sys.modules[f"{package_name(interpret)}.{module}"]


def loaded_kernel_sources() -> dict[str, str]:
    """Source of every kernel module loaded in this process ("<module>" -> file text); empty
    when no kernel was loaded (e.g. on CPU without TRITON_INTERPRET)."""
    with _lock:
        if not _packages:
            return {}
    return {module: (_KERNELS_DIR / f"{module}.py").read_text() for module in KERNEL_MODULES}
