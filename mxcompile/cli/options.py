"""Parsing of `--config KEY=VALUE` overrides into an `MXConfig` (MXConfig does the checking)."""

from __future__ import annotations

import ast
from typing import Any, Sequence

from ..config import FP4_SWITCHES, MXConfig, Recipe
from .errors import CLIError

_BOOLEANS = {"true": True, "false": False}
_NONES = {"none", "null"}
_SEQUENCE_OPENERS = ("(", "[")


def parse_value(text: str) -> Any:
    """A Python value from a command-line string: true/false, none, numbers, tuples or lists
    written as Python literals; anything else stays a string (e.g. '6GiB', 'lm_head')."""
    lowered = text.strip().lower()
    if lowered in _BOOLEANS:
        return _BOOLEANS[lowered]
    if lowered in _NONES:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _field_value(default: Any, text: str) -> Any:
    """Parse `text` for a field whose default is `default`: strings stay strings (a number-like
    regex or format name is still a string), tuple fields take one pattern or a literal tuple."""
    if isinstance(default, str):
        return text
    if isinstance(default, tuple):
        literal = parse_value(text) if text.lstrip().startswith(_SEQUENCE_OPENERS) else None
        return tuple(literal) if isinstance(literal, (tuple, list)) else (text,)
    return parse_value(text)


def parse_overrides(items: Sequence[str] | None) -> dict[str, Any]:
    """KEY=VALUE items as MXConfig options. A tuple field (include, exclude) given several times
    collects every value: --config exclude=lm_head --config exclude=attn."""
    defaults = MXConfig().to_dict()
    options: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CLIError(f"--config {item!r} is not KEY=VALUE; e.g. --config hp_weight_grad=true")
        value = _field_value(defaults.get(key), text)
        if isinstance(value, tuple) and isinstance(options.get(key), tuple):
            value = options[key] + value
        options[key] = value
    return options


def config_from_overrides(items: Sequence[str] | None, backend: str | None = None) -> MXConfig:
    """The config of `backend` ("mxfp8", "nvfp4" or "mxfp4"; None: the `recipe` override, else
    mxfp8) with the given overrides on top of its recipe's defaults, as
    `torch.compile(model, backend=..., options={...})` makes it (`MXConfig.for_recipe`);
    CLIError naming the bad key or value otherwise."""
    options = parse_overrides(items)
    try:
        return MXConfig.for_recipe(backend or options.get("recipe", Recipe.MXFP8), options)
    except (ValueError, TypeError) as err:
        raise CLIError(f"--config: {err}") from err


def fp4_settings_line(config: MXConfig) -> str | None:
    """The resolved switches of an FP4 recipe (each default applied), or None under mxfp8."""
    fp4 = config.fp4
    if fp4 is None:
        return None
    switches = ", ".join(f"{name}={getattr(fp4, name)!r}" for name in FP4_SWITCHES)
    return f"{fp4.recipe.value} recipe: {fp4.block_format.name} GEMMs, {switches}, seed={fp4.seed}"


def changed_settings(config: MXConfig) -> dict[str, Any]:
    """The settings of `config` that differ from the defaults."""
    defaults = MXConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if defaults.get(k) != v}
