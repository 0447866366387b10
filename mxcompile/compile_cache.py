"""What lets torch's compile caches serve mxfp8 graphs: the cache-key tag, and the stored reports.

torch's AOTAutograd cache keys a compiled graph by the dynamo graph, its inputs and torch's
configs; it cannot see the mxfp8 pass pipeline, which runs inside AOTAutograd and changes what
is compiled. So the backend compiles under `torch.compiler.config.cache_key_tag` (documented
as a tag included in every torch.compile cache key) extended by `cache_tag(config)`: a digest
of the MXConfig, of mxcompile's own source files and of the passes the pipeline runs. A
different config, an edited mxcompile (a pass, an op's definition) or a replaced pass gives a
different key and never a stale entry.

A cache hit skips the passes, so their decisions (the graph's `Report`) would be lost. The
backend stores each compiled graph's report next to torch's cache entries, under a key of the
tag, the dynamo graph's code and its inputs' metadata, and reads it back on a hit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._inductor.runtime.cache_dir_utils import cache_dir

from . import passes
from .config import MXConfig
from .report import Report

logger = logging.getLogger("mxcompile")

REPORTS_SUBDIR = "mxcompile_reports"
TAG_PREFIX = "mxcompile-"
TAG_SEPARATOR = "+"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over mxcompile's files (paths and bytes; byte-code caches left out)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _pipeline() -> list[str]:
    """The passes the pipeline runs now, by qualified name (a replaced pass changes the key)."""
    stages = (*passes.PIPELINE, passes.PARTITION_STAGE)
    return [f"{name}={fn.__module__}.{fn.__qualname__}" for name, fn in stages]


def cache_tag(config: MXConfig) -> str:
    """The part of the cache key that mxfp8 adds: config, mxcompile's sources, the passes."""
    payload = json.dumps({"config": config.to_dict(), "source": source_digest(), "pipeline": _pipeline()},
                         sort_keys=True)
    return TAG_PREFIX + hashlib.sha256(payload.encode()).hexdigest()


def tagged(config: MXConfig) -> Any:
    """A context in which torch's cache keys include `cache_tag(config)` (after the user's own
    tag, if one is set)."""
    user_tag = torch.compiler.config.cache_key_tag
    tag = cache_tag(config)
    return torch.compiler.config.patch(cache_key_tag=f"{user_tag}{TAG_SEPARATOR}{tag}" if user_tag else tag)


def _input_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), str(value.device), [str(s) for s in value.shape],
                [str(s) for s in value.stride()], value.requires_grad]
    if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return [type(value).__name__, str(value)]
    return [type(value).__name__]


def report_key(gm: fx.GraphModule, example_inputs: Sequence[Any], config: MXConfig) -> str:
    """Key of a graph's stored report: what decides the passes' decisions (config, sources,
    graph code, input metadata, grad mode, autocast dtypes)."""
    autocast = {d: str(torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                if torch.is_autocast_enabled(d)}
    payload = json.dumps({"tag": cache_tag(config), "code": gm.code,
                          "inputs": [_input_signature(x) for x in example_inputs],
                          "grad": torch.is_grad_enabled(), "autocast": autocast}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _report_path(key: str) -> Path:
    return Path(cache_dir()) / REPORTS_SUBDIR / f"{key}.pickle"


def store_report(key: str, report: Report) -> None:
    """Write `report` under `key` (atomically: a reader never sees half a file)."""
    path = _report_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(pickle.dumps(report))
    os.replace(partial, path)


def load_report(key: str) -> Report | None:
    """The report stored under `key`, or None (logged) when there is none."""
    path = _report_path(key)
    if not path.is_file():
        logger.warning("mxcompile: graph served from torch's compile cache, but its pass report is not in %s; "
                       "the report of this graph is empty", path.parent)
        return None
    return pickle.loads(path.read_bytes())
