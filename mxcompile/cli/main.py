"""Entry point of the `mxcompile` console script."""

from __future__ import annotations

import argparse
import sys

from .._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxcompile",
        description="MXFP8 training through torch.compile(model, backend='mxfp8').",
    )
    parser.add_argument("--version", action="version", version=f"mxcompile {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
