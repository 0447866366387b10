"""MemoryBudget: bytes or a fraction, said explicitly; a bare int is rejected."""

from __future__ import annotations

import json

import pytest

from mxcompile import MXConfig
from mxcompile.planner.budget import MemoryBudget


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("6GiB", MemoryBudget.of_bytes(6 * 2**30)),
        ("512MB", MemoryBudget.of_bytes(512 * 10**6)),
        ("4096B", MemoryBudget.of_bytes(4096)),
        ("50%", MemoryBudget.of_fraction(0.5)),
        (0.5, MemoryBudget.of_fraction(0.5)),
        (1.0, MemoryBudget.of_fraction(1.0)),
        (MemoryBudget.of_bytes(7), MemoryBudget.of_bytes(7)),
    ],
)
def test_parse(value: object, expected: MemoryBudget) -> None:
    assert MemoryBudget.parse(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1, "a bare int is ambiguous"),
        (4096, "'4096B' for bytes"),
        (1.5, "a bare float is a fraction and must lie in (0, 1]"),
        ("0%", "a fractional budget must lie in (0, 1]"),
        ("6 parsecs", "is not understood"),
        (True, "is not understood"),
    ],
)
def test_rejects(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="memory_budget") as info:
        MemoryBudget.parse(value)
    assert message in str(info.value)


def test_exactly_one_of_bytes_and_fraction() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        MemoryBudget(bytes=1, fraction=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        MemoryBudget()


@pytest.mark.parametrize("value", ["6GiB", "25%", 0.75])
def test_config_round_trips_through_json(value: object) -> None:
    config = MXConfig(memory_budget=value, scale_mode="floor", attention="qk_only")
    loaded = json.loads(json.dumps(config.to_dict()))
    assert MXConfig(**{**loaded, "include": tuple(loaded["include"]), "exclude": tuple(loaded["exclude"])}) == config
