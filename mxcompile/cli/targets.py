"""Resolve a TARGET of `mxcompile inspect` / `profile` into (model, example_inputs).

A TARGET is one of
    path/to/file.py:factory      a Python file and the name of a factory defined in it
    package.module:factory       an importable module and the name of a factory in it
    NAME                         a built-in example (`mxcompile.examples.EXAMPLES`)
A factory takes no arguments and returns `(model, example_inputs)`: an `nn.Module` and a
tuple (or list) of inputs such that `model(*example_inputs)` runs; or `(model, example_inputs,
example_kwargs)` with a dict of keyword inputs, so that `model(*example_inputs,
**example_kwargs)` runs (HF models take `input_ids=...`, `attention_mask=...`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from torch import nn

from ..examples import EXAMPLES, get_example
from .errors import CLIError

TARGET_SEPARATOR = ":"
PYTHON_SUFFIX = ".py"
FACTORY_CONTRACT = ("a callable taking no arguments and returning (model, example_inputs) "
                    "or (model, example_inputs, example_kwargs)")
TARGET_FORMS = "path/to/file.py:factory, package.module:factory, or a built-in example name"
_DIGEST_CHARS = 12


@dataclass
class Target:
    """A loaded target: what the user named, the model and its example inputs, called as
    `model(*inputs, **kwargs)`."""

    spec: str
    model: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _example_names() -> str:
    return ", ".join(sorted(EXAMPLES))


def _looks_like_file(location: str) -> bool:
    return location.endswith(PYTHON_SUFFIX) or "/" in location or "\\" in location


def _import_file(location: str) -> ModuleType:
    path = Path(location).expanduser()
    if not path.is_file():
        raise CLIError(f"file {location!r} does not exist; give TARGET as {TARGET_FORMS}")
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:_DIGEST_CHARS]
    name = f"mxcompile_target_{resolved.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {location!r} as Python source; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(resolved.parent))  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise CLIError(
            f"importing {location!r} raised {type(err).__name__}: {err}; fix the file "
            "(run with --debug for the traceback)"
        ) from err
    return module


def _import_module(location: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: packages in the working directory
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as err:
        if err.name and location.startswith(err.name):
            raise CLIError(
                f"module {location!r} cannot be found; give TARGET as {TARGET_FORMS} "
                f"(built-in examples: {_example_names()})"
            ) from err
        raise CLIError(f"importing module {location!r} raised ModuleNotFoundError: {err}; "
                       "install what it needs") from err
    except Exception as err:
        raise CLIError(
            f"importing module {location!r} raised {type(err).__name__}: {err}; fix the module "
            "(run with --debug for the traceback)"
        ) from err


def _factory_from(module: ModuleType, location: str, attribute: str) -> Callable[[], Any]:
    if not attribute:
        raise CLIError(f"TARGET {location + TARGET_SEPARATOR!r} names no factory; "
                       f"write {location}{TARGET_SEPARATOR}<factory>")
    if not hasattr(module, attribute):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = f"; callables there: {', '.join(callables)}" if callables else ""
        raise CLIError(f"{location!r} has no attribute {attribute!r}{hint}")
    factory = getattr(module, attribute)
    if not callable(factory):
        raise CLIError(f"{location}{TARGET_SEPARATOR}{attribute} is a {type(factory).__name__}, "
                       f"not a callable; it must be {FACTORY_CONTRACT}")
    return factory


def resolve_factory(spec: str) -> Callable[[], Any]:
    """The factory a TARGET names; CLIError saying what is wrong otherwise."""
    if not spec or not spec.strip():
        raise CLIError(f"TARGET is empty; give {TARGET_FORMS}")
    if TARGET_SEPARATOR not in spec:
        try:
            return get_example(spec)
        except ValueError:
            hint = " (a file target also needs ':factory')" if _looks_like_file(spec) else ""
            raise CLIError(
                f"unknown example {spec!r}{hint}; built-in examples: {_example_names()}; "
                f"or give {TARGET_FORMS}"
            ) from None
    location, attribute = spec.rsplit(TARGET_SEPARATOR, 1)
    module = _import_file(location) if _looks_like_file(location) else _import_module(location)
    return _factory_from(module, location, attribute)


def _check_result(spec: str, result: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    expected = "expected (torch.nn.Module, tuple of example inputs[, dict of keyword inputs])"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        kind = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise CLIError(f"factory {spec!r} returned {kind}; {expected}")
    model, inputs, kwargs = (*result, {}) if len(result) == 2 else result
    if not isinstance(model, nn.Module):
        raise CLIError(f"factory {spec!r} returned a {type(model).__name__} as the model; {expected}")
    if not isinstance(inputs, (tuple, list)):
        raise CLIError(
            f"factory {spec!r} returned a {type(inputs).__name__} as example inputs; {expected} "
            "(wrap a single input as (x,); give keyword inputs as (model, (), {'name': x}))"
        )
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise CLIError(f"factory {spec!r} returned a {type(kwargs).__name__} as keyword inputs; {expected} "
                       "(a dict from argument names to values)")
    return model, tuple(inputs), dict(kwargs)


def load_target(spec: str) -> Target:
    """Resolve `spec`, call its factory and check what it returns."""
    factory = resolve_factory(spec)
    try:
        result = factory()
    except Exception as err:
        raise CLIError(
            f"factory {spec!r} raised {type(err).__name__}: {err}; it must be {FACTORY_CONTRACT} "
            "(run with --debug for the traceback)"
        ) from err
    model, inputs, kwargs = _check_result(spec, result)
    return Target(spec, model, inputs, kwargs)
