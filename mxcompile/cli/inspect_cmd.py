"""`mxcompile inspect TARGET [--backend mxfp8|nvfp4|mxfp4]`: what that backend does to a model,
from `mxcompile.explain`."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.text import Text

from .common import add_config_argument, add_target_argument, explain_target
from .kernels import kernels_view
from ..config import Recipe
from .options import changed_settings, config_from_overrides, fp4_settings_line
from .targets import load_target
from .views import GRAPH_CHOICES, report_views

DEFAULT_GRAPH = "both"
BACKENDS = tuple(recipe.value for recipe in Recipe)  # backend="mxfp8", "nvfp4", "mxfp4": one per recipe


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "inspect", parents=[parent], help="show the rewritten graphs and every GEMM decision",
        description="Run the pipeline of a backend (mxfp8, or an FP4 recipe: nvfp4, mxfp4) on TARGET "
                    "(no lowering, no training) and show the graphs before and after the rewrite, every "
                    "GEMM/attention decision with its operands' formats, totals and the memory plan.",
    )
    add_target_argument(parser)
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="the torch.compile backend (recipe) to inspect: its defaults, then --config on top "
                             "(default: mxfp8, or the recipe a --config recipe=... names)")
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
    config = config_from_overrides(args.config, args.backend)
    target = load_target(args.target)
    report = explain_target(target.model, target.inputs, config, bf16=args.bf16, kwargs=target.kwargs)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
        return 0
    changed = changed_settings(config)
    settings = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "defaults"
    console.print(Text(f"mxcompile inspect {target.spec} — backend={config.recipe.value!r}, MXConfig: {settings}",
                       style="bold"))
    recipe = fp4_settings_line(config)
    if recipe is not None:
        console.print(Text(recipe))
    console.print(report_views(report, args.graph))
    if args.kernels:
        console.print(kernels_view())
    return 0
