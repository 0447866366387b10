"""Pieces shared by the commands: the console, the parent parser, target + config loading."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Callable, Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..config import MXConfig
from ..explain import explain
from ..report import Report
from .errors import EXIT_FAILURE, EXIT_USAGE, CLIError, is_mxcompile_value_error, one_line, root_cause
from .targets import TARGET_FORMS

PIPE_WIDTH = 140
COLUMNS_ENV = "COLUMNS"
CONFIG_HELP = ("override an MXConfig setting, e.g. --config exclude=lm_head --config hp_weight_grad=true "
               "(repeatable; values are Python literals, true/false, none, or strings)")


def make_console(stderr: bool = False) -> Console:
    """A rich console; output that is not a terminal (a pipe, a file) gets PIPE_WIDTH columns
    unless COLUMNS says otherwise, so that tables are not squeezed to 80."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and COLUMNS_ENV not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=PIPE_WIDTH)
    return console


def common_parent() -> argparse.ArgumentParser:
    """Options every command accepts after its name (also accepted before it)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    return parent


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small; give an integer >= {minimum}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="TARGET", help=f"what to compile: {TARGET_FORMS}")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", metavar="KEY=VALUE", default=[], help=CONFIG_HELP)


def progress_bar(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
        MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False,
    )


@contextlib.contextmanager
def bf16_autocast(enabled: bool) -> Iterator[None]:
    if enabled:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def explain_target(model: torch.nn.Module, inputs: tuple[Any, ...], config: MXConfig, *, bf16: bool,
                   kwargs: dict[str, Any] | None = None) -> Report:
    """mxcompile.explain, with a failure reported as one line: exit code 2 when mxcompile
    rejects a setting (ValueError), 1 otherwise."""
    try:
        with bf16_autocast(bf16):
            return explain(model, *inputs, config=config, **(kwargs or {}))
    except Exception as err:
        cause = root_cause(err)
        raise CLIError(
            f"running the model on its example inputs under mxcompile.explain raised "
            f"{one_line(cause)} (run with --debug for the traceback)",
            exit_code=EXIT_USAGE if is_mxcompile_value_error(cause) else EXIT_FAILURE,
        ) from err
