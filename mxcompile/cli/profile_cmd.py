"""`mxcompile profile TARGET --steps N --out DIR`: Inductor and mxfp8 side by side on the same
inputs: step time, peak memory, per-operator time and per-layer MX error, written as
DIR/report.html, DIR/report.json and PNG plots.

Each backend is measured in its own fresh subprocess (`measure_worker`), one after the other,
so that the peak resident set of a step belongs to that backend alone. The per-layer error
(`profiling.linear_errors`) and the rewrite report (`mxcompile.explain`) run in this process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table
from rich.text import Text

from ..profiling import (
    GEMM_KINDS,
    LayerError,
    US_PER_MS,
    StepProfile,
    linear_errors,
    profile_document,
)
from . import plots
from .common import add_config_argument, add_target_argument, explain_target, positive_int, progress_bar
from .errors import EXIT_FAILURE, EXIT_USAGE, CLIError
from .formatting import format_bytes, format_db, format_percent, format_seconds
from .html_report import render_html
from .options import config_from_overrides
from .targets import load_target

REFERENCE = "inductor"
CANDIDATE = "mxfp8"
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 2
DEFAULT_OUT = "mxcompile-profile"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
WORKER_MODULE = "mxcompile.cli.measure_worker"
STDERR_TAIL_LINES = 20
PROGRESS_KEYS = frozenset({"phase", "done", "total"})
PHASE_LABELS = {"warmup": "compiling + warm-up", "steps": "timed steps", "profile": "profiling",
                "memory": "peak memory"}


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "profile", parents=[parent], help="time, memory and MX error: mxfp8 against Inductor",
        description="Compile TARGET's training step (forward + backward, no optimizer) with Inductor "
                    "and with mxfp8, each in a fresh process; measure step time, peak memory and "
                    "operator time; compute each linear layer's MX error; write report.html, "
                    "report.json and PNG plots to --out.",
    )
    add_target_argument(parser)
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                        help=f"timed steps per backend (default: {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=positive_int, default=DEFAULT_WARMUP,
                        help=f"untimed steps first, compilation included (default: {DEFAULT_WARMUP})")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT),
                        help=f"output directory (default: ./{DEFAULT_OUT})")
    parser.add_argument("--fp32", action="store_true", help="run the steps without bf16 autocast")
    add_config_argument(parser)
    parser.set_defaults(run=run)


def _prepare_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {str(out)!r} exists and is not a directory; give a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"cannot create --out directory {str(out)!r}: {err.strerror}") from err
    return out


def _worker_command(args: argparse.Namespace, backend: str, result_path: Path) -> list[str]:
    command = [sys.executable, "-m", WORKER_MODULE, args.target, "--backend", backend,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result_path)]
    for item in args.config:
        command += ["--config", item]
    if args.fp32:
        command.append("--fp32")
    if getattr(args, "debug", False):
        command.append("--debug")
    return command


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"


def _progress_event(line: str) -> dict[str, Any] | None:
    """A worker progress line, or None for anything else the target may print."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and PROGRESS_KEYS <= event.keys() else None


def _measure(args: argparse.Namespace, backend: str, progress: Progress, task: TaskID, workdir: Path) -> StepProfile:
    """Run one backend's measurement in a fresh process, following its progress lines."""
    result_path = workdir / f"{backend}.json"
    stderr_path = workdir / f"{backend}.stderr"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(_worker_command(args, backend, result_path), stdout=subprocess.PIPE,
                                   stderr=stderr, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            event = _progress_event(line)
            if event is not None:
                label = PHASE_LABELS.get(event["phase"], event["phase"])
                progress.update(task, description=f"{backend:<8} {label}", completed=event["done"],
                                total=event["total"])
        code = process.wait()
    if code != 0:
        error_text = stderr_path.read_text()
        if getattr(args, "debug", False):
            sys.stderr.write("\n".join(error_text.splitlines()[-STDERR_TAIL_LINES:]) + "\n")
        raise CLIError(f"measuring {backend} failed: {_last_line(error_text)}",
                       exit_code=EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILURE)
    return StepProfile.from_dict(json.loads(result_path.read_text()))


def _write_plots(
    out: Path, profiles: dict[str, StepProfile], layers: Sequence[LayerError]
) -> tuple[dict[str, str], dict[str, str]]:
    """Write the PNGs; return (plot name -> file name, plot name -> caption)."""
    memory_path, memory_caption = plots.memory_plot(profiles, out / plots.MEMORY_PLOT)
    files = {"memory": memory_path.name,
             "sqnr": plots.sqnr_plot(layers, out / plots.SQNR_PLOT).name,
             "operator_time": plots.operator_plot(profiles, out / plots.OPERATOR_PLOT).name}
    captions = {"memory": memory_caption,
                "sqnr": "SQNR of each linear layer's three GEMMs, MX emulation against float64",
                "operator_time": "self CPU time per operator class in one profiled step"}
    return files, captions


_BASE_NOTES = (
    "A step is forward + backward with a fixed seeded cotangent, no optimizer; both backends see the "
    "same inputs and the same cotangent.",
    "Peak RSS is VmHWM of a fresh process per backend, reset just before one extra step run after the "
    "timed ones with large buffers mmap-ed (so that freed memory leaves the process); it includes "
    "weights, gradients and the runtime.",
)


def _notes(profiles: dict[str, StepProfile], layers: Sequence[LayerError]) -> list[str]:
    notes = list(_BASE_NOTES)
    if not layers:
        notes.append("The model has no nn.Linear: no per-layer error to show.")
    for profile in profiles.values():
        notes += [f"{profile.backend}: {n}" for n in profile.notes]
        if profile.machine_busy:
            notes.append(f"{profile.backend}: the load average was {profile.load_average:.1f} on "
                         f"{profile.cpu_count} CPUs while its steps were timed: other processes competed "
                         "for the CPUs, so step and operator times are inflated")
        if profile.noisy:
            notes.append(f"{profile.backend}: timed steps ranged from {format_seconds(profile.min_step_s)} to "
                         f"{format_seconds(max(profile.step_times_s))}: the machine was probably busy; "
                         "compare the fastest steps, or rerun on a quiet machine")
    return notes


def _summary_table(profiles: dict[str, StepProfile], comparison: dict[str, Any]) -> Table:
    table = Table(title="Training step (forward + backward)")
    for column in ("backend", "compile + step 1", "median step", "fastest step", "peak RSS", "peak tensor memory",
                   "GEMM FLOPs in MX (run time)"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for name, p in profiles.items():
        table.add_row(name, format_seconds(p.compile_s), format_seconds(p.median_step_s), format_seconds(p.min_step_s),
                      format_bytes(p.peak_rss_bytes), format_bytes(p.peak_tensor_bytes), _mx_share_text(p))
    table.caption = (f"{CANDIDATE}/{REFERENCE} step time: median {_ratio_text(comparison['median_step_ratio'])}, "
                     f"fastest {_ratio_text(comparison['min_step_ratio'])}")
    return table


def _mx_share_text(profile: StepProfile) -> str:
    """The measured step's MX share of all its GEMM FLOPs (eager ones included), or '-'."""
    coverage = profile.step_coverage
    if coverage is None:
        return "-"
    return f"{format_percent(coverage['mx_flop_fraction'])} ({coverage['eager_gemms']} GEMMs eager)"


def _ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def _layers_table(layers: Sequence[LayerError]) -> Table:
    table = Table(title="Per-layer SQNR, MX vs float64 (higher is better)")
    table.add_column("module")
    for kind in GEMM_KINDS:
        table.add_column(kind, justify="right")
    for layer in layers:
        cells = ["exact" if g.status == "exact" else format_db(g.sqnr_db) for g in layer.gemms]
        table.add_row(layer.module, *cells)
    return table


def _operator_class_table(profiles: dict[str, StepProfile]) -> Table:
    table = Table(title="Self CPU time per operator class, one profiled step")
    table.add_column("operator class")
    for name in profiles:
        table.add_column(name, justify="right")
    classes = sorted({c for p in profiles.values() for c in p.operator_classes})
    for op_class in classes:
        table.add_row(op_class, *(f"{p.operator_classes.get(op_class, 0.0) / US_PER_MS:.2f} ms"
                                  for p in profiles.values()))
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    plots.require_plotting()
    config = config_from_overrides(args.config)
    target = load_target(args.target)
    if target.kwargs:
        # The step harness and the per-layer error capture call model(*inputs) only.
        raise CLIError(f"profile takes positional example inputs only, and {target.spec} returned keyword "
                       f"inputs {sorted(target.kwargs)}; return them positionally, or use `mxcompile inspect`")
    out = _prepare_out(args.out)
    autocast = not args.fp32
    console.print(Text(f"mxcompile profile {target.spec}: {args.steps} timed steps per backend, "
                       f"bf16 autocast {'on' if autocast else 'off'}", style="bold"))
    profiles: dict[str, StepProfile] = {}
    with progress_bar(console) as progress:
        task = progress.add_task("rewrite report and per-layer error", total=2)
        report = explain_target(target.model, target.inputs, config, bf16=autocast)
        progress.advance(task)
        layers = linear_errors(target.model, target.inputs, config, report)
        progress.advance(task)
        with tempfile.TemporaryDirectory(prefix="mxcompile-profile-") as tmp:
            for backend in (REFERENCE, CANDIDATE):
                backend_task = progress.add_task(f"{backend:<8} starting", total=args.warmup)  # starts now
                profiles[backend] = _measure(args, backend, progress, backend_task, Path(tmp))
    plot_files, captions = _write_plots(out, profiles, layers)
    document = profile_document(
        target=target.spec, steps=args.steps, warmup=args.warmup, autocast_bf16=autocast, config=config,
        report=report, layers=layers, profiles=profiles, reference=REFERENCE, candidate=CANDIDATE,
        plots=plot_files, notes=_notes(profiles, layers),
    )
    (out / REPORT_JSON).write_text(json.dumps(document, indent=2) + "\n")
    (out / REPORT_HTML).write_text(render_html(document, captions))
    console.print(_summary_table(profiles, document["comparison"]))
    console.print(_operator_class_table(profiles))
    console.print(_layers_table(layers))
    for note in document["notes"][len(_BASE_NOTES):]:
        console.print(Text(f"Note: {note}", style="yellow"))
    console.print(f"Wrote {out / REPORT_HTML}, {out / REPORT_JSON} and {len(plot_files)} plots.")
    return 0
