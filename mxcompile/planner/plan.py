"""The planner's output: one decision per saved tensor, with its bytes, cost and reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory import KEEP_CODE, OFFLOAD_CODE, RECOMPUTE_CODE, Evaluation, Tables, evaluate_codes
from .problem import DECISIONS, KEEP, format_bytes

_CODE_NAMES = {KEEP_CODE: DECISIONS[0], RECOMPUTE_CODE: DECISIONS[1], OFFLOAD_CODE: DECISIONS[2]}
_MS_PER_S = 1e3


@dataclass(frozen=True)
class TensorDecision:
    """One saved tensor's decision.

    Attributes:
        name: the tensor.
        decision: "keep", "recompute" or "offload".
        nbytes: its device bytes.
        cost_s: time its decision adds: its recompute cost, or its exposed copy time; 0 for
            keep. (Transient chain recomputes and link serialisation are in the plan totals.)
        reason: human-readable justification.
    """

    name: str
    decision: str
    nbytes: int
    cost_s: float
    reason: str


@dataclass(frozen=True)
class Plan:
    """A complete plan and its predicted memory and time (the model of :mod:`.memory`).

    Attributes:
        decisions: one per saved tensor, in problem order.
        budget_bytes: the budget planned for.
        peak_bytes: predicted peak memory (<= budget_bytes).
        binding_step: the step index where the peak occurs (first one on ties).
        binding_step_name: that step's name.
        memory_curve: predicted bytes resident at each step.
        step_time_s: predicted step time: base_time_s + extra_time_s.
        base_time_s: sum of step compute times (keep-everything time).
        extra_time_s: recompute_time_s + transfer_exposed_s.
        recompute_time_s: recomputation, including transient chain recomputes.
        transfer_exposed_s: host-copy time not hidden under compute.
        solver: "ilp" or "heuristic".
        optimal: True when proven optimal (ILP solved to optimality, or keep-everything fits).
        status: how the solver ended, in words.
    """

    decisions: tuple[TensorDecision, ...]
    budget_bytes: int
    peak_bytes: int
    binding_step: int
    binding_step_name: str
    memory_curve: tuple[int, ...]
    step_time_s: float
    base_time_s: float
    extra_time_s: float
    recompute_time_s: float
    transfer_exposed_s: float
    solver: str
    optimal: bool
    status: str

    def assignment(self) -> dict[str, str]:
        """name -> decision, the input :func:`mxcompile.planner.memory.evaluate` takes."""
        return {d.name: d.decision for d in self.decisions}

    def decision(self, name: str) -> TensorDecision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(f"no saved tensor named {name!r} in this plan")

    def summary(self) -> str:
        """A few lines for logs: totals, then every tensor that is not kept."""
        counts = {kind: sum(1 for d in self.decisions if d.decision == kind) for kind in DECISIONS}
        lines = [
            f"memory plan ({self.solver}, {self.status}): peak {format_bytes(self.peak_bytes)} of "
            f"{format_bytes(self.budget_bytes)} budget at step {self.binding_step} ({self.binding_step_name!r}); "
            f"step {self.step_time_s * _MS_PER_S:.3f} ms = {self.base_time_s * _MS_PER_S:.3f} compute + "
            f"{self.recompute_time_s * _MS_PER_S:.3f} recompute + {self.transfer_exposed_s * _MS_PER_S:.3f} "
            f"exposed transfer; " + ", ".join(f"{counts[k]} {k}" for k in DECISIONS)
        ]
        lines += [f"  {d.name}: {d.reason}" for d in self.decisions if d.decision != KEEP]
        return "\n".join(lines)


def _freed_ranges(tables: Tables, index: int, code: int) -> list[tuple[int, int]]:
    (p, lb), = tables.intervals[index][KEEP_CODE]
    ranges = []
    cursor = p
    for lo, hi in tables.intervals[index][code]:
        if lo > cursor:
            ranges.append((cursor, lo - 1))
        cursor = max(cursor, hi + 1)
    if cursor <= lb:
        ranges.append((cursor, lb))
    return ranges


def build_plan(
    tables: Tables,
    codes: Sequence[int],
    *,
    budget_bytes: int,
    solver: str,
    optimal: bool,
    status: str,
    evaluation: Evaluation | None = None,
) -> Plan:
    """Assemble a :class:`Plan` with reasons for per-tensor ``codes``."""
    problem = tables.problem
    evaluation = evaluation or evaluate_codes(tables, codes)
    keep_all = evaluate_codes(tables, [KEEP_CODE] * len(codes))
    budget_binding = keep_all.peak_bytes > budget_bytes
    steps = problem.steps
    transient_steps: dict[int, list[int]] = {}
    for index, step, _ in evaluation.transients:
        transient_steps.setdefault(index, []).append(step)
    extended = dict(evaluation.keep_extensions)
    decisions = []
    for i, (tensor, code) in enumerate(zip(problem.tensors, codes)):
        decision = _CODE_NAMES[code]
        if code == KEEP_CODE:
            cost = 0.0
            if not budget_binding:
                reason = "kept: budget not binding"
            elif len(tables.allowed[i]) == 1:
                reason = "kept: it can be neither recomputed nor offloaded"
            else:
                reason = "kept: the budget is met more cheaply without freeing it"
        else:
            cost = tables.recompute_cost[i] if code == RECOMPUTE_CODE else tables.offload_exposed[i]
            ranges = _freed_ranges(tables, i, code)
            span = ", ".join(f"{lo}-{hi}" if lo != hi else f"{lo}" for lo, hi in ranges) or "none"
            worst = max(
                ((keep_all.memory_curve[t] - budget_bytes, -t) for lo, hi in ranges for t in range(lo, hi + 1)),
                default=None,
            )
            cost_text = f"{cost * _MS_PER_S:.3f} ms" if cost > 0 else "no modelled time"
            reason = f"{decision}: frees {format_bytes(tensor.nbytes)} during steps {span} for {cost_text}"
            if worst is not None and worst[0] > 0:
                t = -worst[1]
                reason += (
                    f"; covers step {t} ({steps[t].name!r}), where keeping everything exceeds the budget by "
                    f"{format_bytes(worst[0])}"
                )
            else:
                reason += "; lowers the peak at no extra time" if cost == 0 else "; part of the cheapest feasible set"
            if code == OFFLOAD_CODE:
                schedule = tables.schedules[i]
                assert schedule is not None
                reason += (
                    f" (copy-out done by step {schedule.d2h_done_step}, prefetch from step {schedule.prefetch_step})"
                )
        if i in extended:
            reason += f"; held until step {extended[i]} so a recompute chain can read it"
        if i in transient_steps:
            what = "recomputed" if code == RECOMPUTE_CODE else "fetched"
            reason += f"; also {what} transiently at step(s) {sorted(transient_steps[i])} for a recompute chain"
        decisions.append(TensorDecision(tensor.name, decision, tensor.nbytes, cost, reason))
    binding = evaluation.peak_step
    return Plan(
        decisions=tuple(decisions),
        budget_bytes=budget_bytes,
        peak_bytes=evaluation.peak_bytes,
        binding_step=binding,
        binding_step_name=steps[binding].name if steps else "",
        memory_curve=evaluation.memory_curve,
        step_time_s=evaluation.step_time_s,
        base_time_s=evaluation.base_time_s,
        extra_time_s=evaluation.extra_time_s,
        recompute_time_s=evaluation.recompute_time_s,
        transfer_exposed_s=evaluation.transfer_exposed_s,
        solver=solver,
        optimal=optimal,
        status=status,
    )
