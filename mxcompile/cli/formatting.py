"""Number formatting shared by the terminal views and the HTML report."""

from __future__ import annotations

import math

BYTE_STEP = 1024
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
FLOP_STEP = 1000
FLOP_UNITS = ("", "K", "M", "G", "T", "P")
PERCENT = 100.0
MS_PER_S = 1000.0
US_PER_S = 1_000_000.0


def format_bytes(value: int | float | None) -> str:
    if value is None:
        return "n/a"
    size = float(value)
    for unit in BYTE_UNITS:
        if abs(size) < BYTE_STEP or unit == BYTE_UNITS[-1]:
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= BYTE_STEP
    raise AssertionError("unreachable")


def format_flops(value: int | float) -> str:
    size = float(value)
    for unit in FLOP_UNITS:
        if abs(size) < FLOP_STEP or unit == FLOP_UNITS[-1]:
            return f"{size:.0f} FLOP" if not unit else f"{size:.1f} {unit}FLOP"
        size /= FLOP_STEP
    raise AssertionError("unreachable")


def format_percent(fraction: float | None, digits: int = 1) -> str:
    return "n/a" if fraction is None else f"{fraction * PERCENT:.{digits}f}%"


def relative_change(before: float, after: float) -> float | None:
    """(after - before) / before, or None when before is zero."""
    return None if before == 0 else (after - before) / before


def format_change(before: float, after: float) -> str:
    change = relative_change(before, after)
    return "n/a" if change is None else f"{change * PERCENT:+.1f}%"


def format_db(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "exact"
    return f"{value:.1f} dB"


def format_shapes(shapes: object) -> str:
    """((128, 64), (64, 192)) -> '128x64 @ 64x192'."""
    try:
        return " @ ".join("x".join(str(d) for d in shape) for shape in shapes)  # type: ignore[union-attr]
    except TypeError:
        return str(shapes)


def format_seconds(value: float) -> str:
    return f"{value * MS_PER_S:.1f} ms" if value < 1 else f"{value:.1f} s"


def format_duration(value: float) -> str:
    """Seconds with a unit that suits their size, down to microseconds."""
    if value == 0:
        return "0 s"
    if abs(value) < 1 / MS_PER_S:
        return f"{value * US_PER_S:.3g} µs"
    if abs(value) < 1:
        return f"{value * MS_PER_S:.3g} ms"
    return f"{value:.3g} s"
