"""`mxcompile inspect TARGET`: what the mxfp8 backend does to a model, from `mxcompile.explain`."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.text import Text

from .common import add_config_argument, add_target_argument, explain_target
from .kernels import kernels_view
from .options import changed_settings, config_from_overrides
from .targets import load_target
from .views import GRAPH_CHOICES, report_views

DEFAULT_GRAPH = "both"


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "inspect", parents=[parent], help="show the rewritten graphs and every GEMM decision",
        description="Run the mxfp8 pipeline on TARGET (no lowering, no training) and show the "
                    "graphs before and after the rewrite, every GEMM/attention decision, totals "
                    "and the memory plan.",
    )
    add_target_argument(parser)
    parser.add_argument("--json", action="store_true",
                        help="print only the report as JSON (schema: mxcompile/cli/SCHEMA.md)")
    parser.add_argument("--graph", choices=GRAPH_CHOICES, default=DEFAULT_GRAPH,
                        help=f"which graphs to print (default: {DEFAULT_GRAPH})")
    parser.add_argument("--kernels", action="store_true", help="show rendered Triton kernel sources")
    parser.add_argument("--bf16", action="store_true",
                        help="trace under torch.autocast(bfloat16), as a bf16-autocast training step runs")
    add_config_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    config = config_from_overrides(args.config)
    target = load_target(args.target)
    report = explain_target(target.model, target.inputs, config, bf16=args.bf16, kwargs=target.kwargs)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
        return 0
    changed = changed_settings(config)
    settings = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "defaults"
    console.print(Text(f"mxcompile inspect {target.spec} — MXConfig: {settings}", style="bold"))
    console.print(report_views(report, args.graph))
    if args.kernels:
        console.print(kernels_view())
    return 0
