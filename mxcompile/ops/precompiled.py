"""Small compiled functions saved to disk, so that later processes load them without tracing.

The quantize ops' compiled-graph CPU kernels (`ops.cpu_kernels`, where the native kernels of
`ops.native` cannot run: the attention op's rounding and the quantize ops inside compiled
graphs) run inside ops that Inductor cannot see, so they are
compiled by a `torch.compile` of their own. Inductor's FX graph cache and the AOTAutograd cache
make a warm start skip code generation, but Dynamo still traces each function in every process:
about 0.5 s per graph on the 2-core CPU, three graphs per training step when only the attention
rounding was compiled, which made a warm mxfp8 start 1.66x Inductor's (issue 15).

`Precompiled` instead compiles the function once with Dynamo's precompile API
(`torch.compile(...).aot_compile`) and saves the result, Dynamo's guards and bytecode with the
Inductor artifact, under the Inductor cache directory; a later process loads it in about 10 ms.
One file per (key, input dtypes): the key names everything the graph depends on besides the
input (the function's parameters, the source of the modules it runs, torch and Python, the CPU
capability and Inductor's configuration), so that a change to any of them compiles a new file.

Where the caches are off (`force_disable_caches`, or the FX graph or AOTAutograd cache
disabled), and for inputs the saved guards reject (a size specialized to 0 or 1, say), the
function runs through a plain `torch.compile` instead, as before.

The files are pickles loaded from the cache directory, the same trust as Inductor's own cache
there (which loads generated Python modules and shared libraries from it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

_log = logging.getLogger(__name__)

CACHE_SUBDIR = "mxcompile_precompiled"
# What a saved file that cannot be used raises while loading: missing or truncated (OSError,
# EOFError), not a pickle of this torch (UnpicklingError, AttributeError, ImportError for a
# class that moved), or compiled for another system (RuntimeError from Dynamo's check).
LOAD_ERRORS = (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, RuntimeError)
# What saving can raise: the directory or file not writable (OSError), or a value the function
# closes over that Dynamo's pickler cannot save (RuntimeError "Failed to serialize", PicklingError).
# The compiled function still serves this process.
SAVE_ERRORS = (OSError, pickle.PicklingError, RuntimeError)
_CONFIG_VALUE_TYPES = (bool, int, float, str, type(None))


def caches_enabled() -> bool:
    """Whether torch's compile caches are on: the precompiled files are a cache like them, and
    `aot_compile` needs them."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    return (not inductor_config.force_disable_caches and inductor_config.fx_graph_cache
            and functorch_config.enable_autograd_cache)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _CONFIG_VALUE_TYPES)


def environment_key() -> str:
    """What the compiled code depends on outside the function: torch, Python, the CPU
    capability the C++ code is built for, and Inductor's configuration (its plain values)."""
    from torch._inductor import config as inductor_config

    config = sorted((name, value) for name, value in inductor_config.save_config_portable().items()
                    if _plain(value))
    parts = (torch.__version__, sys.version_info[:2], torch.backends.cpu.get_cpu_capability(), config)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def source_key(paths: Iterable[Path]) -> str:
    """A hash of the given source files' contents."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_directory() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / CACHE_SUBDIR


class Precompiled:
    """`fn(*xs)` for tensors `xs`, compiled with `torch.compile(fn, fullgraph=True)` and the
    dims `dynamic_dims` of every x dynamic, saved to and loaded from the cache directory when
    the caches are on. `name` and `key` name the function and everything its graph depends on
    besides the inputs' dtypes (see the module docstring); `globals_` are the globals fn's code
    runs with (those of the module defining it)."""

    def __init__(self, fn: Callable[..., Any], *, name: str, key: str,
                 dynamic_dims: Sequence[int], globals_: dict[str, Any]) -> None:
        self.fn, self.name, self.key = fn, name, key
        self.dynamic_dims = tuple(dynamic_dims)
        self.globals = globals_
        self._loaded: dict[tuple[torch.dtype, ...], Any] = {}
        self._saved: dict[tuple[torch.dtype, ...], bool] = {}  # whether a file was there, looked up once
        self._traced: Callable[..., Any] | None = None

    def available(self, *xs: torch.Tensor) -> bool:
        """Whether fn(*xs) can run compiled code at hand, without compiling: the function for
        the inputs' dtypes loaded in this process or saved by an earlier one (the file looked
        up once per process; a call then loads it in about 10 ms), and no dynamic dim under 2
        (those go through a plain torch.compile, which compiles)."""
        if self._specializes(xs):
            return False
        dtypes = tuple(x.dtype for x in xs)
        if dtypes in self._loaded:
            return True
        saved = self._saved.get(dtypes)
        if saved is None:
            saved = self._saved[dtypes] = caches_enabled() and self.path(*dtypes).exists()
        return saved

    def __call__(self, *xs: torch.Tensor) -> Any:
        """fn(*xs); the `dynamic_dims` of each x are marked dynamic (each x should be a view of
        the caller's)."""
        dtypes = tuple(x.dtype for x in xs)
        precompiled = self._loaded.get(dtypes)
        if precompiled is None:
            # Dynamo specializes sizes 0 and 1: a graph compiled for one would not serve others.
            # The caches are checked only until a function is loaded (reading torch's config
            # costs ~20 us, as much as the call of a loaded function).
            if not caches_enabled() or self._specializes(xs):
                return self._traced_fn()(*self._marked(xs))
            precompiled = self._loaded[dtypes] = self._load_or_compile(xs)
        if not precompiled.guard_check(*xs):
            return self._traced_fn()(*self._marked(xs))
        return precompiled(*xs)

    def path(self, *dtypes: torch.dtype) -> Path:
        """The file that holds the compiled function for inputs of `dtypes`."""
        digest = hashlib.sha256(repr((self.key, environment_key(), *map(str, dtypes))).encode()).hexdigest()
        return cache_directory() / f"{self.name}-{digest[:32]}.bin"

    def _specializes(self, xs: tuple[torch.Tensor, ...]) -> bool:
        """A dynamic dim of size 0 or 1, which Dynamo specializes (a graph of its own)."""
        return any(x.shape[dim] < 2 for x in xs for dim in self.dynamic_dims)

    def _marked(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for x in xs:
            for dim in self.dynamic_dims:
                torch._dynamo.maybe_mark_dynamic(x, dim)
        return xs

    def _traced_fn(self) -> Callable[..., Any]:
        if self._traced is None:
            self._traced = torch.compile(self.fn, fullgraph=True)
        return self._traced

    def _load_or_compile(self, xs: tuple[torch.Tensor, ...]) -> Any:
        path = self.path(*(x.dtype for x in xs))
        if path.exists():
            try:
                with path.open("rb") as file:
                    loaded = torch.compiler.load_compiled_function(file, f_globals=self.globals)
            except LOAD_ERRORS as err:
                _log.warning("mxcompile: cannot load the precompiled %s from %s (%s: %s); compiling it again",
                             self.name, path, type(err).__name__, err)
            else:
                loaded.disable_guard_check()  # checked once in __call__, not twice
                return loaded
        # Python floats specialized up front: a plain torch.compile first traces them as
        # symbols and restarts when one must be a constant (the element format's maximum), but
        # aot_compile does not restart (it raises TensorifyScalarRestartAnalysis).
        with torch._dynamo.config.patch(specialize_float=True):
            compiled = torch.compile(self.fn, fullgraph=True).aot_compile((self._marked(xs), {}))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(os.fspath(path))  # written to a temporary file, then renamed
        except SAVE_ERRORS as err:
            _log.warning("mxcompile: cannot save the precompiled %s to %s (%s: %s); later processes will "
                         "compile it again", self.name, path, type(err).__name__, err)
        compiled.disable_guard_check()
        return compiled
