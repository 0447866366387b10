"""`MemoryBudget`: the planner's activation-memory budget, in bytes or as a fraction, always
said explicitly.

A budget is either a number of bytes or a fraction f in (0, 1] of the range between the most
aggressive plan and keep-everything (as torch's ``activation_memory_budget`` scales). Which
one is never read from the type of a number alone, except by one documented rule for bare
numbers (see `MemoryBudget.parse`):

* a string with a unit is bytes: ``"6GiB"``, ``"512MB"``, ``"4096B"``;
* a string with a percent sign is a fraction: ``"50%"``;
* a bare float in (0, 1] is a fraction (``0.5``, as torch's ``activation_memory_budget``);
* a bare int is rejected: ``1`` would otherwise mean one byte while ``1.0`` means 100%.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_BYTES_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")
_PERCENT_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
_PERCENT = 100.0
_ACCEPTED = (
    "accepted: bytes with a unit (a string such as '6GiB', '512MB' or '4096B', units "
    f"{sorted(_BYTE_UNITS)}), a percent string such as '50%', a float fraction in (0, 1], "
    "or MemoryBudget.of_bytes(n) / MemoryBudget.of_fraction(f)"
)


@dataclass(frozen=True)
class MemoryBudget:
    """Exactly one of `bytes` (a positive int) and `fraction` (in (0, 1]) is set."""

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError(f"MemoryBudget needs exactly one of bytes and fraction, got {self!r}")
        if self.bytes is not None and (
            isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0
        ):
            raise ValueError(f"memory_budget: a byte budget must be a positive int, got {self.bytes!r}")
        if self.fraction is not None and (
            isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float))
            or not 0.0 < self.fraction <= 1.0
        ):
            raise ValueError(f"memory_budget: a fractional budget must lie in (0, 1], got {self.fraction!r}")

    @classmethod
    def of_bytes(cls, count: int) -> "MemoryBudget":
        return cls(bytes=count)

    @classmethod
    def of_fraction(cls, fraction: float) -> "MemoryBudget":
        return cls(fraction=float(fraction))

    @classmethod
    def parse(cls, value: Any) -> "MemoryBudget":
        """A budget from what an option may hold (see the module docstring for the rules)."""
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, float):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"memory_budget={value!r}: a bare float is a fraction and must lie in (0, 1]; "
                                 f"{_ACCEPTED}")
            return cls.of_fraction(value)
        if isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"memory_budget={value!r}: a bare int is ambiguous (bytes or 100%?); say which: "
                             f"'{value}B' for bytes or a fraction such as '50%'; {_ACCEPTED}")
        if isinstance(value, str):
            percent = _PERCENT_PATTERN.match(value)
            if percent:
                return cls.of_fraction(float(percent.group(1)) / _PERCENT)
            match = _BYTES_PATTERN.match(value)
            if match and match.group(2).upper() in _BYTE_UNITS:
                return cls.of_bytes(int(float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]))
        raise ValueError(f"memory_budget={value!r} is not understood; {_ACCEPTED}")

    @property
    def keeps_everything(self) -> bool:
        """The fraction 1.0: the keep-everything peak itself, which every graph meets unplanned,
        so nothing about the graphs may change (the passes compile them as without a budget)."""
        return self.fraction == 1.0

    def to_json(self) -> str | float:
        """The budget as `parse` reads it back: "<n>B" for bytes, the float for a fraction."""
        return f"{self.bytes}B" if self.bytes is not None else self.fraction  # type: ignore[return-value]

    def __str__(self) -> str:
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction * _PERCENT:g}% of activation memory"
