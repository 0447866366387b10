"""Decision records and the `Report` that `mxcompile.explain`, the CLI and the tests read.

Passes record what they decided and why; nothing here computes a decision. `to_dict()` gives
the JSON form, versioned by `REPORT_SCHEMA_VERSION`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

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

    def add_pass_result(self, result: PassResult) -> None:
        self.passes.append(result)
        self.decisions.extend(result.decisions)

    @property
    def gemm_flops_total(self) -> int:
        return sum(d.flops for d in self.decisions)

    @property
    def gemm_flops_converted(self) -> int:
        return sum(d.flops for d in self.decisions if d.decision == CONVERTED)

    @property
    def converted_flop_fraction(self) -> float:
        total = self.gemm_flops_total
        return self.gemm_flops_converted / total if total else 0.0

    def totals(self) -> dict[str, Any]:
        return {
            "gemms": len(self.decisions),
            "converted": sum(d.decision == CONVERTED for d in self.decisions),
            "kept": sum(d.decision == KEPT for d in self.decisions),
            "gemm_flops": self.gemm_flops_total,
            "gemm_flops_converted": self.gemm_flops_converted,
            "converted_flop_fraction": self.converted_flop_fraction,
            "saved_activation_bytes_before": self.saved_bytes_before,
            "saved_activation_bytes_after": self.saved_bytes_after,
        }

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
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)
