"""Building the native kernels (`quantize.cpp`): compiled once per machine with the C++
compiler Inductor uses, and kept under Inductor's cache directory, so later processes load them
in milliseconds.

The library is built for the CPU it runs on (-march=native: AVX512 where there is one), so the
file name hashes the source, the compiler's version, the flags and the CPU's feature flags.
Without a C++ compiler, or where the build fails, `library()` returns None once with a warning
naming the cause (`build()` keeps it, for `mxcompile doctor`); the quantize ops then run their
other CPU kernels (`ops.cpu_kernels`), which need the same compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quantize.cpp")
CACHE_SUBDIR = "mxcompile_native"
# -ffp-contract=off: the kernels' rounding tricks need each multiply and add rounded on its own;
# a fused multiply-add changes their results.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++17")
# OpenMP splits the kernels' rows across torch's threads. Compilers without it (Apple clang)
# build the kernels single-threaded.
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_S = 300


def cache_directory() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / CACHE_SUBDIR


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return result.stdout


def _library_path(compiler: str, flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), _compiler_version(compiler).encode(), repr(flags).encode(),
                 platform.machine().encode(), _cpu_features().encode()):
        digest.update(part)
    return cache_directory() / f"quantize-{digest.hexdigest()[:32]}.so"


def _build(compiler: str, flags: tuple[str, ...], path: Path) -> str | None:
    """Compile the source to `path` (written under a temporary name, then renamed, so that
    concurrent processes never load a partial file); the compiler's error otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    command = [compiler, *flags, str(SOURCE), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = result.stderr.strip().splitlines()
        errors = [line for line in lines if "error" in line]
        return (errors or lines or [f"exit status {result.returncode}"])[0]
    os.replace(partial, path)
    return None


@dataclass(frozen=True)
class NativeBuild:
    """The outcome of building the kernels: the loaded library and its file, or why not."""

    library: ctypes.CDLL | None
    path: Path | None = None
    failure: str | None = None


_BUILD_LOCK = threading.Lock()


def build() -> NativeBuild:
    """Build (once per machine) and load the kernels' shared library; a failure is logged once,
    with the reason. A call while `build_in_background` builds waits for that build."""
    with _BUILD_LOCK:
        return _build_once()


def build_in_background() -> None:
    """Start `build` in a daemon thread unless it has run: the backend calls this when it
    compiles a CPU graph, so that a first build (about 4 s on 2 cores) overlaps the graph's
    compilation instead of delaying the first quantize op."""
    if _build_once.cache_info().currsize == 0 and not _BUILD_LOCK.locked():
        threading.Thread(target=build, name="mxcompile-native-build", daemon=True).start()


@functools.cache
def _build_once() -> NativeBuild:
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        compiler = get_cpp_compiler()
    except InvalidCxxCompiler as error:
        failure = f"no C++ compiler ({error})"
        _log.warning("mxcompile: cannot build the native quantize kernels: %s", failure)
        return NativeBuild(None, failure=failure)
    reasons = []
    for flags in (FLAGS + (OPENMP_FLAG,), FLAGS):
        try:
            path = _library_path(compiler, flags)
            if not path.exists():
                start = time.perf_counter()
                error = _build(compiler, flags, path)
                if error is not None:
                    reasons.append(f"{' '.join(flags)}: {error}")
                    continue
                _log.info("mxcompile: built the native quantize kernels in %.1f s (%s)",
                          time.perf_counter() - start, path)
            return NativeBuild(ctypes.CDLL(str(path)), path)
        except (OSError, subprocess.SubprocessError) as error:
            reasons.append(f"{' '.join(flags)}: {type(error).__name__}: {error}")
    failure = f"{compiler} failed ({'; '.join(reasons)})"
    _log.warning("mxcompile: cannot build the native quantize kernels: %s; the quantize ops run their "
                 "compiled-graph CPU kernels instead", failure)
    return NativeBuild(None, failure=failure)


def library() -> ctypes.CDLL | None:
    """The native kernels' shared library, built on first use; None where it cannot be built
    or loaded."""
    return build().library
