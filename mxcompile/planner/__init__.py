"""Activation-memory planner: keep, recompute or offload every tensor saved for the backward.

Entry points (pure functions on plain numbers; the FX adapter builds the :class:`Problem`):

* :func:`plan_activation_memory` ``(problem, *, solver="auto", time_limit_s=10.0, tie_groups=None)``
  -> :class:`Plan`: the fastest plan (model of :mod:`.memory`) whose peak fits the budget.
* :func:`budget_curve` ``(problem, budgets, ...)`` -> predicted step time at each budget.
* :func:`plan_repeated` ``(block, n_blocks, ...)``: n identical blocks, one block's decisions.
* :func:`evaluate` ``(problem, assignment)``: memory curve, peak and step time of any assignment.

Solvers: ``"ilp"`` (:mod:`.ilp`, exact, HiGHS), ``"heuristic"`` (:mod:`.heuristic`, greedy +
local improvement, monotone in the budget), ``"auto"``: the ILP when the problem has at most
``AUTO_ILP_MAX_UNITS`` decision units (tensors, or tie groups), the heuristic otherwise. If the
ILP reaches its time limit without any plan, ``plan_activation_memory`` falls back to the
heuristic (``Plan.status`` says so).

Pipeline: if keeping everything fits, every tensor is kept ("kept: budget not binding").
Otherwise the chosen solver runs; the ILP's plan then goes through a pass that reverts to keep
every tensor (in problem order) whose revert raises neither the step time nor the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .heuristic import HeuristicPlanner
from .ilp import DEFAULT_TIME_LIMIT_S, solve_ilp
from .memory import KEEP_CODE, Evaluation, build_tables, evaluate, evaluate_codes, memory_curve
from .plan import Plan, TensorDecision, build_plan
from .problem import (
    BACKWARD,
    DECISIONS,
    FORWARD,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    BudgetInfeasibleError,
    Problem,
    SavedTensor,
    Step,
)
from .repeat import repeat_block
from .units import TieGroups, build_units

AUTO_ILP_MAX_UNITS = 32  # "auto" uses the ILP up to this many decision units (about 1-2 s of HiGHS)
SOLVERS = ("auto", "ilp", "heuristic")

__all__ = [
    "AUTO_ILP_MAX_UNITS",
    "BACKWARD",
    "BudgetInfeasibleError",
    "BudgetPoint",
    "DECISIONS",
    "Evaluation",
    "FORWARD",
    "KEEP",
    "OFFLOAD",
    "Plan",
    "Problem",
    "RECOMPUTE",
    "SavedTensor",
    "Step",
    "TensorDecision",
    "budget_curve",
    "evaluate",
    "memory_curve",
    "plan_activation_memory",
    "plan_repeated",
    "repeat_block",
]


def _check_args(solver: str, time_limit_s: float) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not accepted; accepted: {list(SOLVERS)}")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}: give a positive number of seconds")


def _resolve_solver(solver: str, n_units: int) -> str:
    if solver == "auto":
        return "ilp" if n_units <= AUTO_ILP_MAX_UNITS else "heuristic"
    return solver


def _revert_to_keep(tables, units, codes: list[int], evaluation: Evaluation) -> tuple[list[int], Evaluation]:
    """Revert units to keep, in unit order, while neither time nor peak rises."""
    for unit, members in enumerate(units.members):
        if codes[members[0]] == KEEP_CODE:
            continue
        trial = list(codes)
        for i in members:
            trial[i] = KEEP_CODE
        candidate = evaluate_codes(tables, trial)
        if candidate.step_time_s <= evaluation.step_time_s and candidate.peak_bytes <= evaluation.peak_bytes:
            codes, evaluation = trial, candidate
    return codes, evaluation


def plan_activation_memory(
    problem: Problem,
    *,
    solver: str = "auto",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    tie_groups: TieGroups | None = None,
    _heuristic: HeuristicPlanner | None = None,
) -> Plan:
    """Decide keep / recompute / offload for every saved tensor of ``problem``.

    Args:
        problem: the planning problem (budget included).
        solver: "auto", "ilp" or "heuristic" (see the module docstring).
        time_limit_s: wall-clock limit for the ILP's solves (both stages together; the peak
            tie-break stage always gets at least ``ilp.MIN_STAGE_TIME_S``).
        tie_groups: groups of tensor names that must share one decision (see :mod:`.units`).

    Raises:
        BudgetInfeasibleError: the budget cannot be met; the message says the smallest budget
            that can (and ``.min_peak_bytes`` holds it).
        ValueError: bad arguments, naming the argument.
    """
    _check_args(solver, time_limit_s)
    tables = _heuristic.tables if _heuristic is not None else build_tables(problem)
    units = build_units(tables, tie_groups)
    chosen = _resolve_solver(solver, len(units))
    keep_codes = [KEEP_CODE] * len(problem.tensors)
    keep_all = evaluate_codes(tables, keep_codes)
    budget = problem.budget_bytes
    if keep_all.peak_bytes <= budget:
        return build_plan(tables, keep_codes, budget_bytes=budget, solver=chosen, optimal=True,
                          status="keeping everything fits", evaluation=keep_all)
    status_prefix = ""
    if chosen == "ilp":
        try:
            solution = solve_ilp(problem, time_limit_s=time_limit_s, tie_groups=tie_groups, tables=tables)
        except RuntimeError as err:
            chosen = "heuristic"
            status_prefix = f"ILP gave no plan ({err}); "
        else:
            codes, evaluation = _revert_to_keep(tables, units, list(solution.codes), solution.evaluation)
            return build_plan(tables, codes, budget_bytes=budget, solver="ilp", optimal=solution.optimal,
                              status=solution.status, evaluation=evaluation)
    planner = _heuristic or HeuristicPlanner(problem, tie_groups=tie_groups, tables=tables)
    result = planner.plan(budget)
    return build_plan(
        tables,
        list(result.codes),
        budget_bytes=budget,
        solver="heuristic",
        optimal=False,
        status=status_prefix
        + f"greedy step {result.state_index}, segment state {result.segment_index}, local improvement",
        evaluation=result.evaluation,
    )


@dataclass(frozen=True)
class BudgetPoint:
    """One point of :func:`budget_curve`.

    Attributes:
        budget_bytes: the budget.
        feasible: whether any plan found fits it.
        step_time_s: predicted step time of the chosen plan (inf when infeasible).
        peak_bytes: its predicted peak (None when infeasible).
        planned_for_bytes: the budget the chosen plan was computed for (<= budget_bytes).
        solver: the solver used.
    """

    budget_bytes: int
    feasible: bool
    step_time_s: float
    peak_bytes: int | None
    planned_for_bytes: int | None
    solver: str


def budget_curve(
    problem: Problem,
    budgets: Sequence[int],
    *,
    solver: str = "auto",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    tie_groups: TieGroups | None = None,
) -> tuple[BudgetPoint, ...]:
    """Predicted step time at each budget (``problem.budget_bytes`` is ignored).

    Every budget is planned with :func:`plan_activation_memory` (the heuristic shares one
    greedy trajectory across budgets). Then, because a plan found for one budget is valid for
    every budget at or above its peak, each point reports the fastest plan found (ties: lower
    peak, then lower planned budget) among all plans whose peak fits that budget. This final
    check across budgets makes both the reported time non-increasing and the reported peak
    non-decreasing in the budget, for either solver. Points come back in the given order.
    """
    _check_args(solver, time_limit_s)
    budgets = list(budgets)
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"budgets[{i}]={b!r}: give a positive int (bytes)")
    tables = build_tables(problem)
    units = build_units(tables, tie_groups)
    chosen = _resolve_solver(solver, len(units))
    heuristic = HeuristicPlanner(problem, tie_groups=tie_groups, tables=tables) if chosen == "heuristic" else None
    found: list[tuple[float, int, int]] = []  # (time, peak, planned budget)
    for b in sorted(set(budgets)):
        try:
            plan = plan_activation_memory(
                replace(problem, budget_bytes=b), solver=chosen, time_limit_s=time_limit_s,
                tie_groups=tie_groups, _heuristic=heuristic,
            )
        except BudgetInfeasibleError:
            continue
        found.append((plan.step_time_s, plan.peak_bytes, b))
    points = []
    for b in budgets:
        fitting = [entry for entry in found if entry[1] <= b]
        if not fitting:
            points.append(BudgetPoint(b, False, math.inf, None, None, chosen))
            continue
        best_time, best_peak, planned_for = min(fitting)
        points.append(BudgetPoint(b, True, best_time, best_peak, planned_for, chosen))
    return tuple(points)


def plan_repeated(
    block: Problem,
    n_blocks: int,
    *,
    persistent_bytes: int = 0,
    block_groups: int = 1,
    solver: str = "auto",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> Plan:
    """Plan ``n_blocks`` identical copies of ``block``, deciding each block tensor once per
    group of blocks.

    ``block.budget_bytes`` is the whole model's budget; ``persistent_bytes`` is live at every
    step (all blocks' parameters, gradients, optimizer state). See :mod:`.repeat` for the
    layout and naming (``"b{k}.name"``). The blocks are split into ``block_groups`` contiguous
    groups (1: every block decides alike; ``n_blocks``: no tying); copies of a block tensor in
    one group share a decision, so the solver sees ``block_groups x tensors per block`` decision
    units while memory is checked at every step. "auto" therefore picks the ILP when that
    product is at most ``AUTO_ILP_MAX_UNITS``.

    Tying costs optimality: early blocks' activations live longest, so freeing them differs in
    value from freeing late ones. On the synthetic 24-layer problem at 20 % of the activation
    headroom, the tied ILP's extra time was 48.7 ms with 1 group, 42.4 ms with 2, 38.9 ms with 4,
    against 37.7 ms for the untied heuristic (benchmarks/planner_speed.py prints these).
    """
    problem, groups = repeat_block(block, n_blocks, persistent_bytes=persistent_bytes)
    if isinstance(block_groups, bool) or not isinstance(block_groups, int) or not 1 <= block_groups <= n_blocks:
        raise ValueError(f"block_groups={block_groups!r}: give an int in [1, n_blocks={n_blocks}]")
    per_group = -(-n_blocks // block_groups)  # ceil
    tie_groups = [
        [name for k, name in enumerate(copies) if k // per_group == g] for copies in groups for g in range(block_groups)
    ]
    tie_groups = [group for group in tie_groups if group]
    return plan_activation_memory(problem, solver=solver, time_limit_s=time_limit_s, tie_groups=tie_groups)
