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

from .config import RECIPE_KEEPS_REASON_PREFIXES, OperandFormat
from .numerics.formats import E2M1
from .step_coverage import StepCoverage

# 2: the FP4 recipes (issue 48): `decision` "mxfp8" means converted, to the block format that
# the decision's new `format` names; operands carry their block format, scales and options.
REPORT_SCHEMA_VERSION = 2

CONVERTED = "mxfp8"  # the decision of a converted GEMM, whatever its block format (`GemmDecision.format`)
KEPT = "kept"
# The format family (`GemmDecision.format`) of every MXFP8 block format row (mxfp8_e4m3,
# mxfp8_e5m2, ..._block16); an FP4 row (E2M1 elements) is its own family (nvfp4, mxfp4).
MXFP8_FAMILY = "mxfp8"


def converted_phrase(converted: int, gemms: int, formats: dict[str, int], default: str = MXFP8_FAMILY) -> str:
    """'30 of 32 GEMMs in MXFP8' (one format family, or none converted: `default`'s), or
    '24 of 38 GEMMs converted (NVFP4 21, MXFP8 3)' with `formats` (family -> converted GEMMs,
    `Report.converted_by_format`) when there are several."""
    if len(formats) <= 1:
        return f"{converted} of {gemms} GEMMs in {next(iter(formats), default).upper()}"
    shares = ", ".join(f"{family.upper()} {n}" for family, n in formats.items())
    return f"{converted} of {gemms} GEMMs converted ({shares})"


@dataclass(frozen=True)
class OperandQuantization:
    """How one GEMM operand is quantized: along which axis of which shape, in which block
    format (a row of `numerics.BLOCK_FORMATS`), with which scales and options.

    `elem`: the element format of an MXFP8 operand (`e4m3`, `e5m2`); of an FP4 operand, its
    format with its options as `OperandFormat.describe` writes it (`nvfp4 2d`, `nvfp4 sr rht`)."""

    name: str  # the graph node of the operand
    shape: tuple[int, ...]
    axis: int
    elem: str
    format: str = ""  # the block format row, e.g. "mxfp8_e4m3", "nvfp4", "mxfp4"
    element: str = ""  # its element format: "e4m3", "e5m2" or "e2m1"
    block_size: int = 0  # elements per block scale along `axis`
    scale: str = ""  # the block scale's format: "e8m0" (MX) or "e4m3" (NVFP4)
    tensor_scale: bool = False  # an fp32 scale per tensor besides (NVFP4)
    block_2d: bool = False  # 16x16 blocks (NVFP4 weights): W and Wt quantize to the same values
    stochastic: bool = False  # stochastic rounding (NVFP4 gradients), else round to nearest even
    rht: bool = False  # random Hadamard transform along `axis` before quantization

    @classmethod
    def of(cls, name: str, shape: tuple[int, ...], axis: int, fmt: OperandFormat) -> "OperandQuantization":
        """The row of an operand quantized in `fmt`."""
        row = fmt.block_format
        elem = fmt.describe() if fmt.is_fp4 else row.elem.name
        return cls(name, tuple(shape), axis, elem, format=row.name, element=row.elem.name,
                   block_size=row.block_size, scale=row.scale_format.value, tensor_scale=row.tensor_scale,
                   block_2d=fmt.block_2d, stochastic=fmt.stochastic, rht=fmt.rht)

    @property
    def family(self) -> str:
        """"nvfp4", "mxfp4" or "mxfp8" (every MXFP8 row, whatever its element or block size)."""
        return self.format if self.element == E2M1.name else MXFP8_FAMILY

    def describe(self) -> str:
        """The format in a few words: family, element/block size/scale format, then its options,
        e.g. 'nvfp4 e2m1/16/E4M3, 2-D 16x16', 'nvfp4 e2m1/16/E4M3, stochastic, RHT' or
        'mxfp8 e4m3/32/E8M0' (NVFP4's fp32 tensor scale is implied: `tensor_scale`)."""
        if not self.format:
            return self.elem
        options = [text for text, on in (("2-D 16x16", self.block_2d), ("stochastic", self.stochastic),
                                         ("RHT", self.rht)) if on]
        return ", ".join([f"{self.family} {self.element}/{self.block_size}/{self.scale.upper()}", *options])


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

    @property
    def format(self) -> str:
        """The block format family a converted GEMM runs in ("nvfp4", "mxfp4", "mxfp8"); ""
        when kept. An FP4 GEMM's two operands share its family (`passes/mx_gemm.py`)."""
        if self.decision != CONVERTED:
            return ""
        return self.operands[0].family if self.operands else MXFP8_FAMILY


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
    # The quantized operands among them, one row each (cost.graph_costs.saved_quantized_operands:
    # format, bytes, bf16 bytes of the operand, ratio); `saved_by_format` sums them per format.
    saved_quantized: list[dict[str, Any]] = field(default_factory=list)
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
    def gemm_flops_kept_by_recipe(self) -> int:
        """GEMM FLOPs an FP4 recipe keeps in high precision by design (its high_precision_layers,
        and attention under its default attention="off")."""
        return sum(d.flops for d in self.decisions
                   if d.decision != CONVERTED and d.reason.startswith(RECIPE_KEEPS_REASON_PREFIXES))

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
            "converted_by_format": self.converted_by_format(),
            "saved_activation_bytes_before": self.saved_bytes_before,
            "saved_activation_bytes_after": self.saved_bytes_after,
            "saved_quantized_by_format": self.saved_by_format(),
            # None until the step is measured (after the step that follows its compile step)
            "step_mx_flop_fraction": self.step_coverage.mx_flop_fraction if self.step_coverage else None,
        }

    def saved_by_format(self) -> dict[str, dict[str, Any]]:
        """The saved quantized operands per format ("nvfp4", "mxfp4"; MXFP8's element format
        "e4m3"): how many, their bytes (data, scales, tensor scales), the bytes their operands
        take in bf16, and the ratio of the two (`to_bf16`)."""
        totals: dict[str, dict[str, Any]] = {}
        for row in self.saved_quantized:
            entry = totals.setdefault(row["format"], {"operands": 0, "bytes": 0, "bf16_bytes": 0})
            entry["operands"] += 1
            entry["bytes"] += row["bytes"]
            entry["bf16_bytes"] += row["bf16_bytes"]
        for entry in totals.values():
            entry["to_bf16"] = entry["bytes"] / entry["bf16_bytes"] if entry["bf16_bytes"] else None
        return totals

    def kept_flops_by_reason(self) -> list[tuple[str, int, int]]:
        """(reason, kept GEMM FLOPs, kept GEMM count) per distinct reason, most FLOPs first."""
        flops: dict[str, int] = collections.Counter()
        counts: dict[str, int] = collections.Counter()
        for d in self.decisions:
            if d.decision == KEPT:
                flops[d.reason] += d.flops
                counts[d.reason] += 1
        return sorted(((r, flops[r], counts[r]) for r in flops), key=lambda row: -row[1])

    def top_kept_reasons(self, count: int, *, beyond_recipe: bool = False) -> list[str]:
        """The `count` reasons that kept the most GEMM FLOPs, each with its GEMMs and FLOP share;
        `beyond_recipe`: leaving out what an FP4 recipe keeps by design (`gemm_flops_kept_by_recipe`)."""
        total = self.gemm_flops_total or 1
        rows = [row for row in self.kept_flops_by_reason()
                if not (beyond_recipe and row[0].startswith(RECIPE_KEEPS_REASON_PREFIXES))]
        return [f"{reason} ({n} GEMM{'s' if n > 1 else ''}, {flops / total:.1%} of GEMM FLOPs)"
                for reason, flops, n in rows[:count]]

    def converted_by_format(self) -> dict[str, int]:
        """Converted GEMMs per block format family ("nvfp4", "mxfp4", "mxfp8"), most first."""
        counts = collections.Counter(d.format for d in self.decisions if d.decision == CONVERTED)
        return dict(counts.most_common())

    def summary(self) -> str:
        """One line: GEMMs and GEMM FLOPs converted, in which formats (and under which recipe, for
        an FP4 one), and how many GEMMs were kept."""
        t = self.totals()
        recipe = str(self.config.get("recipe") or MXFP8_FAMILY)
        if not t["gemms"]:
            return f"no GEMMs in this graph: nothing to run in {recipe.upper()}"
        graphs = "+".join(dict.fromkeys(d.graph for d in self.decisions))
        converted = converted_phrase(t["converted"], t["gemms"], t["converted_by_format"], recipe)
        line = (f"{graphs}: {converted}, "
                f"{t['converted_flop_fraction']:.1%} of {t['gemm_flops']:.3g} GEMM FLOPs; {t['kept']} kept")
        if recipe != MXFP8_FAMILY:
            line += f" ({recipe} recipe)"
        return line + (f"; {self.step_coverage.summary()}" if self.step_coverage else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "config": self.config,
            "totals": self.totals(),
            "decisions": [{**asdict(d), "format": d.format} for d in self.decisions],
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
