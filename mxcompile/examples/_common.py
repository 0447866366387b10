"""Helpers shared by the example models, the corpus loader and the training loop: argument
checks and seeded construction.

Every error names the field or argument it rejects, in the same form as `MXConfig`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


def check_positive_int(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is an int (not a bool) greater than zero."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is not accepted; give a positive int")


def check_non_negative_int(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is an int (not a bool) greater than or equal to zero."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is not accepted; give a non-negative int")


def check_positive_float(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a real number greater than zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not accepted; give a positive number")


def check_non_negative_float(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a real number greater than or equal to zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is not accepted; give a non-negative number")


def check_bool(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not accepted; accepted: True or False")


def check_choice(name: str, value: Any, accepted: Sequence[str]) -> None:
    """Raise ValueError unless `value` is one of `accepted`."""
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {list(accepted)}")


def seeded(seed: int, build: Callable[[], T]) -> T:
    """Call `build()` with the CPU random generator seeded by `seed`, leaving the caller's
    global random state exactly as it was (no global side effect)."""
    check_non_negative_int("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
