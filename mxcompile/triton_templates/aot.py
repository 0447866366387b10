"""Compile the Triton kernels for a GPU target without a GPU (ahead of time, to a cubin).

The interpreter checks numerics; it does not check that a kernel compiles for a real target
(layouts of `tl.dot_scaled`, FP8 `tl.dot`, reshapes, reductions, constexpr use). Triton can
lower a kernel to PTX and a cubin with no device present, given a `GPUTarget`. `compile_launch`
runs one of the launchers with `meta` tensors and a capturing `wrap`, so the argument list and
meta-parameters are exactly the launcher's, and compiles what it would have launched, with the
argument specialisation a real launch gets. `pipeline_report` reads from the result whether a
kernel's main loop is software-pipelined, and how many registers and how much stack (register
spills) each thread of it takes.

Without that specialisation (no `tt.divisibility` on pointers and strides, unit strides not
constant) Triton cannot prove loads 16-byte aligned and contiguous, and even a textbook matmul
compiles to one shared-memory stage with no async copies: judge pipelining only as compiled here.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as a real launch computes them: Triton's own argument
    specialisation (`native_specialize_impl`, the function `JITFunction.run` calls) marks
    integers equal to 1 as constants and pointers and integers divisible by 16 with
    `tt.divisibility = 16` (meta tensors stand for allocations, which are 16-byte aligned);
    tensor descriptors are typed by element type and box (`tensordesc<fp8e4nv[128, 128]>`)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.tools.tensor_descriptor import TensorDescriptor

    names = list(kernel.arg_names)
    values = dict(zip(names, args, strict=False))
    values.update(kwargs)
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int], list] = {}
    for index, name in enumerate(names):
        value = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
            continue
        if not isinstance(value, (torch.Tensor, TensorDescriptor, bool, int, float)):
            raise TypeError(f"argument {name}={value!r}: no Triton type for it")
        kind, key = native_specialize_impl(CUDABackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":  # an integer equal to 1 (a unit stride)
            constexprs[name] = key
        elif key:
            attrs[(index,)] = CUDABackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_launch(
    launch: Callable[[Callable[[Any], Any]], object],
    capability: int,
    *,
    num_warps: int = 4,
    num_stages: int = 3,
    only: str | None = None,
) -> list[Any]:
    """Run `launch(wrap)` (a launcher call on meta tensors, with explicit tiles), then compile
    every kernel it launched for CUDA `capability` (e.g. 90, 100), specialised as a real launch
    would be (see `_signature`). Returns the compiled kernels (`.asm` holds
    ttir/ttgir/llir/ptx/cubin; `.metadata.shared` the shared-memory bytes). `only` compiles
    just the launched kernel of that name (a launcher may launch several)."""
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
        if only is not None and fn.__name__ != only:
            continue
        signature, constexprs, attrs = _signature(fn, args, kwargs)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        target = GPUTarget("cuda", capability, 32)
        compiled.append(triton.compile(source, target=target, options=options))
    if not compiled:
        raise ValueError(f"the launcher launched no kernel named {only!r}")
    return compiled


# A shared-memory allocation in TTGIR: `ttg.local_alloc ... !ttg.memdesc<3x128x128xf8E4M3FN`.
_LOCAL_ALLOC = re.compile(r"ttg\.local_alloc[^\n]*?!ttg\.memdesc<((?:\d+x)+)")


@dataclass(frozen=True)
class PipelineReport:
    """What the compiled code of one kernel says about its main loop.

    async_copies: `cp.async` instructions (Ampere-style asynchronous global->shared copies,
    their commits and waits; TMA excluded). tma_copies: `cp.async.bulk.tensor` (TMA)
    instructions. buffers: the largest number of copies of one tile kept in shared memory (the
    leading dimension of a multi-buffered allocation: num_stages - 1 or num_stages when the
    pipeliner ran, 1 otherwise). shared_bytes: the kernel's shared memory. registers and
    stack_bytes: per thread, from the cubin (`resource_usage`); the kernels declare no local
    arrays, so a stack is registers spilled to local memory."""

    shared_bytes: int
    async_copies: int
    tma_copies: int
    buffers: int
    registers: int
    stack_bytes: int

    @property
    def pipelined(self) -> bool:
        """Loads issued asynchronously into at least two shared-memory buffers."""
        return (self.async_copies > 0 or self.tma_copies > 0) and self.buffers >= 2


# `cuobjdump -res-usage`: "Function name:\n REG:255 STACK:2768 SHARED:1024 LOCAL:0 ...".
_RESOURCE_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")


def resource_usage(kernel: Any) -> tuple[int, int]:
    """(registers, stack bytes) per thread of a compiled kernel (from `compile_launch`), read
    from its cubin by the cuobjdump that Triton ships (`triton.knobs.nvidia.cuobjdump`)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        listing = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
                                 capture_output=True, text=True, check=True).stdout
    found = _RESOURCE_USAGE.search(listing)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {listing[:300]!r}")
    return int(found.group(1)), int(found.group(2))


def pipeline_report(kernel: Any) -> PipelineReport:
    """Read a compiled kernel (from `compile_launch`) for signs of software pipelining, and
    its registers and spills."""
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    tma = ptx.count("cp.async.bulk.tensor")
    buffers = [
        int(dims.split("x")[0])
        for dims in _LOCAL_ALLOC.findall(ttgir)
        if dims.count("x") >= 3  # a stack of 2-D tiles (2-D and 1-D allocations are single)
    ]
    registers, stack_bytes = resource_usage(kernel)
    return PipelineReport(
        shared_bytes=int(kernel.metadata.shared),
        async_copies=ptx.count("cp.async.") - ptx.count("cp.async.bulk"),
        tma_copies=tma,
        buffers=max(buffers, default=1),
        registers=registers,
        stack_bytes=stack_bytes,
    )
