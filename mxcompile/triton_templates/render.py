"""A small deterministic renderer for Triton kernel templates, and the loader of rendered source.

Templates are `string.Template` texts (Triton source never uses `$`). Rendering substitutes
every placeholder (a missing or unused one is an error), so the same specialisation key always
gives byte-identical source. Triton's `@triton.jit` reads a kernel's source from its file
(`inspect.getsource`), so rendered source is written to a cache directory under a name derived
from its SHA-256 and imported from there with importlib.

Cache directory: `$MXCOMPILE_TRITON_CACHE_DIR`, else `$XDG_CACHE_HOME/mxcompile/triton_templates`
(`~/.cache/...`). Files are written atomically (temporary file + rename), so concurrent processes
may share the directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import string
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

# Bump when the rendering machinery changes in a way that is not visible in rendered source.
RENDERER_VERSION = 1

_PLACEHOLDER = re.compile(r"\$(?:([_a-zA-Z][_a-zA-Z0-9]*)|\{([_a-zA-Z][_a-zA-Z0-9]*)\})")


def render(template: str, params: dict[str, object] | None = None, /, **kwargs: object) -> str:
    """Substitute `params` and `kwargs` into `template`.

    Every placeholder must be given; every keyword argument must be used (the `params` mapping,
    a shared table of constants, may hold more than one template uses).
    """
    table = {**(params or {}), **kwargs}
    used = {a or b for a, b in _PLACEHOLDER.findall(template)}
    missing = sorted(used - table.keys())
    unused = sorted(kwargs.keys() - used)
    if missing or unused:
        raise ValueError(f"template parameters: missing {missing}, unused {unused}")
    return string.Template(template).substitute({k: str(v) for k, v in table.items()})


def indent(code: str, spaces: int) -> str:
    """Indent every non-empty line of a rendered snippet (snippets are written at column 0)."""
    pad = " " * spaces
    return "\n".join(pad + line if line.strip() else "" for line in code.strip("\n").splitlines())


def cache_dir() -> Path:
    env = os.environ.get("MXCOMPILE_TRITON_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mxcompile" / "triton_templates"


def source_digest(source: str) -> str:
    return hashlib.sha256(f"{RENDERER_VERSION}\n{source}".encode()).hexdigest()[:20]


def write_source(source: str, stem: str) -> Path:
    """Write rendered source to `<cache>/<stem>_<digest>.py` (once) and return the path."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}_{source_digest(source)}.py"
    if path.exists() and path.read_text() == source:
        return path
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}_", suffix=".py.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


_modules: dict[tuple[str, bool], ModuleType] = {}
_loaded_sources: dict[str, str] = {}  # "<stem>: <specialisation>" -> source, in load order
_lock = threading.Lock()


def loaded_sources() -> dict[str, str]:
    """The rendered sources this process has loaded, by "<kernel>: <specialisation key>"."""
    with _lock:
        return dict(_loaded_sources)


def _label(source: str, stem: str) -> str:
    for line in source.splitlines():
        if line.startswith("# Specialisation: "):
            return f"{stem}: {line.removeprefix('# Specialisation: ')}"
    return f"{stem}: {source_digest(source)}"


def interpreter_enabled() -> bool:
    """Whether `@triton.jit` would give interpreter functions now (TRITON_INTERPRET=1).

    Triton 3.9 reads TRITON_INTERPRET when a function is decorated (module import), not when
    triton itself is imported, so the flag may be set in-process before a kernel is loaded.
    """
    from triton import knobs

    return bool(knobs.runtime.interpret)


def load_source(source: str, stem: str, *, interpret: bool | None = None) -> ModuleType:
    """Import rendered source as a module, cached per (source, interpreter flag).

    `interpret=None` follows TRITON_INTERPRET; True/False force interpreter functions or real
    `JITFunction`s (tracing with fake CUDA tensors needs the latter, and decorating needs no GPU).
    """
    from triton import knobs

    if interpret is None:
        interpret = interpreter_enabled()
    digest = source_digest(source)
    key = (digest, bool(interpret))
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        path = write_source(source, stem)
        name = f"mxcompile_triton_{stem}_{digest}_{'interp' if interpret else 'jit'}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot import rendered Triton source from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton resolves a kernel's globals through its module
        try:
            with knobs.runtime.scope():
                knobs.runtime.interpret = bool(interpret)
                spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[key] = module
        _loaded_sources.setdefault(_label(source, stem), source)
        return module
