"""`mxcompile demo`: train the built-in GPT on the offline Shakespeare corpus twice, with the
mxfp8 backend and with Inductor (both under bf16 autocast, same seed, same batches), then show
the rewrite summary (`mxcompile.explain`), the memory plan and the two final losses."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table
from rich.text import Text

from ..config import MXConfig
from ..examples import GPT_SIZES, CorpusNotFoundError, batches, gpt_factory, load_corpus, train, train_val_split
from .common import add_config_argument, explain_target, non_negative_int, positive_int, progress_bar
from .errors import CLIError
from .formatting import PERCENT, format_seconds, relative_change
from .options import changed_settings, config_from_overrides
from .views import memory_plan_view, rewrite_summary

# Default steps per size. "tiny" on a quiet 2-core CPU: 41 s with an empty Inductor cache (two
# cold compiles and torch.compile's one-time setup, 2026-12-06). "small" has not been timed.
DEFAULT_STEPS: Mapping[str, int] = MappingProxyType({"tiny": 150, "small": 40})
DEMO_SIZES = ("tiny", "small")
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEED = 0
FINAL_LOSS_WINDOW = 10  # the final loss is the mean of the last this-many training losses


@dataclass(frozen=True)
class Variant:
    """One side of the comparison: the torch.compile backend and how the tables name it."""

    backend: str
    label: str


VARIANTS = (
    Variant("mxfp8", "MXFP8 (backend='mxfp8', bf16 autocast)"),
    Variant("inductor", "bf16 (backend='inductor', bf16 autocast)"),
)


@dataclass
class RunResult:
    """Losses and step-end times of one training run."""

    variant: Variant
    losses: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # perf_counter() after each step
    start: float = 0.0

    @property
    def final_loss(self) -> float:
        window = self.losses[-FINAL_LOSS_WINDOW:]
        return sum(window) / len(window)

    @property
    def first_step_s(self) -> float:
        """Compilation plus the first step."""
        return self.step_ends[0] - self.start

    @property
    def median_step_s(self) -> float | None:
        gaps = [b - a for a, b in zip(self.step_ends, self.step_ends[1:])]
        return statistics.median(gaps) if gaps else None

    @property
    def total_s(self) -> float:
        return self.step_ends[-1] - self.start


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "demo", parents=[parent], help="train the built-in GPT in MXFP8 and in bf16, side by side",
        description="Train the built-in byte-level GPT on the offline Shakespeare corpus with "
                    "backend='mxfp8' and with the default backend (both bf16 autocast), then "
                    "compare the final losses and show what the rewrite did.",
    )
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="training steps per backend (default: " +
                             ", ".join(f"{k}: {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    parser.add_argument("--size", choices=DEMO_SIZES, default="tiny", help="GPT size (default: tiny)")
    parser.add_argument("--seed", type=non_negative_int, default=DEFAULT_SEED,
                        help="seeds the weights and the batch order (default: 0)")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE,
                        help=f"sequences per step (default: {DEFAULT_BATCH_SIZE})")
    add_config_argument(parser)
    parser.set_defaults(run=run)


def _training_data() -> torch.Tensor:
    try:
        train_data, _ = train_val_split(load_corpus())
    except CorpusNotFoundError as err:
        raise CLIError(str(err)) from err
    return train_data


def _train_variant(
    variant: Variant, args: argparse.Namespace, steps: int, config: MXConfig, data: torch.Tensor,
    progress: Progress, task: TaskID,
) -> tuple[RunResult, torch.nn.Module]:
    model, _ = gpt_factory(args.size, seed=args.seed)
    result = RunResult(variant, start=time.perf_counter())

    def on_step(step: int, loss: float) -> None:
        result.step_ends.append(time.perf_counter())
        result.losses.append(loss)
        progress.update(task, completed=step, description=f"{variant.backend:<8} loss {loss:.3f}")

    options = changed_settings(config) if variant.backend == "mxfp8" else {}
    train(model, steps=steps, batch_size=args.batch_size, seq_len=GPT_SIZES[args.size].block_size,
          seed=args.seed, compile_backend=variant.backend, compile_options=options or None,
          autocast_bf16=True, progress=on_step, data=data)
    return result, model


def _loss_table(results: list[RunResult]) -> Table:
    window = min(FINAL_LOSS_WINDOW, len(results[0].losses))
    table = Table(title=f"Training loss (final = mean of the last {window} steps)")
    for column, justify in (("run", "left"), ("first loss", "right"), ("final loss", "right"),
                            ("compile + step 1", "right"), ("median step", "right"), ("total", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for r in results:
        median = r.median_step_s
        table.add_row(r.variant.label, f"{r.losses[0]:.4f}", f"{r.final_loss:.4f}",
                      format_seconds(r.first_step_s), "n/a" if median is None else format_seconds(median),
                      format_seconds(r.total_s))
    return table


def _gap_line(mx: RunResult, ref: RunResult) -> Text:
    gap = relative_change(ref.final_loss, mx.final_loss)
    shown = "n/a" if gap is None else f"{gap * PERCENT:+.2f}%"
    return Text(f"Final-loss gap, MXFP8 vs bf16: {shown} "
                f"({mx.final_loss:.4f} vs {ref.final_loss:.4f})", style="bold")


def _warm_up_torch_compile() -> float:
    """Compile and run a one-op function with Inductor; its seconds. torch.compile's first
    compile in a process also pays a once-per-process setup (importing and initialising
    Inductor's code generation and its C++ toolchain: 10.8 s against 0.8 s for a second
    one-op compile on the 2-core CPU with an empty cache), which would otherwise be charged to
    whichever run compiles first."""
    start = time.perf_counter()
    torch.compile(torch.sin)(torch.ones(8))
    return time.perf_counter() - start


def run(args: argparse.Namespace, console: Console) -> int:
    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.size]
    config = config_from_overrides(args.config)
    data = _training_data()
    console.print(Text(f"mxcompile demo: GPT '{args.size}', {steps} steps per backend, batch "
                       f"{args.batch_size} x {GPT_SIZES[args.size].block_size} bytes, seed {args.seed} "
                       "(the first step of each run includes compilation)", style="bold"))
    with console.status("warming up torch.compile (once per process)"):
        warm_up_s = _warm_up_torch_compile()
    console.print(f"torch.compile's once-per-process setup: {format_seconds(warm_up_s)} (in neither run's time)")
    results: list[RunResult] = []
    models: dict[str, torch.nn.Module] = {}
    with progress_bar(console) as progress:
        tasks = [progress.add_task(f"{v.backend:<8} compiling…", total=steps, start=False) for v in VARIANTS]
        for variant, task in zip(VARIANTS, tasks):
            progress.start_task(task)  # its clock starts now, not when the first run started
            result, models[variant.backend] = _train_variant(variant, args, steps, config, data, progress, task)
            results.append(result)
    # The rewrite report of the trained MXFP8 model on the first training batch, under the same autocast.
    first_batch = next(batches(data, args.batch_size, GPT_SIZES[args.size].block_size, args.seed))[0]
    report = explain_target(models["mxfp8"], (first_batch,), config, bf16=True)
    console.print(rewrite_summary(report))
    console.print(memory_plan_view(report))
    console.print(_loss_table(results))
    console.print(_gap_line(results[0], results[1]))
    return 0
