"""The cost model: memory curve, peak and step time of an assignment.

This module is the reference semantics of the planner: the ILP (:mod:`.ilp`) encodes exactly
these rules as linear constraints, and the tests check the ILP against brute force over
:func:`evaluate`.

Notation for a saved tensor x: ``p`` = produced_at, ``lf`` = last_forward_use, ``fb`` =
first_backward_use, ``lb`` = last_backward_use, ``c[t]`` = compute time of step t, ``T`` =
nbytes / host_link_bandwidth (one direction). Intervals are inclusive step ranges.

Residency of x under its own decision
    keep:       [p, lb]
    recompute:  [p, lf] and [fb, lb]. The recomputation runs at the start of step fb (its
                *recompute point*, just before the first backward use); x is live from there on,
                and its ``recompute_work_bytes`` (the replay's intermediates) at step fb only.
    offload:    [p, d] and [q, lb], where
                * the device-to-host copy starts when x is produced and overlaps the compute of
                  steps p+1, p+2, ...; ``d`` is the first step >= lf by which that compute adds up
                  to T (the device copy cannot be freed before the copy is done), at most fb-1;
                * the host-to-device prefetch must finish by the start of step fb; it is issued at
                  the start of step ``q`` and the buffer is allocated then; ``q`` is the latest
                  step with c[q] + ... + c[fb-1] >= T, but not before d+1 (the host copy must be
                  complete). A too-short window makes both copies partly exposed (below).

Recompute chains (what recomputing x at its recompute point s = fb_x needs)
    Every name in x.recompute_inputs must be resident at step s. For a saved input y:
    * y resident at s under its own decision: nothing more.
    * y kept, but s > lb_y: y's keep interval is *extended* to s (it is held longer).
    * y recomputed, not resident at s: y is recomputed *transiently* at s (its recompute cost
      again, its bytes and work bytes at step s only) and, recursively, y's own inputs must be
      resident at s.
    * y offloaded, not resident at s: y is fetched *synchronously* at s (T_y fully exposed, its
      bytes at step s only).
    Each tensor is materialised at most once per step (shared by every recomputation at that
    step), and a keep extension covers the latest step that needs it. Everything recomputed or
    fetched at a step is counted as live during the whole step (a conservative upper bound).
    Resident inputs (parameters) are always available and are part of the baseline.

Memory curve
    memory[t] = baseline_bytes[t] + sum of bytes of the saved tensors resident at t
                + keep extensions covering t + transient recomputes / fetches at t.
    The peak is max(memory); the binding step is the first step where it occurs.

Step time
    step_time = sum(c) + recompute_time + transfer_exposed, with
    recompute_time   = sum of recompute_cost_s over recomputed tensors, plus the cost of every
                       transient recompute;
    transfer_exposed = max(sum_x e_x, link_bound) + sum of synchronous fetches, where for each
                       offloaded x, e_x = max(0, T_x - c[p+1..d]) (copy-out not hidden) +
                       max(0, T_x - c[q..fb-1]) (prefetch not hidden), and link_bound is a lower
                       bound on serialisation: each direction of the link carries one copy at a
                       time, copy-outs have windows [p+1, d] and prefetches [q, fb-1], so for every
                       step b the copies of one direction whose window ends by b need
                       sum T - c[0..b] exposed time at least, and those whose window starts at or
                       after a need sum T - c[a..end]; link_bound is the largest of these (and 0).
    Copies are asynchronous (side stream), so a hidden copy costs no time; when the link is
    oversubscribed the compute stream waits (exposed time) so that every copy still ends where
    the residency above says. Per-transfer launch latency and host memory bandwidth are ignored.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .problem import DECISIONS, KEEP, OFFLOAD, RECOMPUTE, Problem

KEEP_CODE = 0
RECOMPUTE_CODE = 1
OFFLOAD_CODE = 2
DECISION_CODES: dict[str, int] = {KEEP: KEEP_CODE, RECOMPUTE: RECOMPUTE_CODE, OFFLOAD: OFFLOAD_CODE}
Interval = tuple[int, int]


@dataclass(frozen=True)
class OffloadSchedule:
    """When an offloaded tensor's copies run (see the module docstring).

    Attributes:
        transfer_time_s: T, one direction.
        d2h_done_step: the device copy stays resident through this step.
        prefetch_step: the prefetch is issued, and the buffer allocated, at the start of this step.
        d2h_exposed_s: part of the device-to-host copy not hidden under compute.
        h2d_exposed_s: part of the prefetch not hidden under compute.
    """

    transfer_time_s: float
    d2h_done_step: int
    prefetch_step: int
    d2h_exposed_s: float
    h2d_exposed_s: float

    @property
    def exposed_s(self) -> float:
        return self.d2h_exposed_s + self.h2d_exposed_s


def offload_schedule(problem: Problem, index: int) -> OffloadSchedule | None:
    """The copy schedule of ``problem.tensors[index]`` if offloaded; None if offload is disabled."""
    tensor = problem.tensors[index]
    transfer = problem.transfer_time_s(tensor)
    if transfer is None:
        return None
    compute = [step.compute_time_s for step in problem.steps]
    p, lf, fb = tensor.produced_at, tensor.last_forward_use, tensor.first_backward_use
    hidden_out = sum(compute[p + 1 : lf + 1])
    done = lf
    while hidden_out < transfer and done < fb - 1:
        done += 1
        hidden_out += compute[done]
    hidden_in = 0.0
    prefetch = fb
    while hidden_in < transfer and prefetch > done + 1:
        prefetch -= 1
        hidden_in += compute[prefetch]
    return OffloadSchedule(
        transfer_time_s=transfer,
        d2h_done_step=done,
        prefetch_step=prefetch,
        d2h_exposed_s=max(0.0, transfer - hidden_out),
        h2d_exposed_s=max(0.0, transfer - hidden_in),
    )


def _merge(intervals: Sequence[Interval]) -> tuple[Interval, ...]:
    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if hi < lo:
            continue
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


@dataclass(frozen=True)
class Tables:
    """Per-problem data precomputed once for fast repeated evaluation (solvers use it).

    ``intervals[i][code]`` is the residency of tensor i under decision ``code`` (empty tuple
    when that decision is not open to it); ``inputs[i]`` the saved-tensor indices among its
    recompute inputs (resident inputs dropped); ``backward_resident[i][code]`` the same
    residency as (lo1, hi1, lo2, hi2); ``link_windows[i]`` the (start, end) step windows of its
    copy-out and prefetch; ``link_orders[d]`` the offloadable tensors as (index, end) by window
    end and (index, start) by descending window start, for link direction d.
    """

    problem: Problem
    n_steps: int
    nbytes: tuple[int, ...]
    work_bytes: tuple[int, ...]
    last_backward_use: tuple[int, ...]
    first_backward_use: tuple[int, ...]
    recompute_cost: tuple[float, ...]
    transfer_time: tuple[float, ...]
    offload_exposed: tuple[float, ...]
    intervals: tuple[tuple[tuple[Interval, ...], ...], ...]
    allowed: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[int, ...], ...]
    schedules: tuple[OffloadSchedule | None, ...]
    backward_resident: tuple[tuple[tuple[int, int, int, int], ...], ...]
    total_compute_s: float
    compute_prefix: tuple[float, ...]
    link_windows: tuple[tuple[tuple[int, int], tuple[int, int]] | None, ...]
    link_orders: tuple[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...]
    arrays: "_Arrays"

    def resident_at(self, index: int, code: int, step: int) -> bool:
        return any(lo <= step <= hi for lo, hi in self.intervals[index][code])


@dataclass(frozen=True, eq=False)
class _Arrays:
    """NumPy forms of the tables for fast evaluation.

    ``pos[i, code]`` / ``val[i, code]``: the difference-array updates of tensor i's residency
    under ``code`` (start +bytes, end+1 -bytes, twice; then, for recompute, the work bytes at
    the recompute point; padding hits a dummy slot).
    ``resident[i, code]``: ``Tables.backward_resident``; ``pairs``: (x, y, fb_x) for every
    saved input y of every recomputable x.
    ``link``: (order, compute, transfer), four rows each: for each link direction, the
    offloadable tensors by window end (compute c[0..end]) and by descending window start
    (compute c[start..end of schedule]); transfer is each entry's one-direction copy time.
    """

    rows: np.ndarray
    pos: np.ndarray
    val: np.ndarray
    baseline: np.ndarray
    recompute_cost: np.ndarray
    transfer_time: np.ndarray
    offload_exposed: np.ndarray
    link: tuple[np.ndarray, np.ndarray, np.ndarray]
    resident: np.ndarray
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray]


_EMPTY_RANGE = (1, 0)
_UPDATE_SLOTS = 6  # two residency intervals (start, end+1) and the recompute work spike


def _two_ranges(intervals: tuple[Interval, ...]) -> tuple[int, int, int, int]:
    """A residency (at most two intervals) as (lo1, hi1, lo2, hi2); missing ones are empty."""
    padded = list(intervals) + [_EMPTY_RANGE] * (2 - len(intervals))
    (lo1, hi1), (lo2, hi2) = padded
    return lo1, hi1, lo2, hi2


def _build_arrays(problem: Problem, intervals, transfer, exposed, orders, prefix, inputs, resident) -> _Arrays:
    n = len(problem.tensors)
    dummy = len(problem.steps) + 1
    pos = np.full((n, len(DECISIONS), _UPDATE_SLOTS), dummy, dtype=np.int64)
    val = np.zeros((n, len(DECISIONS), _UPDATE_SLOTS), dtype=np.int64)
    for i, per_code in enumerate(intervals):
        tensor = problem.tensors[i]
        for code, ranges in enumerate(per_code):
            for r, (lo, hi) in enumerate(ranges):
                pos[i, code, 2 * r : 2 * r + 2] = (lo, hi + 1)
                val[i, code, 2 * r : 2 * r + 2] = (tensor.nbytes, -tensor.nbytes)
        if per_code[RECOMPUTE_CODE]:
            fb = tensor.first_backward_use
            pos[i, RECOMPUTE_CODE, 4:6] = (fb, fb + 1)
            val[i, RECOMPUTE_CODE, 4:6] = (tensor.recompute_work_bytes, -tensor.recompute_work_bytes)
    total = prefix[-1]
    order_rows = []
    compute_rows = []
    for by_end, by_start in orders:
        order_rows += [[i for i, _ in by_end], [i for i, _ in by_start]]
        compute_rows += [[prefix[end + 1] for _, end in by_end], [total - prefix[start] for _, start in by_start]]
    link_order = np.array(order_rows, dtype=np.int64).reshape(len(order_rows), -1)
    link = (
        link_order,
        np.array(compute_rows, dtype=np.float64).reshape(link_order.shape),
        np.array(transfer, dtype=np.float64)[link_order] if link_order.size else np.zeros(link_order.shape),
    )
    pairs = [
        (x, y, problem.tensors[x].first_backward_use)
        for x in range(n)
        if RECOMPUTE in problem.allowed_decisions(problem.tensors[x])
        for y in inputs[x]
    ]
    return _Arrays(
        resident=np.array(resident, dtype=np.int64).reshape(n, len(DECISIONS), 4),
        pairs=tuple(np.array([pair[k] for pair in pairs], dtype=np.int64) for k in range(3)),
        rows=np.arange(n, dtype=np.int64),
        pos=pos,
        val=val,
        baseline=np.array(problem.baseline_bytes, dtype=np.int64),
        recompute_cost=np.array([float(t.recompute_cost_s) for t in problem.tensors], dtype=np.float64),
        transfer_time=np.array(transfer, dtype=np.float64),
        offload_exposed=np.array(exposed, dtype=np.float64),
        link=link,
    )


def build_tables(problem: Problem) -> Tables:
    """Precompute residency intervals, offload schedules and input indices of ``problem``."""
    names = problem.tensor_index()
    intervals = []
    allowed = []
    schedules = []
    for i, tensor in enumerate(problem.tensors):
        p, lf = tensor.produced_at, tensor.last_forward_use
        fb, lb = tensor.first_backward_use, tensor.last_backward_use
        opened = problem.allowed_decisions(tensor)
        schedule = offload_schedule(problem, i) if OFFLOAD in opened else None
        keep = ((p, lb),)
        recompute = _merge([(p, lf), (fb, lb)]) if RECOMPUTE in opened else ()
        offload = (
            _merge([(p, schedule.d2h_done_step), (schedule.prefetch_step, lb)]) if schedule is not None else ()
        )
        intervals.append((keep, recompute, offload))
        allowed.append(tuple(DECISION_CODES[d] for d in opened))
        schedules.append(schedule)
    n_steps = len(problem.steps)
    windows = tuple(
        None if sch is None else ((t.produced_at + 1, sch.d2h_done_step), (sch.prefetch_step, t.first_backward_use - 1))
        for t, sch in zip(problem.tensors, schedules)
    )
    transfer = tuple(sch.transfer_time_s if sch is not None else 0.0 for sch in schedules)
    exposed = tuple(sch.exposed_s if sch is not None else 0.0 for sch in schedules)
    prefix = (0.0,) + tuple(itertools.accumulate(float(step.compute_time_s) for step in problem.steps))
    orders = tuple(
        (
            tuple(sorted(((i, w[d][1]) for i, w in enumerate(windows) if w is not None), key=lambda e: (e[1], e[0]))),
            tuple(
                sorted(
                    ((i, min(w[d][0], n_steps - 1)) for i, w in enumerate(windows) if w is not None),
                    key=lambda e: (-e[1], e[0]),
                )
            ),
        )
        for d in (0, 1)
    )
    inputs = tuple(tuple(names[n] for n in t.recompute_inputs if n in names) for t in problem.tensors)
    backward_resident = tuple(tuple(_two_ranges(per_code) for per_code in per_tensor) for per_tensor in intervals)
    return Tables(
        problem=problem,
        n_steps=n_steps,
        nbytes=tuple(t.nbytes for t in problem.tensors),
        work_bytes=tuple(t.recompute_work_bytes for t in problem.tensors),
        last_backward_use=tuple(t.last_backward_use for t in problem.tensors),
        first_backward_use=tuple(t.first_backward_use for t in problem.tensors),
        recompute_cost=tuple(float(t.recompute_cost_s) for t in problem.tensors),
        transfer_time=transfer,
        offload_exposed=exposed,
        intervals=tuple(intervals),
        allowed=tuple(allowed),
        inputs=inputs,
        schedules=tuple(schedules),
        backward_resident=backward_resident,
        total_compute_s=prefix[-1],
        compute_prefix=prefix,
        link_windows=windows,
        link_orders=orders,
        arrays=_build_arrays(problem, intervals, transfer, exposed, orders, prefix, inputs, backward_resident),
    )


def _link_bound_mask(tables: Tables, offloaded: np.ndarray) -> float:
    """:func:`link_bound` for a boolean per-tensor mask of offloaded tensors."""
    order, compute, transfer = tables.arrays.link
    if order.size == 0:
        return 0.0
    chosen = offloaded[order]
    running = np.cumsum(np.where(chosen, transfer, 0.0), axis=1)
    return max(0.0, float(np.max(np.where(chosen, running - compute, -np.inf))))


def link_bound(tables: Tables, offloaded: Sequence[int]) -> float:
    """Serialisation lower bound of the module docstring for the ``offloaded`` tensor indices."""
    mask = np.zeros(len(tables.nbytes), dtype=bool)
    mask[list(offloaded)] = True
    return _link_bound_mask(tables, mask)


class LinkState:
    """:func:`link_bound` of a set of offloaded tensors, with O(1) queries of the bound after
    adding one more tensor (used by the heuristic to price candidate offloads)."""

    def __init__(self, tables: Tables, offloaded: Sequence[int]) -> None:
        self.tables = tables
        prefix = tables.compute_prefix
        n_steps = tables.n_steps
        total = prefix[-1]
        self.parts = []
        for direction in (0, 1):
            ends = [0.0] * n_steps
            starts = [0.0] * n_steps
            for i in offloaded:
                start, end = tables.link_windows[i][direction]
                ends[end] += tables.transfer_time[i]
                starts[min(start, n_steps - 1)] += tables.transfer_time[i]
            by_end = list(itertools.accumulate(ends))
            end_values = [by_end[b] - prefix[b + 1] for b in range(n_steps)]
            by_start = list(itertools.accumulate(reversed(starts)))[::-1]
            start_values = [by_start[a] - (total - prefix[a]) for a in range(n_steps)]
            self.parts.append(
                (
                    [-math.inf] + list(itertools.accumulate(end_values, max)),  # max over b < index
                    list(itertools.accumulate(reversed(end_values), max))[::-1] + [-math.inf],  # b >= index
                    list(itertools.accumulate(start_values, max)) + [-math.inf],  # a <= index
                    list(itertools.accumulate(reversed(start_values), max))[::-1] + [-math.inf],  # a >= index
                )
            )
        self.bound = max([0.0] + [max(part[1][0], part[2][n_steps - 1]) for part in self.parts])

    def bound_with(self, index: int) -> float:
        """The bound after also offloading tensor ``index``."""
        tables = self.tables
        transfer = tables.transfer_time[index]
        n_steps = tables.n_steps
        best = 0.0
        for direction, (end_before, end_from, start_upto, start_after) in enumerate(self.parts):
            start, end = tables.link_windows[index][direction]
            start = min(start, n_steps - 1)
            best = max(best, end_before[end], end_from[end] + transfer, start_upto[start] + transfer,
                       start_after[start + 1])
        return best


@dataclass(frozen=True)
class Evaluation:
    """Memory and time of one assignment (see the module docstring for the model).

    Attributes:
        memory_curve: bytes resident at each step.
        peak_bytes: max of ``memory_curve``.
        peak_step: first step index where the peak occurs (the binding step).
        base_time_s: sum of step compute times.
        recompute_time_s: own recomputes plus transient recomputes.
        transfer_exposed_s: host-transfer time not hidden under compute.
        transients: (tensor index, step, "recompute" | "fetch") materialised for a chain.
        keep_extensions: (tensor index, step) for kept tensors held past their last use.
    """

    memory_curve: tuple[int, ...]
    peak_bytes: int
    peak_step: int
    base_time_s: float
    recompute_time_s: float
    transfer_exposed_s: float
    transients: tuple[tuple[int, int, str], ...]
    keep_extensions: tuple[tuple[int, int], ...]

    @property
    def extra_time_s(self) -> float:
        """Time added to the step by the plan: recomputation plus exposed transfers."""
        return self.recompute_time_s + self.transfer_exposed_s

    @property
    def step_time_s(self) -> float:
        return self.base_time_s + self.extra_time_s


def evaluate_codes(tables: Tables, codes: Sequence[int]) -> Evaluation:
    """:func:`evaluate` on decision codes (``KEEP_CODE`` ...), one per tensor, in tensor order.

    The caller guarantees each code is allowed for its tensor.
    """
    arrays = tables.arrays
    n_steps = tables.n_steps
    nbytes = tables.nbytes
    code_list = list(codes)
    code_array = np.array(code_list, dtype=np.int64)
    recomputed = np.flatnonzero(code_array == RECOMPUTE_CODE).tolist()
    offloaded = code_array == OFFLOAD_CODE
    recompute_time = float(arrays.recompute_cost[recomputed].sum()) if recomputed else 0.0
    # Recompute chains (module docstring): what each recompute point needs that is not resident.
    # Direct inputs are checked vectorised; only the missing ones go through the walk below.
    needed: dict[int, list[int]] = {}
    pair_x, pair_y, pair_step = arrays.pairs
    if recomputed and pair_x.size:
        active = code_array[pair_x] == RECOMPUTE_CODE
        ys = pair_y[active]
        steps = pair_step[active]
        ranges = arrays.resident[ys, code_array[ys]]
        missing = ~(
            ((ranges[:, 0] <= steps) & (steps <= ranges[:, 1])) | ((ranges[:, 2] <= steps) & (steps <= ranges[:, 3]))
        )
        for step, y in sorted(set(zip(steps[missing].tolist(), ys[missing].tolist()))):
            needed.setdefault(step, []).append(y)
    extra_pos: list[int] = []
    extra_val: list[int] = []
    sync_fetch = 0.0
    resident = tables.backward_resident
    transients: list[tuple[int, int, str]] = []
    extension_end: dict[int, int] = {}
    for step in sorted(needed):
        seen: set[int] = set()
        stack = needed[step][::-1]
        while stack:
            y = stack.pop()
            if y in seen:
                continue
            seen.add(y)
            code = code_list[y]
            lo1, hi1, lo2, hi2 = resident[y][code]
            if lo1 <= step <= hi1 or lo2 <= step <= hi2:
                continue
            if code == KEEP_CODE:
                extension_end[y] = max(extension_end.get(y, step), step)
                continue
            transient_bytes = nbytes[y] + (tables.work_bytes[y] if code == RECOMPUTE_CODE else 0)
            extra_pos += (step, step + 1)
            extra_val += (transient_bytes, -transient_bytes)
            if code == RECOMPUTE_CODE:
                recompute_time += tables.recompute_cost[y]
                transients.append((y, step, RECOMPUTE))
                stack.extend(tables.inputs[y])
            else:
                sync_fetch += tables.transfer_time[y]
                transients.append((y, step, "fetch"))
    for y, end in extension_end.items():
        extra_pos += (tables.last_backward_use[y] + 1, end + 1)
        extra_val += (nbytes[y], -nbytes[y])
    positions = arrays.pos[arrays.rows, code_array].ravel()
    values = arrays.val[arrays.rows, code_array].ravel()
    if extra_pos:
        positions = np.concatenate((positions, np.array(extra_pos, dtype=np.int64)))
        values = np.concatenate((values, np.array(extra_val, dtype=np.int64)))
    diff = np.zeros(n_steps + 2, dtype=np.int64)
    np.add.at(diff, positions, values)
    curve_array = arrays.baseline + np.cumsum(diff[:n_steps])
    peak_step = int(np.argmax(curve_array)) if n_steps else 0
    per_tensor_exposed = float(arrays.offload_exposed[offloaded].sum())
    link = _link_bound_mask(tables, offloaded) if offloaded.any() else 0.0
    return Evaluation(
        memory_curve=tuple(curve_array.tolist()),
        peak_bytes=int(curve_array[peak_step]) if n_steps else 0,
        peak_step=peak_step,
        base_time_s=tables.total_compute_s,
        recompute_time_s=recompute_time,
        transfer_exposed_s=max(per_tensor_exposed, link) + sync_fetch,
        transients=tuple(sorted(transients)),
        keep_extensions=tuple(sorted(extension_end.items())),
    )


def assignment_codes(problem: Problem, assignment: Mapping[str, str], tables: Tables | None = None) -> list[int]:
    """Decision codes for ``assignment`` (name -> decision); names it omits are kept.

    Raises ValueError naming the tensor for unknown names, unknown decisions, and decisions
    not open to the tensor (recompute of a non-recomputable tensor, offload with offload off).
    """
    names = problem.tensor_index()
    unknown = sorted(set(assignment) - set(names))
    if unknown:
        raise ValueError(f"assignment names {unknown}, which are not saved tensors of the problem")
    codes = [KEEP_CODE] * len(problem.tensors)
    for name, decision in assignment.items():
        if decision not in DECISION_CODES:
            raise ValueError(f"assignment[{name!r}]={decision!r} is not accepted; accepted: {list(DECISIONS)}")
        tensor = problem.tensors[names[name]]
        if decision not in problem.allowed_decisions(tensor):
            why = "it is not recomputable" if decision == RECOMPUTE else (
                "offload is disabled (Problem.host_link_bandwidth is None)"
                if problem.host_link_bandwidth is None
                else "it is not offloadable"
            )
            raise ValueError(f"assignment[{name!r}]={decision!r} is not open to this tensor: {why}")
        codes[names[name]] = DECISION_CODES[decision]
    return codes


def evaluate(problem: Problem, assignment: Mapping[str, str]) -> Evaluation:
    """Memory curve, peak and estimated step time of ``assignment`` (name -> "keep" |
    "recompute" | "offload"; omitted names are kept), under the model of this module."""
    tables = build_tables(problem)
    return evaluate_codes(tables, assignment_codes(problem, assignment, tables))


def memory_curve(problem: Problem, assignment: Mapping[str, str]) -> tuple[int, ...]:
    """Bytes resident at each step under ``assignment``."""
    return evaluate(problem, assignment).memory_curve
