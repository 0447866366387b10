"""The measuring subprocess of `mxcompile profile` (one per backend, so that each peak-memory
reading describes one step of one backend in a fresh process).

    python -m mxcompile.cli.measure_worker TARGET --backend mxfp8 --steps 10 --out step.json

Progress goes to stdout as JSON lines {"phase", "done", "total"}; the `StepProfile` is written
to --out as JSON. Errors: one line, the last on stderr, exit code 2 (target, options) or 1 (the run).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from ..profiling import profile_training_step
from .errors import EXIT_FAILURE, CLIError, one_line, root_cause
from .options import config_from_overrides
from .targets import load_target

BACKENDS = ("inductor", "mxfp8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mxcompile.cli.measure_worker")
    parser.add_argument("target")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--debug", action="store_true", help="print the traceback before the error line")
    return parser


def _report_progress(phase: str, done: int, total: int) -> None:
    print(json.dumps({"phase": phase, "done": done, "total": total}), flush=True)


def measure(args: argparse.Namespace) -> None:
    config = config_from_overrides(args.config)
    target = load_target(args.target)
    profile = profile_training_step(
        target.model, target.inputs, backend=args.backend, steps=args.steps, warmup=args.warmup,
        config=config, autocast_bf16=not args.fp32, on_step=_report_progress,
    )
    args.out.write_text(json.dumps(profile.to_dict()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        measure(args)
    except CLIError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    except Exception as err:  # the parent reports the last stderr line
        if args.debug:
            traceback.print_exc()
        print(one_line(root_cause(err)), file=sys.stderr)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
