"""Fast planner for large graphs: a budget-independent greedy trajectory plus local improvement.

Greedy trajectory (does not look at the budget)
    Start with every unit kept. Repeatedly look at the binding step t* (the first step where
    the memory curve peaks) and rank every kept unit's open non-keep decisions by
    ``bytes freed at t* / added seconds`` (added seconds floored at ``TIME_FLOOR_S`` so that
    free moves rank by bytes; ties broken by bytes, then unit index, then decision). Apply the
    candidates that lower (peak, number of steps at the peak) lexicographically, checked
    with the exact model of :mod:`.memory`: the first ``LOOKAHEAD`` candidates in that order are
    evaluated exactly and the one with the largest ``peak reduction / exact added seconds`` is
    applied (if none of them qualifies, the first later one that does). If no ranked candidate
    qualifies (chain effects the ranking cannot see), every single-unit change, reverts to keep
    included, is evaluated and the best qualifying one applied. Stop when none qualifies. The
    measure strictly decreases, so the trajectory is finite. This yields states
    s_0 (all keep), s_1, ... with non-increasing peaks p_0 >= p_1 >= ...

Refinement (uses the slack a large greedy step leaves; still budget-independent)
    A greedy step can drop the peak far below the previous one. Segment k collects states
    with peaks in [p_k, p_{k-1}): s_k; the refill of s_k (for its non-keep units in order of
    decreasing exact time saved by reverting each alone, ties by index, revert the unit to keep
    when the peak stays below p_{k-1}, does not fall, and the time does not rise; every accepted
    revert is a state); and the other lookahead candidates of greedy step k. Only its Pareto
    frontier (no state both lower-peak and faster) is kept, by descending peak. The refined
    sequence s_0, seg_1, seg_2, ... still has non-increasing peaks. Segments are built lazily,
    only where a budget falls.

Plan for a budget B
    The first refined state with peak <= B (none: the budget is infeasible and the error reports
    the last greedy peak as the smallest budget the heuristic can meet). Then local improvement
    from it, accepting only moves whose resulting peak stays within [p_next, p_cur], where p_cur
    is the state's peak and p_next the first refined peak strictly below it:
    * revert a non-keep unit to keep (accepted when time does not increase);
    * switch a unit between recompute and offload (accepted when time decreases);
    * swap: revert a unit to keep and free a cheaper kept unit at the new binding step (for
      the ``SWAP_UNITS`` costliest non-keep units, ``SWAP_CANDIDATES`` partners each);
    * pair switch: change two non-keep units at once (``PAIR_UNITS`` x ``PAIR_PARTNERS``
      costliest), e.g. trade recompute and offload between them;
    * insert and prune: free one more kept unit (the ``INSERT_CANDIDATES`` freeing the most
      bytes x steps above p_next per second), then revert every non-keep unit that still fits,
      in order of decreasing exact time saved; accepted when the time decreases. This replaces
      several small moves by one that frees a wide range.
    Rounds repeat until nothing changes (at most ``IMPROVE_MAX_ROUNDS``).

Monotonicity (a lower budget never gives a higher planned peak), by construction
    The refined sequence and each state's improvement depend only on the state, not on B, so
    budgets that select the same state get the same plan. If B2 < B1 select states j2 != j1, then
    j2 comes after j1 and p_{j1} > B2 (else B2 would select j1 or an earlier state), so j2 is at or
    after the first state strictly below p_{j1}; hence
    peak(B2) <= p_{j2} <= p_next(j1) <= peak(B1).

Determinism: no randomness, no dict/set iteration order in decisions, ties broken by index.
Cost: one exact evaluation is O(tensors + steps); the trajectory makes O(units) steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .memory import (
    KEEP_CODE,
    OFFLOAD_CODE,
    RECOMPUTE_CODE,
    Evaluation,
    LinkState,
    Tables,
    build_tables,
    evaluate_codes,
    link_bound,
)
from .problem import Problem, budget_infeasible_error
from .units import TieGroups, Units, build_units

TIME_FLOOR_S = 1e-9  # added-time floor in the greedy score, so free moves rank by bytes freed
IMPROVE_MAX_ROUNDS = 4  # local-improvement rounds at most
SWAP_CANDIDATES = 8  # kept units tried as the partner of one swap
SWAP_UNITS = 16  # per round, swaps are tried for this many of the costliest non-keep units
INSERT_CANDIDATES = 4  # per round, kept units tried as the "one in" of an insert-and-prune move
PAIR_UNITS = 6  # per round, pair switches start from this many of the costliest non-keep units...
PAIR_PARTNERS = 12  # ...each paired with this many of the costliest non-keep units
LOOKAHEAD = 8  # greedy candidates evaluated exactly per step (more only until one is acceptable)
TIME_REL_TOL = 1e-12  # a move must save more than this fraction of the step time to count


def _subtract(
    intervals: Sequence[tuple[int, int]], minus: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Step ranges in ``intervals`` but not in ``minus`` (inclusive ranges)."""
    result = []
    for lo, hi in intervals:
        pieces = [(lo, hi)]
        for m_lo, m_hi in minus:
            nxt = []
            for a, b in pieces:
                if m_hi < a or m_lo > b:
                    nxt.append((a, b))
                    continue
                if a < m_lo:
                    nxt.append((a, m_lo - 1))
                if m_hi < b:
                    nxt.append((m_hi + 1, b))
            pieces = nxt
        result.extend(pieces)
    return result


def _pareto_descending(pool: Sequence["TrajectoryState"]) -> list["TrajectoryState"]:
    """The states no other state beats on both peak and time, by descending peak (so time
    increases along the list). Ties keep the earlier state in ``pool``."""
    ranked = sorted(range(len(pool)), key=lambda i: (pool[i].evaluation.peak_bytes, pool[i].evaluation.step_time_s, i))
    kept = []
    best_time = math.inf
    for i in ranked:
        if pool[i].evaluation.step_time_s < best_time:
            kept.append(pool[i])
            best_time = pool[i].evaluation.step_time_s
    return kept[::-1]


@dataclass(frozen=True)
class TrajectoryState:
    """One greedy state: per-unit decision codes and their exact evaluation."""

    unit_codes: tuple[int, ...]
    evaluation: Evaluation


@dataclass(frozen=True)
class HeuristicSolution:
    """A heuristic plan: per-tensor ``codes``, their ``evaluation``, and the refined state it
    was improved from: greedy step ``state_index``, position ``segment_index`` in its segment."""

    codes: tuple[int, ...]
    evaluation: Evaluation
    state_index: int
    segment_index: int


def _peak_measure(evaluation: Evaluation) -> tuple[int, int]:
    peak = evaluation.peak_bytes
    return peak, sum(1 for used in evaluation.memory_curve if used == peak)


class HeuristicPlanner:
    """Plans one problem for any number of budgets; the trajectory is built lazily and shared.

    ``problem.budget_bytes`` is not used: pass the budget to :meth:`plan`.
    """

    def __init__(self, problem: Problem, *, tie_groups: TieGroups | None = None, tables: Tables | None = None) -> None:
        self.problem = problem
        self.tables = tables or build_tables(problem)
        self.units: Units = build_units(self.tables, tie_groups)
        self._unit_bytes_free = self._freed_intervals()
        self._unit_cost = [
            {
                code: (
                    sum(self.tables.recompute_cost[i] for i in members)
                    if code == RECOMPUTE_CODE
                    else sum(self.tables.offload_exposed[i] for i in members)
                    if code == OFFLOAD_CODE
                    else 0.0
                )
                for code in allowed
            }
            for members, allowed in zip(self.units.members, self.units.allowed)
        ]
        start = tuple(KEEP_CODE for _ in self.units.members)
        self._trajectory: list[TrajectoryState] = [TrajectoryState(start, self._evaluate(start))]
        self._finished = False
        self._segments: dict[int, list[TrajectoryState]] = {}
        self._alternatives: dict[int, list[TrajectoryState]] = {}
        self._improved: dict[tuple[int, int], HeuristicSolution] = {}
        self._mask_cache: tuple[Evaluation | None, list[float]] = (None, [])

    # -- evaluation helpers ------------------------------------------------------------------
    def _evaluate(self, unit_codes: Sequence[int]) -> Evaluation:
        return evaluate_codes(self.tables, self.units.expand(unit_codes))

    def _freed_intervals(self) -> list[dict[int, tuple[tuple[int, int, int], ...]]]:
        """Per unit and non-keep code: (lo, hi, bytes) ranges where the decision frees bytes."""
        result = []
        tables = self.tables
        for members, allowed in zip(self.units.members, self.units.allowed):
            per_code = {}
            for code in allowed:
                if code == KEEP_CODE:
                    continue
                ranges = []
                for i in members:
                    (p, lb), = tables.intervals[i][KEEP_CODE]
                    resident = tables.intervals[i][code]
                    cursor = p
                    for lo, hi in resident:
                        if lo > cursor:
                            ranges.append((cursor, lo - 1, tables.nbytes[i]))
                        cursor = max(cursor, hi + 1)
                    if cursor <= lb:
                        ranges.append((cursor, lb, tables.nbytes[i]))
                per_code[code] = tuple(ranges)
            result.append(per_code)
        return result

    def _freed_at(self, unit: int, code: int, step: int) -> int:
        return sum(size for lo, hi, size in self._unit_bytes_free[unit][code] if lo <= step <= hi)

    def _marginal_cost(self, unit_codes: Sequence[int], link: LinkState, exposed: float, unit: int, code: int) -> float:
        """Estimated seconds added by moving a kept ``unit`` to ``code`` (chains ignored)."""
        if code == RECOMPUTE_CODE:
            return self._unit_cost[unit][code]
        members = self.units.members[unit]
        new_exposed = exposed + self._unit_cost[unit][code]
        if len(members) == 1:
            new_link = link.bound_with(members[0])
        else:
            offloaded = [i for u, c in enumerate(unit_codes) if c == OFFLOAD_CODE for i in self.units.members[u]]
            new_link = link_bound(self.tables, offloaded + list(members))
        return max(new_exposed, new_link) - max(exposed, link.bound)

    def _ranked_moves(
        self, unit_codes: Sequence[int], step: int, *, max_cost: float | None = None, exclude: int = -1
    ) -> list[tuple[int, int]]:
        """Kept units' non-keep moves that free bytes at ``step``, best score first."""
        offloaded = [i for u, c in enumerate(unit_codes) if c == OFFLOAD_CODE for i in self.units.members[u]]
        link = LinkState(self.tables, offloaded)
        exposed = sum(self.tables.offload_exposed[i] for i in offloaded)
        scored = []
        for unit, code in enumerate(unit_codes):
            if code != KEEP_CODE or unit == exclude:
                continue
            for option in self.units.allowed[unit]:
                if option == KEEP_CODE:
                    continue
                freed = self._freed_at(unit, option, step)
                if freed <= 0:
                    continue
                cost = self._marginal_cost(unit_codes, link, exposed, unit, option)
                if max_cost is not None and cost >= max_cost:
                    continue
                scored.append((-freed / max(cost, TIME_FLOOR_S), -freed, unit, option))
        scored.sort()
        return [(unit, option) for _, _, unit, option in scored]

    # -- trajectory -----------------------------------------------------------------------------
    def _extend(self) -> bool:
        """Append the next greedy state; False when the trajectory has ended."""
        if self._finished:
            return False
        state = self._trajectory[-1]
        before = state.evaluation
        measure = _peak_measure(before)
        best: tuple[float, int] | None = None
        best_state: TrajectoryState | None = None
        alternatives: list[TrajectoryState] = []
        for rank, (unit, option) in enumerate(self._ranked_moves(state.unit_codes, before.peak_step)):
            if best is not None and rank >= LOOKAHEAD:
                break
            codes = list(state.unit_codes)
            codes[unit] = option
            evaluation = self._evaluate(codes)
            if _peak_measure(evaluation) >= measure:
                continue
            candidate = TrajectoryState(tuple(codes), evaluation)
            if evaluation.peak_bytes < before.peak_bytes:
                alternatives.append(candidate)
            added = max(evaluation.step_time_s - before.step_time_s, TIME_FLOOR_S)
            score = ((before.peak_bytes - evaluation.peak_bytes) / added, -rank)
            if best is None or score > best:
                best, best_state = score, candidate
        if best_state is None:
            best_state = self._any_single_change(state)
        if best_state is None:
            self._finished = True
            return False
        self._alternatives[len(self._trajectory)] = alternatives
        self._trajectory.append(best_state)
        return True

    def _any_single_change(self, state: TrajectoryState) -> TrajectoryState | None:
        """When no ranked move helps (chain effects: transients, keep extensions), try every
        single-unit change, reverts included; the best peak reduction per second wins."""
        before = state.evaluation
        measure = _peak_measure(before)
        best: tuple[float, int, int] | None = None
        best_state = None
        for unit, current in enumerate(state.unit_codes):
            for option in self.units.allowed[unit]:
                if option == current:
                    continue
                codes = list(state.unit_codes)
                codes[unit] = option
                evaluation = self._evaluate(codes)
                if _peak_measure(evaluation) >= measure:
                    continue
                added = max(evaluation.step_time_s - before.step_time_s, TIME_FLOOR_S)
                score = ((before.peak_bytes - evaluation.peak_bytes) / added, -unit, -option)
                if best is None or score > best:
                    best, best_state = score, TrajectoryState(tuple(codes), evaluation)
        return best_state

    def _first_state_at_or_below(self, peak: int, after: int = -1) -> int | None:
        index = after + 1
        while True:
            while index < len(self._trajectory):
                if self._trajectory[index].evaluation.peak_bytes <= peak:
                    return index
                index += 1
            if not self._extend():
                return None

    def min_peak(self) -> Evaluation:
        """The lowest peak on the greedy trajectory (runs it to the end)."""
        while self._extend():
            pass
        return self._trajectory[-1].evaluation  # peaks never increase along the trajectory

    # -- refinement -----------------------------------------------------------------------------
    def _surely_over(
        self, unit_codes: Sequence[int], evaluation: Evaluation, unit: int, new_code: int, limit: int
    ) -> bool:
        """True when moving ``unit`` to ``new_code`` certainly makes the peak exceed ``limit``;
        lets the solver skip an exact evaluation."""
        members = self.units.members[unit]
        if len(members) != 1:
            return False
        if self._mask_cache[0] is not evaluation:
            self._mask_cache = (evaluation, self._masked_curve(unit_codes, evaluation))
        masked = self._mask_cache[1]
        i = members[0]
        size = self.tables.nbytes[i]
        skip = self.tables.first_backward_use[i] if new_code == RECOMPUTE_CODE else -1
        for lo, hi in _subtract(self.tables.intervals[i][new_code], self.tables.intervals[i][unit_codes[unit]]):
            for t in range(lo, hi + 1):
                if t != skip and masked[t] + size > limit:
                    return True
        return False

    def _candidates(self, k: int) -> list[TrajectoryState]:
        """Segment k: Pareto frontier of s_k, its refill states and step k's other lookahead
        candidates, by descending peak (see the module docstring)."""
        if k in self._segments:
            return self._segments[k]
        state = self._trajectory[k]
        if k == 0:
            self._segments[k] = [state]
            return self._segments[k]
        upper = self._trajectory[k - 1].evaluation.peak_bytes  # exclusive
        codes = list(state.unit_codes)
        current = state.evaluation
        refills: list[TrajectoryState] = []
        for unit in self._revert_order(codes, current, upper - 1):
            if self._surely_over(codes, current, unit, KEEP_CODE, upper - 1):
                continue
            trial = list(codes)
            trial[unit] = KEEP_CODE
            evaluation = self._evaluate(trial)
            if (
                current.peak_bytes <= evaluation.peak_bytes < upper
                and evaluation.step_time_s <= current.step_time_s
            ):
                codes, current = trial, evaluation
                refills.append(TrajectoryState(tuple(codes), evaluation))
        pool = [state] + refills + [
            alt
            for alt in self._alternatives.get(k, [])
            if state.evaluation.peak_bytes <= alt.evaluation.peak_bytes < upper
        ]
        self._segments[k] = _pareto_descending(pool)
        return self._segments[k]

    def _next_peak_below(self, k: int, j: int, peak: int) -> int | None:
        """The first refined peak after position (k, j) strictly below ``peak``."""
        while True:
            candidates = self._candidates(k)
            for state in candidates[j + 1 :]:
                if state.evaluation.peak_bytes < peak:
                    return state.evaluation.peak_bytes
            k, j = k + 1, -1
            if k >= len(self._trajectory) and not self._extend():
                return None

    # -- improvement ----------------------------------------------------------------------------
    def _improve(self, k: int, j: int) -> HeuristicSolution:
        if (k, j) in self._improved:
            return self._improved[(k, j)]
        state = self._candidates(k)[j]
        hi = state.evaluation.peak_bytes
        following = self._next_peak_below(k, j, hi)
        lo = following if following is not None else 0
        codes = list(state.unit_codes)
        current = state.evaluation

        def accept(candidate: Evaluation, *, allow_equal_time: bool) -> bool:
            if not lo <= candidate.peak_bytes <= hi:
                return False
            if allow_equal_time:
                return candidate.step_time_s <= current.step_time_s
            return candidate.step_time_s < current.step_time_s * (1.0 - TIME_REL_TOL)

        def unit_cost(unit: int) -> float:
            return self._unit_cost[unit][codes[unit]]

        for _ in range(IMPROVE_MAX_ROUNDS):
            changed = False
            order = sorted((u for u, c in enumerate(codes) if c != KEEP_CODE), key=lambda u: (-unit_cost(u), u))
            for unit in order:
                own = codes[unit]
                alternatives = [KEEP_CODE] + [c for c in self.units.allowed[unit] if c not in (KEEP_CODE, own)]
                for alternative in alternatives:
                    if self._surely_over(codes, current, unit, alternative, hi):
                        continue
                    trial = list(codes)
                    trial[unit] = alternative
                    evaluation = self._evaluate(trial)
                    if accept(evaluation, allow_equal_time=alternative == KEEP_CODE):
                        codes, current, changed = trial, evaluation, True
                        break
            order = sorted((u for u, c in enumerate(codes) if c != KEEP_CODE), key=lambda u: (-unit_cost(u), u))
            for unit in order[:SWAP_UNITS]:
                if codes[unit] == KEEP_CODE:
                    continue
                reverted = list(codes)
                reverted[unit] = KEEP_CODE
                after_revert = self._evaluate(reverted)
                if after_revert.peak_bytes <= hi:
                    continue
                moves = self._ranked_moves(
                    reverted, after_revert.peak_step, max_cost=unit_cost(unit), exclude=unit
                )[:SWAP_CANDIDATES]
                for partner, option in moves:
                    trial = list(reverted)
                    trial[partner] = option
                    evaluation = self._evaluate(trial)
                    if accept(evaluation, allow_equal_time=False):
                        codes, current, changed = trial, evaluation, True
                        break
            paired = self._pair_switch(codes, current, lo, hi)
            if paired is not None:
                codes, current = paired
                changed = True
            inserted = self._insert_and_prune(codes, current, lo, hi)
            if inserted is not None:
                codes, current = inserted
                changed = True
            if not changed:
                break
        solution = HeuristicSolution(
            codes=tuple(self.units.expand(codes)), evaluation=current, state_index=k, segment_index=j
        )
        self._improved[(k, j)] = solution
        return solution

    def _insert_and_prune(
        self, codes: list[int], current: Evaluation, lo: int, hi: int
    ) -> tuple[list[int], Evaluation] | None:
        """Free one more kept unit, then revert to keep every non-keep unit (costliest first)
        that still fits under ``hi``; the first such compound move that ends faster, with the
        peak in [lo, hi], is returned. Candidates: the ``INSERT_CANDIDATES`` kept moves freeing
        the most bytes x steps above ``lo`` per second."""
        curve = current.memory_curve
        offloaded = [i for u, c in enumerate(codes) if c == OFFLOAD_CODE for i in self.units.members[u]]
        link = LinkState(self.tables, offloaded)
        exposed = sum(self.tables.offload_exposed[i] for i in offloaded)
        scored = []
        for unit, code in enumerate(codes):
            if code != KEEP_CODE:
                continue
            for option in self.units.allowed[unit]:
                if option == KEEP_CODE:
                    continue
                coverage = sum(
                    size * sum(1 for t in range(a, b + 1) if curve[t] > lo)
                    for a, b, size in self._unit_bytes_free[unit][option]
                )
                if coverage <= 0:
                    continue
                cost = self._marginal_cost(codes, link, exposed, unit, option)
                scored.append((-coverage / max(cost, TIME_FLOOR_S), unit, option))
        scored.sort()
        for _, unit, option in scored[:INSERT_CANDIDATES]:
            trial = list(codes)
            trial[unit] = option
            evaluation = self._evaluate(trial)
            for other in self._revert_order(trial, evaluation, hi, exclude=unit):
                if self._surely_over(trial, evaluation, other, KEEP_CODE, hi):
                    continue
                pruned = list(trial)
                pruned[other] = KEEP_CODE
                after = self._evaluate(pruned)
                if after.peak_bytes <= hi and after.step_time_s <= evaluation.step_time_s:
                    trial, evaluation = pruned, after
            faster = evaluation.step_time_s < current.step_time_s * (1.0 - TIME_REL_TOL)
            if lo <= evaluation.peak_bytes <= hi and faster:
                return trial, evaluation
        return None

    def _pair_switch(
        self, codes: list[int], current: Evaluation, lo: int, hi: int
    ) -> tuple[list[int], Evaluation] | None:
        """Change two non-keep units at once (e.g. trade recompute and offload between them):
        the ``PAIR_UNITS`` costliest units against the ``PAIR_PARTNERS`` costliest others; the
        first pair that ends faster with the peak in [lo, hi] is returned."""
        order = sorted(
            (u for u, c in enumerate(codes) if c != KEEP_CODE), key=lambda u: (-self._unit_cost[u][codes[u]], u)
        )
        for unit in order[:PAIR_UNITS]:
            if self._unit_cost[unit][codes[unit]] <= 0:
                break
            for partner in order[:PAIR_PARTNERS]:
                if partner == unit:
                    continue
                for option in self.units.allowed[unit]:
                    if option == codes[unit]:
                        continue
                    for partner_option in self.units.allowed[partner]:
                        if partner_option == codes[partner]:
                            continue
                        trial = list(codes)
                        trial[unit] = option
                        trial[partner] = partner_option
                        evaluation = self._evaluate(trial)
                        if lo <= evaluation.peak_bytes <= hi and (
                            evaluation.step_time_s < current.step_time_s * (1.0 - TIME_REL_TOL)
                        ):
                            return trial, evaluation
        return None

    def _revert_order(self, codes: Sequence[int], evaluation: Evaluation, limit: int, exclude: int = -1) -> list[int]:
        """Non-keep units by decreasing exact time saved when reverted alone to keep (this sees
        the transient recomputes a unit's decision causes), ties by index; units whose revert
        certainly exceeds ``limit`` are left out."""
        savings = []
        for unit, code in enumerate(codes):
            if code == KEEP_CODE or unit == exclude:
                continue
            if self._surely_over(codes, evaluation, unit, KEEP_CODE, limit):
                continue
            trial = list(codes)
            trial[unit] = KEEP_CODE
            savings.append((evaluation.step_time_s - self._evaluate(trial).step_time_s, unit))
        savings.sort(key=lambda entry: (-entry[0], entry[1]))
        return [unit for _, unit in savings]

    def _masked_curve(self, unit_codes: Sequence[int], evaluation: Evaluation) -> list[float]:
        """The memory curve with steps where chain effects can change (recompute points, keep
        extensions) set to -inf: elsewhere a one-tensor move changes memory by its own bytes."""
        masked: list[float] = list(evaluation.memory_curve)
        tables = self.tables
        for unit, code in enumerate(unit_codes):
            if code == RECOMPUTE_CODE:
                for i in self.units.members[unit]:
                    masked[tables.first_backward_use[i]] = -math.inf
        for y, end in evaluation.keep_extensions:
            for t in range(tables.last_backward_use[y] + 1, end + 1):
                masked[t] = -math.inf
        return masked

    def plan(self, budget_bytes: int) -> HeuristicSolution:
        """The heuristic plan for ``budget_bytes``.

        Raises:
            BudgetInfeasibleError: the trajectory never gets the peak down to the budget; the
                message gives the lowest peak it reaches (a budget that this planner meets).
        """
        k = self._first_state_at_or_below(budget_bytes)
        if k is None:
            best = self.min_peak()
            raise budget_infeasible_error(
                replace(self.problem, budget_bytes=budget_bytes),
                min_peak_bytes=best.peak_bytes,
                min_peak_step=best.peak_step,
                exact=False,
                solver="heuristic",
            )
        candidates = self._candidates(k)
        j = next(j for j, state in enumerate(candidates) if state.evaluation.peak_bytes <= budget_bytes)
        return self._improve(k, j)

