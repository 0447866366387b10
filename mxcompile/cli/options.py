"""Parsing of `--config KEY=VALUE` overrides into an `MXConfig` (MXConfig does the checking)."""

from __future__ import annotations

import ast
from typing import Any, Sequence

from ..config import MXConfig
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


def config_from_overrides(items: Sequence[str] | None) -> MXConfig:
    """MXConfig with the given overrides; CLIError naming the bad key or value otherwise."""
    try:
        return MXConfig.from_options(parse_overrides(items))
    except (ValueError, TypeError) as err:
        raise CLIError(f"--config: {err}") from err


def changed_settings(config: MXConfig) -> dict[str, Any]:
    """The settings of `config` that differ from the defaults."""
    defaults = MXConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if defaults.get(k) != v}
