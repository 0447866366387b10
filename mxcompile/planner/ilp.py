"""Exact planner: a mixed-integer program solved with HiGHS (``scipy.optimize.milp``).

Variables
    x[u, c]     binary, unit u takes decision c (keep / recompute / offload), sum_c x[u, c] = 1;
                a tensor's decision is its unit's (see :mod:`.units`).
    need[y, s]  saved tensor y must be resident at recompute point s (chains, see :mod:`.memory`);
    tr[y, s]    y is recomputed transiently at s;   fe[y, s]  y is fetched synchronously at s;
    ext[y, t]   kept y is held past its last use through step t;
    link        exposed transfer time;   peak  (peak mode only).
    Auxiliary variables are continuous in [0, 1]: they only appear on the side of the
    constraints that forces them up, and only add memory or time, so an optimum exists with
    each at the value of the logical AND it stands for, and the binaries fully determine the
    plan (which is re-evaluated exactly with :func:`memory.evaluate_codes`).

Constraints (exactly the rules of :mod:`.memory`)
    need[y, fb_x]  >= x[x, recompute]                       for y in inputs(x)
    tr[y, s]       >= need[y, s] + x[y, recompute] - 1      if s not in recompute residency of y
    need[z, s]     >= tr[y, s]                              for z in inputs(y)
    fe[y, s]       >= need[y, s] + x[y, offload] - 1        if s not in offload residency of y
    ext[y, t]      >= need[y, s] + x[y, keep] - 1           for lb_y < t <= s
    link >= sum e_y x[y, offload],  link >= 0, and per link direction, for every window end b
    and start a: link >= sum_{window ends <= b} T_y x[y, offload] - c[0..b],
                 link >= sum_{window starts >= a} T_y x[y, offload] - c[a..end]
    memory[t] <= budget at every step t, where memory[t] = baseline[t] + keep-everything bytes
    at t - bytes freed at t by the chosen decisions + recompute work bytes at recompute
    points + tr/fe/ext bytes at t (tr with the work bytes).

Objective and tie-breaking
    1. minimise extra time = recompute + transient recompute + fetches + link;
    2. among plans within ``TIME_TIE_REL_TOL`` of that optimum, minimise the peak;
    3. (in :func:`mxcompile.planner.plan_activation_memory`) revert to keep every tensor whose
       revert raises neither time nor peak.
    Choosing the lowest peak among equally fast plans makes the planned peak monotone in the
    budget: a plan optimal at a larger budget that fits a smaller one is also optimal there.

Determinism: HiGHS is deterministic for the same model, and the model is built in a fixed
order, so the same problem gives the same plan, unless the time limit cuts a solve short
(then the incumbent depends on machine speed; ``IlpSolution.optimal`` is False).

Numerics: bytes are scaled by the largest tensor and the objective so that its largest
possible value is ``OBJECTIVE_SPAN``, because HiGHS' feasibility and absolute-gap tolerances
are absolute. Every solution is re-checked in exact integers; a step that exceeds the budget
by rounding gets its right-hand side tightened and the model is solved again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .memory import (
    KEEP_CODE,
    OFFLOAD_CODE,
    RECOMPUTE_CODE,
    Evaluation,
    Tables,
    build_tables,
    evaluate_codes,
)
from .problem import Problem, budget_infeasible_error
from .units import TieGroups, Units, build_units

DEFAULT_TIME_LIMIT_S = 10.0
MIP_REL_GAP = 1e-7  # relative optimality gap asked of HiGHS
OBJECTIVE_SPAN = 1e6  # the largest possible objective value after scaling (HiGHS' absolute gap is 1e-6)
TIME_TIE_REL_TOL = 1e-6  # stage 2 keeps plans within this relative distance of the optimal time
TIME_TIE_ABS_TOL = 1e-6  # ... plus this many scaled objective units
NUMERIC_RETRIES = 4  # re-solves with tightened rows when exact re-checking finds a rounding violation
MIN_STAGE_TIME_S = 1.0  # the peak stage gets at least this long even when stage 1 used the limit

_HIGHS_OPTIMAL = 0
_HIGHS_LIMIT = 1
_HIGHS_INFEASIBLE = 2


@dataclass(frozen=True)
class IlpSolution:
    """Result of :func:`solve_ilp`.

    Attributes:
        codes: decision code per tensor (``memory.KEEP_CODE`` ...).
        evaluation: exact evaluation of ``codes``.
        optimal: both stages were solved to proven optimality (within ``MIP_REL_GAP``).
        status: a short description of how the solves ended.
    """

    codes: tuple[int, ...]
    evaluation: Evaluation
    optimal: bool
    status: str


class _Model:
    """The MILP of one problem; rows are built once, solves differ in objective and bounds."""

    def __init__(self, tables: Tables, units: Units) -> None:
        self.tables = tables
        self.units = units
        problem = tables.problem
        self.n_steps = tables.n_steps
        self.mem_scale = float(max(max((b + w for b, w in zip(tables.nbytes, tables.work_bytes)), default=1), 1))
        n_vars = 0
        self.choice: list[dict[int, int]] = []
        for allowed in units.allowed:
            cols = {}
            for code in allowed:
                cols[code] = n_vars
                n_vars += 1
            self.choice.append(cols)
        self.n_binary = n_vars

        def var(i: int, code: int) -> int | None:
            return self.choice[units.of_tensor[i]].get(code)

        self.var = var
        # Reachable (tensor, recompute point) pairs, in a fixed order.
        pairs: dict[tuple[int, int], int] = {}
        queue: list[tuple[int, int]] = []
        direct: list[tuple[int, int, int]] = []  # (y, s, x)
        for x in range(len(problem.tensors)):
            if var(x, RECOMPUTE_CODE) is None:
                continue
            s = tables.first_backward_use[x]
            for y in tables.inputs[x]:
                direct.append((y, s, x))
                if (y, s) not in pairs:
                    pairs[(y, s)] = -1
                    queue.append((y, s))
        head = 0
        while head < len(queue):
            y, s = queue[head]
            head += 1
            if var(y, RECOMPUTE_CODE) is not None and not tables.resident_at(y, RECOMPUTE_CODE, s):
                for z in tables.inputs[y]:
                    if (z, s) not in pairs:
                        pairs[(z, s)] = -1
                        queue.append((z, s))
        for key in queue:
            pairs[key] = n_vars
            n_vars += 1
        self.need = pairs
        self.trans: dict[tuple[int, int], int] = {}
        self.fetch: dict[tuple[int, int], int] = {}
        self.ext: dict[tuple[int, int], int] = {}
        for y, s in queue:
            if var(y, RECOMPUTE_CODE) is not None and not tables.resident_at(y, RECOMPUTE_CODE, s):
                self.trans[(y, s)] = n_vars
                n_vars += 1
            if var(y, OFFLOAD_CODE) is not None and not tables.resident_at(y, OFFLOAD_CODE, s):
                self.fetch[(y, s)] = n_vars
                n_vars += 1
            for t in range(tables.last_backward_use[y] + 1, s + 1):
                if (y, t) not in self.ext:
                    self.ext[(y, t)] = n_vars
                    n_vars += 1
        self.link = n_vars
        self.peak = n_vars + 1
        self.n_vars = n_vars + 2

        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lower: list[float] = []
        upper: list[float] = []

        def add_row(entries: Sequence[tuple[int | None, float]], lo: float, hi: float) -> None:
            row = len(lower)
            for col, val in entries:
                if col is not None:
                    rows.append(row)
                    cols.append(col)
                    vals.append(val)
            lower.append(lo)
            upper.append(hi)

        for cols_of_unit in self.choice:
            add_row([(col, 1.0) for col in cols_of_unit.values()], 1.0, 1.0)
        for y, s, x in direct:
            add_row([(pairs[(y, s)], 1.0), (var(x, RECOMPUTE_CODE), -1.0)], 0.0, math.inf)
        for (y, s), col in self.trans.items():
            add_row([(col, 1.0), (pairs[(y, s)], -1.0), (var(y, RECOMPUTE_CODE), -1.0)], -1.0, math.inf)
            for z in tables.inputs[y]:
                add_row([(pairs[(z, s)], 1.0), (col, -1.0)], 0.0, math.inf)
        for (y, s), col in self.fetch.items():
            add_row([(col, 1.0), (pairs[(y, s)], -1.0), (var(y, OFFLOAD_CODE), -1.0)], -1.0, math.inf)
        for y, s in queue:
            for t in range(tables.last_backward_use[y] + 1, s + 1):
                add_row([(self.ext[(y, t)], 1.0), (pairs[(y, s)], -1.0), (var(y, KEEP_CODE), -1.0)], -1.0, math.inf)
        offloadable = [i for i in range(len(problem.tensors)) if var(i, OFFLOAD_CODE) is not None]
        add_row([(self.link, 1.0)] + [(var(i, OFFLOAD_CODE), -tables.offload_exposed[i]) for i in offloadable],
                0.0, math.inf)
        prefix = tables.compute_prefix
        for direction in (0, 1):
            windows = {i: tables.link_windows[i][direction] for i in offloadable}
            for end in sorted({w[1] for w in windows.values()}):
                members = [i for i in offloadable if windows[i][1] <= end]
                add_row([(self.link, 1.0)] + [(var(i, OFFLOAD_CODE), -tables.transfer_time[i]) for i in members],
                        -prefix[end + 1], math.inf)
            for start in sorted({min(w[0], self.n_steps - 1) for w in windows.values()}):
                members = [i for i in offloadable if min(windows[i][0], self.n_steps - 1) >= start]
                add_row([(self.link, 1.0)] + [(var(i, OFFLOAD_CODE), -tables.transfer_time[i]) for i in members],
                        -(prefix[-1] - prefix[start]), math.inf)
        self.n_logic_rows = len(lower)

        # Memory rows: keep-everything bytes are a constant; other decisions free their gaps.
        keep_bytes = [0] * (self.n_steps + 1)
        mem_entries: list[dict[int, float]] = [dict() for _ in range(self.n_steps)]
        for i, size in enumerate(tables.nbytes):
            work_col = var(i, RECOMPUTE_CODE)
            if work_col is not None and tables.work_bytes[i]:
                fb = tables.first_backward_use[i]
                mem_entries[fb][work_col] = mem_entries[fb].get(work_col, 0.0) + tables.work_bytes[i] / self.mem_scale
            if size == 0:
                continue
            (p, lb), = tables.intervals[i][KEEP_CODE]
            keep_bytes[p] += size
            keep_bytes[lb + 1] -= size
            for code in (RECOMPUTE_CODE, OFFLOAD_CODE):
                col = var(i, code)
                if col is None:
                    continue
                resident = tables.intervals[i][code]
                for t in range(p, lb + 1):
                    if not any(lo <= t <= hi for lo, hi in resident):
                        mem_entries[t][col] = mem_entries[t].get(col, 0.0) - size / self.mem_scale
        for group in (self.trans, self.fetch, self.ext):
            for (y, t), col in group.items():
                transient = tables.nbytes[y] + (tables.work_bytes[y] if group is self.trans else 0)
                mem_entries[t][col] = mem_entries[t].get(col, 0.0) + transient / self.mem_scale
        running = 0
        self.fixed_bytes = []
        for t in range(self.n_steps):
            running += keep_bytes[t]
            self.fixed_bytes.append(problem.baseline_bytes[t] + running)
        self.mem_first_row = len(lower)
        for t in range(self.n_steps):
            add_row(sorted(mem_entries[t].items()), -math.inf, 0.0)  # bounds set per solve
        self.n_rows = len(lower)
        self.matrix = coo_array((vals, (rows, cols)), shape=(self.n_rows, self.n_vars)).tocsr()
        self.lower = np.array(lower)
        self.upper = np.array(upper)

        time_cost = np.zeros(self.n_vars)
        for i in range(len(problem.tensors)):
            col = var(i, RECOMPUTE_CODE)
            if col is not None:
                time_cost[col] += tables.recompute_cost[i]
        for (y, _), col in self.trans.items():
            time_cost[col] += tables.recompute_cost[y]
        for (y, _), col in self.fetch.items():
            time_cost[col] += tables.transfer_time[y]
        time_cost[self.link] = 1.0
        bound = float(np.sum(time_cost[: self.link])) + sum(
            tables.transfer_time[i] + tables.offload_exposed[i] for i in offloadable
        )
        self.obj_scale = OBJECTIVE_SPAN / bound if bound > 0 else 1.0
        self.time_cost = time_cost * self.obj_scale

    def _solve(
        self,
        *,
        objective: np.ndarray,
        mem_offset: float,
        with_peak: bool,
        peak_upper: float,
        time_cap: float | None,
        tighten: Sequence[int],
        time_limit_s: float,
    ):
        matrix = self.matrix
        lower = self.lower.copy()
        upper = self.upper.copy()
        first = self.mem_first_row
        for t in range(self.n_steps):
            upper[first + t] = (mem_offset - self.fixed_bytes[t] - tighten[t]) / self.mem_scale
        if with_peak:
            matrix = matrix + coo_array(
                (
                    np.full(self.n_steps, -1.0),
                    (np.arange(first, first + self.n_steps), np.full(self.n_steps, self.peak)),
                ),
                shape=matrix.shape,
            ).tocsr()
        constraints = [LinearConstraint(matrix, lower, upper)]
        if time_cap is not None:
            constraints.append(LinearConstraint(self.time_cost.reshape(1, -1), -math.inf, time_cap))
        lb = np.zeros(self.n_vars)
        ub = np.ones(self.n_vars)
        ub[self.link] = math.inf
        ub[self.peak] = peak_upper if with_peak else 0.0
        if with_peak:
            lb[self.peak] = -math.inf
        integrality = np.zeros(self.n_vars)
        integrality[: self.n_binary] = 1
        return milp(
            objective,
            integrality=integrality,
            bounds=Bounds(lb, ub),
            constraints=constraints,
            options={"time_limit": max(time_limit_s, 0.0), "mip_rel_gap": MIP_REL_GAP, "disp": False},
        )

    def codes_of(self, x: np.ndarray) -> list[int]:
        unit_codes = [max(cols, key=lambda code: (x[cols[code]], -code)) for cols in self.choice]
        return self.units.expand(unit_codes)

    def solve_checked(
        self,
        *,
        minimise_peak: bool,
        budget: int | None,
        time_cap: float | None,
        time_limit_s: float,
    ) -> tuple[list[int] | None, Evaluation | None, int, object]:
        """Solve, re-check exactly, tighten rows violated by rounding, repeat.

        Returns (codes, evaluation, HiGHS status, raw result); codes is None without a solution.
        """
        tighten = [0] * self.n_steps
        deadline = time.monotonic() + time_limit_s
        objective = np.zeros(self.n_vars)
        if minimise_peak:
            objective[self.peak] = 1.0
        else:
            objective[:] = self.time_cost
        res = None
        for _ in range(NUMERIC_RETRIES + 1):
            remaining = max(deadline - time.monotonic(), MIN_STAGE_TIME_S)
            if minimise_peak:
                res = self._solve(
                    objective=objective,
                    mem_offset=0.0,
                    with_peak=True,
                    peak_upper=math.inf if budget is None else budget / self.mem_scale,
                    time_cap=time_cap,
                    tighten=tighten,
                    time_limit_s=remaining,
                )
            else:
                res = self._solve(
                    objective=objective,
                    mem_offset=float(budget),
                    with_peak=False,
                    peak_upper=0.0,
                    time_cap=time_cap,
                    tighten=tighten,
                    time_limit_s=remaining,
                )
            if res.x is None:
                return None, None, res.status, res
            codes = self.codes_of(res.x)
            evaluation = evaluate_codes(self.tables, codes)
            if budget is None or evaluation.peak_bytes <= budget:
                return codes, evaluation, res.status, res
            for t, used in enumerate(evaluation.memory_curve):
                if used > budget:
                    tighten[t] += used - budget
        raise RuntimeError(
            "the ILP's solutions keep exceeding the budget by rounding after "
            f"{NUMERIC_RETRIES} tightenings; use solver='heuristic'"
        )


def min_peak(
    problem: Problem,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    tie_groups: TieGroups | None = None,
    tables: Tables | None = None,
) -> tuple[Evaluation, tuple[int, ...], bool]:
    """The assignment with the smallest peak, ignoring time and budget.

    Returns (evaluation, codes, proven optimal).
    """
    tables = tables or build_tables(problem)
    model = _Model(tables, build_units(tables, tie_groups))
    codes, evaluation, status, _ = model.solve_checked(
        minimise_peak=True, budget=None, time_cap=None, time_limit_s=time_limit_s
    )
    if codes is None or evaluation is None:
        raise RuntimeError(f"the min-peak ILP found no solution within {time_limit_s} s (HiGHS status {status})")
    return evaluation, tuple(codes), status == _HIGHS_OPTIMAL


def solve_ilp(
    problem: Problem,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    tie_groups: TieGroups | None = None,
    tables: Tables | None = None,
) -> IlpSolution:
    """Minimum-time plan with peak <= ``problem.budget_bytes`` (lowest peak among ties).

    Raises:
        BudgetInfeasibleError: no assignment fits; the message gives the smallest budget that
            fits (from a min-peak ILP) and how to fix the configuration.
        RuntimeError: the time limit passed before any feasible plan or proof of infeasibility.
    """
    started = time.monotonic()
    tables = tables or build_tables(problem)
    units = build_units(tables, tie_groups)
    model = _Model(tables, units)
    budget = problem.budget_bytes
    codes, evaluation, status, res = model.solve_checked(
        minimise_peak=False, budget=budget, time_cap=None, time_limit_s=time_limit_s
    )
    if codes is None:
        if status == _HIGHS_INFEASIBLE:
            remaining = max(time_limit_s - (time.monotonic() - started), MIN_STAGE_TIME_S)
            peak_eval, _, exact = min_peak(problem, time_limit_s=remaining, tie_groups=tie_groups, tables=tables)
            raise budget_infeasible_error(
                problem,
                min_peak_bytes=peak_eval.peak_bytes,
                min_peak_step=peak_eval.peak_step,
                exact=exact,
                solver="ilp",
            )
        raise RuntimeError(
            f"the ILP found no plan within time_limit_s={time_limit_s} (HiGHS: {res.message}); "
            "raise time_limit_s or use solver='heuristic'"
        )
    optimal = status == _HIGHS_OPTIMAL
    assert evaluation is not None
    best_time = float(res.fun)
    cap = best_time * (1.0 + TIME_TIE_REL_TOL) + TIME_TIE_ABS_TOL
    remaining = max(time_limit_s - (time.monotonic() - started), MIN_STAGE_TIME_S)
    codes2, evaluation2, status2, _ = model.solve_checked(
        minimise_peak=True, budget=budget, time_cap=cap, time_limit_s=remaining
    )
    if codes2 is not None and evaluation2 is not None and evaluation2.peak_bytes <= evaluation.peak_bytes:
        codes, evaluation = codes2, evaluation2
        optimal = optimal and status2 == _HIGHS_OPTIMAL
        status_text = "optimal" if optimal else "time limit reached (best plan found)"
    else:
        optimal = False
        status_text = "time limit reached in the peak tie-break stage"
    return IlpSolution(codes=tuple(codes), evaluation=evaluation, optimal=optimal, status=status_text)
