"""Compile the Triton kernels for a GPU target without a GPU (ahead of time, to a cubin).

The interpreter checks numerics; it does not check that a kernel compiles for a real target
(layouts of `tl.dot_scaled`, FP8 `tl.dot`, reshapes, reductions, constexpr use). Triton can
lower a kernel to PTX and a cubin with no device present, given a `GPUTarget`. `compile_launch`
runs one of the launchers with `meta` tensors and a capturing `wrap`, so the argument list and
meta-parameters are exactly the launcher's, and compiles what it would have launched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_TRITON_TYPES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
}


class _Capture:
    """Stands in for `wrap_triton`: records the launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple, dict]] = []

    def __call__(self, kernel: Any) -> Any:
        capture = self

        class _Launcher:
            def __getitem__(self, grid: Any) -> Callable[..., None]:
                def launch(*args: Any, **kwargs: Any) -> None:
                    capture.launches.append((kernel, args, kwargs))

                return launch

        return _Launcher()


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, Any]]:
    names = list(kernel.arg_names)
    values = dict(zip(names, args, strict=False))
    values.update(kwargs)
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name in names:
        value = values[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"argument {name}={value!r}: no Triton type for it")
    return signature, constexprs


def compile_launch(
    launch: Callable[[Callable[[Any], Any]], object], capability: int, *, num_warps: int = 4
) -> list[Any]:
    """Run `launch(wrap)` (a launcher call on meta tensors, with explicit tiles), then compile
    every kernel it launched for CUDA `capability` (e.g. 90, 100). Returns the compiled kernels
    (`.asm` holds ttir/ttgir/llir/ptx/cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    capture = _Capture()
    launch(capture)
    if not capture.launches:
        raise RuntimeError("the launcher launched nothing")
    compiled = []
    for kernel, args, kwargs in capture.launches:
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        signature, constexprs = _signature(fn, args, kwargs)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled.append(
            triton.compile(
                source,
                target=GPUTarget("cuda", capability, 32),
                options={"num_warps": num_warps},
            )
        )
    return compiled
