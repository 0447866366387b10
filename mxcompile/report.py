"""Decision records and the `Report` that `mxcompile.explain`, the CLI and the tests read.

Passes record what they decided and why; nothing here computes a decision. `to_dict()` gives
the JSON form, versioned by `REPORT_SCHEMA_VERSION`.
"""

from __future__ import annotations

import collections
import json
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from .step_coverage import StepCoverage

REPORT_SCHEMA_VERSION = 1

CONVERTED = "mxfp8"
KEPT = "kept"


@dataclass(frozen=True)
class OperandQuantization:
    """How one GEMM operand is quantized: along which axis of which shape, in which format."""

    name: str  # the graph node of the operand
    shape: tuple[int, ...]
    axis: int
    elem: str


@dataclass(frozen=True)
class GemmDecision:
    """One GEMM (or attention) node of a forward or backward graph and what was done with it."""

    graph: str  # "forward", "backward" or "inference"
    node: str
    op: str
    kind: str  # "output", "input_grad", "weight_grad", "batched" or "attention"
    shapes: tuple[tuple[int, ...], ...]
    flops: int
    module: str
    decision: str  # CONVERTED or KEPT
    reason: str
    operands: tuple[OperandQuantization, ...] = ()


@dataclass(frozen=True)
class PassResult:
    """What one pass of the pipeline changed in one graph."""

    name: str
    graph: str
    nodes_added: int
    nodes_removed: int
    decisions: tuple[GemmDecision, ...] = ()


@dataclass
class GraphSnapshot:
    """Readable text of a graph before and after the rewrite (for `mxcompile inspect`)."""

    name: str
    before: str
    after: str


@dataclass
class Report:
    """Everything the backend decided for one compiled graph (or several, after graph breaks)."""

    config: dict[str, Any]
    decisions: list[GemmDecision] = field(default_factory=list)
    passes: list[PassResult] = field(default_factory=list)
    saved_bytes_before: int = 0  # bytes the forward saves for the backward without the rewrite
    saved_bytes_after: int = 0  # ... and with it
    saved_tensors_after: list[dict[str, Any]] = field(default_factory=list)
    graphs: list[GraphSnapshot] = field(default_factory=list)
    memory_plan: dict[str, Any] | None = None
    fallbacks: list[str] = field(default_factory=list)
    all_gather: dict[str, str] = field(default_factory=dict)  # FSDP2 weight -> all-gather decision
    # The first training step after this graph compiled, measured at run time (step_coverage.py): the
    # share of all its GEMM FLOPs in MX, eager GEMMs outside every compiled graph included.
    step_coverage: StepCoverage | None = None

    def add_pass_result(self, result: PassResult) -> None:
        self.passes.append(result)
        self.decisions.extend(result.decisions)

    @property
    def gemm_flops_total(self) -> int:
        return sum(d.flops for d in self.decisions)

    @property
    def gemm_flops_converted(self) -> int:
        return self.gemm_flops_converted_of(self.decisions)

    @staticmethod
    def gemm_flops_converted_of(decisions: Iterable[GemmDecision]) -> int:
        return sum(d.flops for d in decisions if d.decision == CONVERTED)

    @property
    def converted_flop_fraction(self) -> float:
        total = self.gemm_flops_total
        return self.gemm_flops_converted / total if total else 0.0

    def totals(self) -> dict[str, Any]:
        return {
            "gemms": sum(d.decision in (CONVERTED, KEPT) for d in self.decisions),  # not smooth_swiglu's rows
            "converted": sum(d.decision == CONVERTED for d in self.decisions),
            "kept": sum(d.decision == KEPT for d in self.decisions),
            "gemm_flops": self.gemm_flops_total,
            "gemm_flops_converted": self.gemm_flops_converted,
            "converted_flop_fraction": self.converted_flop_fraction,
            "saved_activation_bytes_before": self.saved_bytes_before,
            "saved_activation_bytes_after": self.saved_bytes_after,
            # None until the step is measured (after the step that follows its compile step)
            "step_mx_flop_fraction": self.step_coverage.mx_flop_fraction if self.step_coverage else None,
        }

    def kept_flops_by_reason(self) -> list[tuple[str, int, int]]:
        """(reason, kept GEMM FLOPs, kept GEMM count) per distinct reason, most FLOPs first."""
        flops: dict[str, int] = collections.Counter()
        counts: dict[str, int] = collections.Counter()
        for d in self.decisions:
            if d.decision == KEPT:
                flops[d.reason] += d.flops
                counts[d.reason] += 1
        return sorted(((r, flops[r], counts[r]) for r in flops), key=lambda row: -row[1])

    def top_kept_reasons(self, count: int) -> list[str]:
        """The `count` reasons that kept the most GEMM FLOPs, each with its GEMMs and FLOP share."""
        total = self.gemm_flops_total or 1
        return [f"{reason} ({n} GEMM{'s' if n > 1 else ''}, {flops / total:.1%} of GEMM FLOPs)"
                for reason, flops, n in self.kept_flops_by_reason()[:count]]

    def summary(self) -> str:
        """One line: GEMMs and GEMM FLOPs converted, and how many GEMMs were kept."""
        t = self.totals()
        if not t["gemms"]:
            return "no GEMMs in this graph: nothing to run in MXFP8"
        graphs = "+".join(dict.fromkeys(d.graph for d in self.decisions))
        line = (f"{graphs}: {t['converted']} of {t['gemms']} GEMMs in MXFP8, "
                f"{t['converted_flop_fraction']:.1%} of {t['gemm_flops']:.3g} GEMM FLOPs; {t['kept']} kept")
        return line + (f"; {self.step_coverage.summary()}" if self.step_coverage else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "config": self.config,
            "totals": self.totals(),
            "decisions": [asdict(d) for d in self.decisions],
            "passes": [
                {k: v for k, v in asdict(p).items() if k != "decisions"} for p in self.passes
            ],
            "saved_tensors": self.saved_tensors_after,
            "graphs": [asdict(g) for g in self.graphs],
            "memory_plan": self.memory_plan,
            "fallbacks": list(self.fallbacks),
            "all_gather": dict(self.all_gather),
            "step_coverage": self.step_coverage.to_dict() if self.step_coverage else None,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)


class RecordedGraph:
    """One compiled graph in a ReportHistory: its report and weak references to the parameters
    and buffers it ran with. One graph can serve many modules (a block compiled with
    `block.compile()` is one graph for every block of its shape, each call passing that block's
    parameters): `note_call` adds each new module's parameters, so that `report_of` finds the
    report from every module that ran the graph."""

    def __init__(self, report: "Report", tensors: Iterable[Any]) -> None:
        self.report = report
        self.measured = False  # whether a step it ran in was measured (step_coverage.StepMonitor)
        # id -> weak reference, checked by identity (tensors' == is elementwise, so no WeakSet)
        self._tensors: dict[int, weakref.ref] = {}
        self._add(t for t in tensors if isinstance(t, torch.Tensor))

    def _add(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._tensors[id(t)] = weakref.ref(t)

    def _holds(self, t: torch.Tensor) -> bool:
        ref = self._tensors.get(id(t))
        return ref is not None and ref() is t

    def note_call(self, args: Iterable[Any]) -> None:
        """Note the parameters of one call of the graph. A call whose first parameter is known
        returns after that one look-up (the graph runs every step)."""
        params = (a for a in args if isinstance(a, torch.nn.Parameter))
        first = next(params, None)
        if first is None or self._holds(first):
            return
        self._add((first, *params))

    def ran_with_any(self, tensors: Iterable[torch.Tensor]) -> bool:
        return any(self._holds(t) for t in tensors)


class ReportHistory:
    """The reports of the last `capacity` graphs the backend compiled, oldest first.

    Bounded on purpose: a long run that keeps recompiling (new shapes, new models) holds at most
    `capacity` reports; older ones are dropped. Each report remembers the parameters and buffers
    its graph ran with by weak reference only, so no model is kept alive by this, and
    `of_module` finds a model's reports by the identity of those tensors.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._entries: collections.deque[RecordedGraph] = collections.deque(maxlen=capacity)
        self._recorded = 0

    def record(self, report: Report, tensors: Iterable[Any]) -> tuple[int, RecordedGraph]:
        """Keep `report` with weak references to the tensors its graph took; returns its index
        among all reports recorded (0, 1, ...; dropped ones count too) and its entry."""
        entry = RecordedGraph(report, tensors)
        self._entries.append(entry)
        self._recorded += 1
        return self._recorded - 1, entry

    def all(self) -> list[Report]:
        return [entry.report for entry in self._entries]

    def of_module(self, module: torch.nn.Module, also: Iterable[torch.Tensor] = ()) -> list[Report]:
        """The reports of the graphs that ran with a parameter or buffer of `module` (or one of
        `also`: FSDP2's unsharded parameters, say)."""
        owned = [*module.parameters(), *module.buffers(), *also]
        return [entry.report for entry in self._entries if entry.ran_with_any(owned)]

    def clear(self) -> None:
        """Forget every report; the numbering of the next ones starts again at 0."""
        self._entries.clear()
        self._recorded = 0
