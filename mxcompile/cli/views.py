"""Rich renderables of a `Report`: decisions, totals, saved activations, memory plan, graphs.

Everything shown is read from the report; nothing is decided here.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..config import Recipe
from ..report import CONVERTED, KEPT, GemmDecision, GraphSnapshot, Report
from .formatting import format_bytes, format_change, format_duration, format_flops, format_percent, format_shapes

MX_OP_MARKER = "torch.ops.mxcompile."  # graph lines calling mxcompile ops are highlighted
SYNTAX_THEME = "ansi_dark"
GRAPH_CHOICES = ("forward", "backward", "both", "none")
# Which snapshot names each --graph choice shows; an inference graph is a forward graph.
GRAPH_SELECTION = {
    "forward": ("forward", "inference"),
    "backward": ("backward",),
    "both": ("forward", "backward", "inference"),
    "none": (),
}
NO_MEMORY_PLAN = "no memory budget set"
PLAN_MAX_DEPTH = 2  # nested sections of the memory plan shown before falling back to JSON
BYTES_SUFFIX = "bytes"
FORMATS_COLUMN = "operand formats (lhs, rhs)"
FORMATS_MAX_WIDTH = 36  # one operand's format per line ('nvfp4 e2m1/16/E4M3, stochastic, RHT'): the reason keeps the room
SECONDS_SUFFIX = "_s"


def decision_style(decision: str) -> str:
    return "green" if decision == CONVERTED else "yellow"


def decision_label(decision: GemmDecision) -> str:
    """What the decision column shows: the block format a converted GEMM runs in, or 'kept'."""
    return decision.format or decision.decision


def operand_formats(decision: GemmDecision) -> str:
    """Each operand's format (`OperandQuantization.describe`), one line each (lhs, then rhs);
    '—' when kept."""
    return "\n".join(o.describe() for o in decision.operands) or "—"


def decisions_table(report: Report) -> Table:
    """Every decision with its reason; the operand-formats column only when the operands'
    formats differ within the report (an FP4 recipe's roles, MXFP8 with e5m2 gradients): one
    format everywhere (plain MXFP8) is in the totals and would only narrow the reasons."""
    formats = {o.describe() for d in report.decisions for o in d.operands}
    columns = [("graph", "left", False), ("node", "left", False), ("kind", "left", False), ("module", "left", False),
               ("shapes", "left", False), ("FLOPs", "right", False), ("decision", "left", False)]
    columns += [(FORMATS_COLUMN, "left", True)] if len(formats) > 1 else []
    columns += [("reason", "left", True)]
    table = Table(title="GEMM and attention decisions", show_lines=False, expand=False)
    for column, justify, wrap in columns:
        table.add_column(column, justify=justify, no_wrap=not wrap, overflow="fold",  # type: ignore[arg-type]
                         max_width=FORMATS_MAX_WIDTH if column == FORMATS_COLUMN else None)
    for d in report.decisions:
        cells = [d.graph, d.node, d.kind, d.module or "—", format_shapes(d.shapes), format_flops(d.flops),
                 Text(decision_label(d), style=decision_style(d.decision))]
        cells += [operand_formats(d)] if len(formats) > 1 else []
        table.add_row(*cells, d.reason)
    if not report.decisions:
        table.add_row(*["—"] * (len(columns) - 1), "no GEMM or attention node found")
    return table


def totals_table(report: Report) -> Table:
    totals = report.totals()
    table = Table(title="Totals", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    by_format = ", ".join(f"{family} {n}" for family, n in totals["converted_by_format"].items())
    table.add_row("GEMMs converted", f"{totals['converted']} of {totals['gemms']} ({totals['kept']} kept)"
                  + (f": {by_format}" if by_format else ""))
    table.add_row("GEMM FLOPs converted",
                  f"{format_flops(totals['gemm_flops_converted'])} of {format_flops(totals['gemm_flops'])} "
                  f"({format_percent(totals['converted_flop_fraction'])})")
    before, after = totals["saved_activation_bytes_before"], totals["saved_activation_bytes_after"]
    table.add_row("saved activations (forward → backward)",
                  f"{format_bytes(before)} → {format_bytes(after)} ({format_change(before, after)})")
    if report.fallbacks:
        table.add_row("graphs left unrewritten (fallback)", str(len(report.fallbacks)))
    return table


def rewrite_summary(report: Report) -> Table:
    """The short summary the demo prints."""
    table = totals_table(report)
    table.title = f"{str(report.config.get('recipe', 'mxfp8')).upper()} rewrite summary"
    return table


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _is_flat(value: Any) -> bool:
    """A scalar, or a list / dict of scalars: fits in one table cell."""
    if isinstance(value, (list, tuple)):
        return all(_is_scalar(v) for v in value)
    if isinstance(value, dict):
        return all(_is_scalar(v) for v in value.values())
    return _is_scalar(value)


def plan_cell(key: str, value: Any) -> str:
    """One memory-plan value as text; units follow the key's suffix (…bytes, …_s)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, (int, float)):
        if key.endswith(BYTES_SUFFIX):
            return format_bytes(value)
        if key.endswith(SECONDS_SUFFIX):
            return format_duration(value)
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(value, dict) and _is_flat(value):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple)) and _is_flat(value):
        return ", ".join(str(v) for v in value) or "—"
    return json.dumps(value, default=str)


def _rows_table(title: str, rows: list[dict[str, Any]]) -> Table:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(plan_cell(c, row.get(c)) if c in row else "" for c in columns))
    return table


def _plan_renderables(plan: dict[str, Any], title: str, depth: int = 0) -> list[RenderableType]:
    """A key/value table of the plan's flat entries, then one table (or nested section) per list
    of records or nested mapping. A nested record equal to its parent is not shown twice."""
    summary = Table(title=title, show_header=False)
    summary.add_column("key")
    summary.add_column("value", overflow="fold")
    nested: list[RenderableType] = []
    for key, value in plan.items():
        records = isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
        if records and all(_is_flat(v) for row in value for v in row.values()):
            nested.append(_rows_table(f"{title}: {key}", value))
        elif records and depth < PLAN_MAX_DEPTH:
            parent = {k: v for k, v in plan.items() if k != key}
            for i, row in enumerate(value):
                if row != parent:
                    nested.extend(_plan_renderables(row, f"{title}: {key}[{i}]", depth + 1))
        elif isinstance(value, dict) and not _is_flat(value) and depth < PLAN_MAX_DEPTH:
            nested.extend(_plan_renderables(value, f"{title}: {key}", depth + 1))
        else:
            summary.add_row(str(key), plan_cell(str(key), value))
    return [summary, *nested]


def memory_plan_view(report: Report) -> RenderableType:
    plan = report.memory_plan
    if plan is None:
        budget = report.config.get("memory_budget")
        if budget is None:
            return Text(f"Memory plan: {NO_MEMORY_PLAN}.")
        return Text(f"Memory plan: memory_budget={budget!r} is set, but the report carries no plan.")
    if not isinstance(plan, dict):
        return Text(f"Memory plan: {plan_cell('plan', plan)}")
    return Group(*_plan_renderables(plan, "Memory plan"))


def fallbacks_view(report: Report) -> RenderableType | None:
    if not report.fallbacks:
        return None
    return Panel("\n".join(report.fallbacks), title="Fallbacks (graphs run without the MXFP8 rewrite)",
                 border_style="red")


def high_precision_view(report: Report) -> Table | None:
    """Under an FP4 recipe: each module with GEMMs kept in high precision, which of its GEMMs,
    and why (the recipe's high_precision_layers rule, or any other reason the passes gave)."""
    if report.config.get("recipe", Recipe.MXFP8.value) == Recipe.MXFP8.value:
        return None
    kept: dict[tuple[str, str], list[str]] = {}
    for d in report.decisions:
        if d.decision == KEPT:
            kept.setdefault((d.module or "—", d.reason), []).append(f"{d.graph} {d.kind}")
    if not kept:
        return None
    table = Table(title=f"Kept in high precision under the {report.config['recipe']} recipe", title_justify="left")
    table.add_column("module")
    table.add_column("GEMMs", overflow="fold")
    table.add_column("reason", overflow="fold")
    for (module, reason), gemms in kept.items():
        table.add_row(module, ", ".join(gemms), reason)
    return table


def all_gather_view(report: Report) -> Table | None:
    """The FSDP2 all-gather decision of every sharded nn.Linear weight, with its reason."""
    if not report.all_gather:
        return None
    table = Table(title="FSDP2 weight all-gather", title_justify="left")
    table.add_column("weight")
    table.add_column("decision and reason")
    for weight, decision in report.all_gather.items():
        table.add_row(weight, decision)
    return table


def marked_lines(code: str, marker: str = MX_OP_MARKER) -> set[int]:
    """1-based numbers of the lines of `code` that contain `marker`."""
    return {i for i, line in enumerate(code.splitlines(), start=1) if marker in line}


def graph_code(code: str, title: str, *, mark: bool) -> Panel:
    lines = marked_lines(code) if mark else set()
    syntax = Syntax(code, "python", theme=SYNTAX_THEME, line_numbers=True, highlight_lines=lines,
                    word_wrap=True)
    plural = "" if len(lines) == 1 else "s"
    subtitle = f"{len(lines)} line{plural} with mxcompile ops (❱)" if mark else None
    return Panel(syntax, title=title, subtitle=subtitle, title_align="left")


def selected_graphs(report: Report, choice: str) -> list[GraphSnapshot]:
    names = GRAPH_SELECTION[choice]
    return [g for g in report.graphs if g.name in names]


def graph_views(report: Report, choice: str) -> Iterable[RenderableType]:
    for snapshot in selected_graphs(report, choice):
        yield graph_code(snapshot.before, f"{snapshot.name} graph — before the rewrite", mark=False)
        yield graph_code(snapshot.after, f"{snapshot.name} graph — after the rewrite", mark=True)


def report_views(report: Report, graphs: str) -> Group:
    parts: list[RenderableType] = list(graph_views(report, graphs))
    parts += [decisions_table(report), totals_table(report)]
    parts += [view for view in (high_precision_view(report), fallbacks_view(report), all_gather_view(report))
              if view is not None]
    parts.append(memory_plan_view(report))
    return Group(*parts)
