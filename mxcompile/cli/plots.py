"""PNG plots of `mxcompile profile`, drawn with matplotlib's object-oriented API (a `Figure`
saved straight to PNG: no pyplot, no GUI backend, no global matplotlib state).

matplotlib is a runtime dependency, imported only when a plot is drawn: the other commands
start without it, and `plotting_unavailable` lets `profile` and `doctor` report a missing or
broken install as one line with the command that fixes it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..profiling import GEMM_KINDS, LayerError, StepProfile
from .errors import CLIError, one_line

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTTING_MODULE = "matplotlib.figure"
PLOTTING_INSTALL_HINT = "pip install matplotlib"

MIB = 2**20
DPI = 110
WIDE = (9.0, 4.5)
BAR_GROUP_WIDTH = 0.8
MIN_LAYER_FIGURE_WIDTH = 6.0
INCH_PER_LAYER = 0.7

MEMORY_PLOT = "memory.png"
SQNR_PLOT = "sqnr.png"
OPERATOR_PLOT = "operator_time.png"


def plotting_unavailable() -> str | None:
    """Why the PNG plots cannot be drawn here (with the command that fixes it), or None."""
    try:
        importlib.import_module(PLOTTING_MODULE)
    except ImportError as err:
        return f"matplotlib cannot be imported ({one_line(err)}); install it with `{PLOTTING_INSTALL_HINT}`"
    return None


def require_plotting() -> None:
    """Raise CLIError (exit code 2) before any work when the plots could not be drawn."""
    reason = plotting_unavailable()
    if reason is not None:
        raise CLIError(f"mxcompile profile writes PNG plots, but {reason}")


def _figure(size: tuple[float, float]) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="tight")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png")
    return path


def memory_plot(profiles: dict[str, StepProfile], path: Path) -> tuple[Path, str]:
    """Tensor memory over one step per variant when the profiler recorded allocations, else a
    bar chart of the peak resident set per variant. Returns (path, what the plot shows)."""
    fig = _figure(WIDE)
    ax = fig.subplots()
    if all(p.memory_timeline for p in profiles.values()):
        for name, profile in profiles.items():
            times = [t for t, _ in profile.memory_timeline]
            sizes = [b / MIB for _, b in profile.memory_timeline]
            ax.step(times, sizes, where="post", label=name)
        ax.set_xlabel("time since the step began (ms)")
        ax.set_ylabel("tensor memory allocated in the step (MiB)")
        ax.legend()
        caption = "tensor memory allocated during one training step (torch.profiler allocation events)"
    else:
        names = list(profiles)
        peaks = [(profiles[n].peak_rss_bytes or 0) / MIB for n in names]
        ax.bar(names, peaks)
        ax.set_ylabel("peak resident set of one step (MiB)")
        caption = ("peak resident set per variant (VmHWM); the profiler recorded no allocation "
                   "timeline, so memory over the step is not shown")
    ax.set_title("Memory")
    return _save(fig, path), caption


def sqnr_plot(layers: Sequence[LayerError], path: Path) -> Path:
    """Grouped bars: SQNR of each layer's output, input-gradient and weight-gradient GEMM."""
    width = max(MIN_LAYER_FIGURE_WIDTH, INCH_PER_LAYER * len(layers) * len(GEMM_KINDS) / 2)
    fig = _figure((width, WIDE[1] + 1))
    ax = fig.subplots()
    bar = BAR_GROUP_WIDTH / len(GEMM_KINDS)
    for i, kind in enumerate(GEMM_KINDS):
        xs, ys = [], []
        for j, layer in enumerate(layers):
            value = layer.sqnr(kind)
            if value is not None and value != float("inf"):
                xs.append(j + (i - (len(GEMM_KINDS) - 1) / 2) * bar)
                ys.append(value)
        ax.bar(xs, ys, width=bar, label=kind)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([layer.module for layer in layers], rotation=45, ha="right")
    ax.set_ylabel("SQNR (dB), MX vs float64")
    ax.set_title("Per-layer GEMM error (higher is better)")
    ax.legend()
    return _save(fig, path)


def operator_plot(profiles: dict[str, StepProfile], path: Path) -> Path:
    """Horizontal grouped bars: self CPU time per operator class and variant in one step."""
    classes = sorted({c for p in profiles.values() for c in p.operator_classes})
    fig = _figure(WIDE)
    ax = fig.subplots()
    bar = BAR_GROUP_WIDTH / max(len(profiles), 1)
    for i, (name, profile) in enumerate(profiles.items()):
        ys = [k + (i - (len(profiles) - 1) / 2) * bar for k in range(len(classes))]
        ax.barh(ys, [profile.operator_classes.get(c, 0.0) / 1000 for c in classes], height=bar, label=name)
    ax.set_yticks(range(len(classes)))
    ax.set_yticklabels(classes)
    ax.set_xlabel("self CPU time in one profiled step (ms)")
    ax.set_title("Time per operator class")
    ax.legend()
    return _save(fig, path)
