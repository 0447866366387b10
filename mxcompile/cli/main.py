"""Entry point of the `mxcompile` console script (also `python -m mxcompile`).

    mxcompile demo      train the built-in GPT in MXFP8 and bf16 side by side
    mxcompile inspect   show what the mxfp8 backend does to a model
    mxcompile profile   time, memory and numerical error of mxfp8 against Inductor
    mxcompile doctor    check this installation: versions, GPU, kernel paths, corpus, plotting

Errors about the command line or the target print one line and exit with code 2; a failure
inside the run prints one line and exits with code 1. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .._version import __version__
from . import demo, doctor, inspect_cmd, profile_cmd
from .common import common_parent, make_console
from .errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, CLIError, one_line, root_cause

COMMANDS: tuple[Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None], ...] = (
    demo.add_parser, inspect_cmd.add_parser, profile_cmd.add_parser, doctor.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxcompile",
        description="MXFP8 training through torch.compile(model, backend='mxfp8').",
    )
    parser.add_argument("--version", action="version", version=f"mxcompile {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    parent = common_parent()
    for add_parser in COMMANDS:
        add_parser(subparsers, parent)
    return parser


def _report_error(message: str) -> None:
    print(f"mxcompile: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    try:
        return args.run(args, make_console())
    except CLIError as err:
        if args.debug:
            raise
        _report_error(str(err))
        return err.exit_code
    except KeyboardInterrupt:
        _report_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as err:  # anything else is a failure inside the run: one line, or --debug
        if args.debug:
            raise
        _report_error(f"{args.command} failed: {one_line(root_cause(err))} (run with --debug for the traceback)")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
