"""The cost model: hand-built examples with known numbers, and an independent step-by-step
reimplementation of the documented rules checked against the fast evaluator."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings

from mxcompile.planner import Problem, SavedTensor, Step, evaluate, memory_curve
from mxcompile.planner.memory import (
    OFFLOAD_CODE,
    LinkState,
    build_tables,
    evaluate_codes,
    link_bound,
    offload_schedule,
)
from planner.planner_strategies import problems

MS = 1e-3
DECISION_NAMES = ("keep", "recompute", "offload")


def _two_tensor_problem() -> Problem:
    """f0 1 ms, f1 2 ms, f2 1 ms | b3 1 ms, b4 2 ms, b5 1 ms; 100 B/ms host link.

    a: 100 B, produced f0, last forward use f1, backward uses b4..b5, recompute 0.5 ms.
    b:  50 B, produced f1, last forward use f2, backward use b3, recompute 1 ms from a.
    """
    times = (1, 2, 1, 1, 2, 1)
    steps = tuple(Step(f"s{t}", "forward" if t < 3 else "backward", times[t] * MS) for t in range(6))
    tensors = (
        SavedTensor("a", 100, 0, 1, 4, 5, recompute_cost_s=0.5 * MS, recompute_inputs=("w",)),
        SavedTensor("b", 50, 1, 2, 3, 3, recompute_cost_s=1.0 * MS, recompute_inputs=("a",)),
    )
    return Problem(steps, tensors, (10, 10, 10, 20, 20, 20), budget_bytes=1000, resident_inputs=("w",),
                   host_link_bandwidth=100 / MS)


@pytest.mark.parametrize(
    "assignment, curve, time_ms",
    [
        ({}, (110, 160, 160, 170, 120, 120), 8.0),
        # a is not live over f2..b3 (steps 2-3); recomputed at b4 for 0.5 ms.
        ({"a": "recompute"}, (110, 160, 60, 70, 120, 120), 8.5),
        # b's forward use and backward use are adjacent: no gap, only the cost.
        ({"b": "recompute"}, (110, 160, 160, 170, 120, 120), 9.0),
        # b recomputed at b3 needs a, which is not resident there: a is recomputed transiently at
        # b3 (100 B at step 3 only, 0.5 ms more) and again at its own first use b4.
        ({"a": "recompute", "b": "recompute"}, (110, 160, 60, 170, 120, 120), 10.0),
        # a offloaded: copy-out (1 ms) hidden under f1 (2 ms), prefetch (1 ms) under b3 (1 ms).
        ({"a": "offload"}, (110, 160, 60, 170, 120, 120), 8.0),
        # b offloaded: no gap between copy-out done (f2) and b3, prefetch fully exposed (0.5 ms).
        ({"b": "offload"}, (110, 160, 160, 170, 120, 120), 8.5),
    ],
)
def test_hand_built_curves_and_times(assignment, curve, time_ms):
    problem = _two_tensor_problem()
    result = evaluate(problem, assignment)
    assert result.memory_curve == curve
    assert memory_curve(problem, assignment) == curve
    assert result.peak_bytes == max(curve)
    assert result.peak_step == curve.index(max(curve))
    assert result.step_time_s == pytest.approx(time_ms * MS)


def test_hand_built_chain_and_offload_details():
    problem = _two_tensor_problem()
    both = evaluate(problem, {"a": "recompute", "b": "recompute"})
    assert both.transients == ((0, 3, "recompute"),)
    assert both.recompute_time_s == pytest.approx(2.0 * MS)
    schedule = offload_schedule(problem, 0)
    assert (schedule.d2h_done_step, schedule.prefetch_step) == (1, 3)
    assert schedule.exposed_s == 0.0
    schedule_b = offload_schedule(problem, 1)
    assert (schedule_b.d2h_done_step, schedule_b.prefetch_step) == (2, 3)
    assert schedule_b.h2d_exposed_s == pytest.approx(0.5 * MS)


def test_keep_extension_and_synchronous_fetch():
    steps = tuple(Step(f"s{t}", "forward" if t < 3 else "backward", 1 * MS) for t in range(7))
    # y's only backward use is step 4; x, recomputed at step 6, needs y.
    y = SavedTensor("y", 40, 0, 0, 4, 4)
    x = SavedTensor("x", 8, 1, 1, 6, 6, recompute_cost_s=1 * MS, recompute_inputs=("y",))
    problem = Problem(steps, (y, x), (0,) * 7, budget_bytes=1000, host_link_bandwidth=40 / MS)
    kept = evaluate(problem, {"x": "recompute"})
    # y kept: held past its last use (step 4) through step 6.
    assert kept.keep_extensions == ((0, 6),)
    assert kept.memory_curve == (40, 48, 40, 40, 40, 40, 48)
    # y offloaded (copy-out hidden under step 1, prefetch under step 3, back for step 4), so x's
    # recompute at step 6 fetches it again synchronously: T = 1 ms exposed, 40 B at step 6.
    fetched = evaluate(problem, {"x": "recompute", "y": "offload"})
    assert fetched.transients == ((0, 6, "fetch"),)
    assert fetched.memory_curve == (40, 48, 0, 40, 40, 0, 48)
    assert fetched.transfer_exposed_s == pytest.approx(1 * MS)
    assert fetched.step_time_s == pytest.approx(9 * MS)


def test_recompute_work_bytes_at_the_recompute_point_and_in_transients():
    steps = tuple(Step(f"s{t}", "forward" if t < 3 else "backward", 1 * MS) for t in range(7))
    # y (10 B, replay holds 100 B more) is recomputed at step 5; x, recomputed at step 3,
    # needs y before then: a transient replay of y at step 3 holds y and its work.
    y = SavedTensor("y", 10, 0, 0, 5, 5, recompute_cost_s=1 * MS, recompute_work_bytes=100)
    x = SavedTensor("x", 8, 1, 1, 3, 3, recompute_cost_s=1 * MS, recompute_inputs=("y",),
                    recompute_work_bytes=30)
    problem = Problem(steps, (y, x), (0,) * 7, budget_bytes=1000)
    only_y = evaluate(problem, {"y": "recompute"})
    assert only_y.memory_curve == (10, 8, 8, 8, 0, 110, 0)
    both = evaluate(problem, {"y": "recompute", "x": "recompute"})
    assert both.transients == ((0, 3, "recompute"),)
    assert both.memory_curve == (10, 8, 0, 8 + 30 + 10 + 100, 0, 110, 0)


def test_link_serialisation_bound():
    # Two 80 B tensors with 100 B/ms: 0.8 ms each, each hidden alone under the 1 ms step f1,
    # but the link carries one at a time: 1.6 ms of copy-out in a 1 ms window.
    steps = (Step("f0", "forward", 0.0), Step("f1", "forward", 1 * MS), Step("b2", "backward", 5 * MS),
             Step("b3", "backward", 0.0))
    tensors = (SavedTensor("x", 80, 0, 0, 3), SavedTensor("y", 80, 0, 0, 3))
    problem = Problem(steps, tensors, (0,) * 4, budget_bytes=1000, host_link_bandwidth=100 / MS)
    one = evaluate(problem, {"x": "offload"})
    assert one.transfer_exposed_s == 0.0
    both = evaluate(problem, {"x": "offload", "y": "offload"})
    assert both.transfer_exposed_s == pytest.approx(0.6 * MS)


def test_evaluate_rejects_bad_assignments():
    problem = _two_tensor_problem()
    with pytest.raises(ValueError, match="'zz'"):
        evaluate(problem, {"zz": "keep"})
    with pytest.raises(ValueError, match=r"assignment\['a'\]='drop'"):
        evaluate(problem, {"a": "drop"})
    no_link = Problem(problem.steps, problem.tensors, problem.baseline_bytes, 1000, resident_inputs=("w",))
    with pytest.raises(ValueError, match="offload is disabled"):
        evaluate(no_link, {"a": "offload"})


# -- an independent, step-by-step implementation of the module docstring's rules -------------


def _reference(problem: Problem, codes) -> tuple[list[int], float]:
    steps = problem.steps
    n_steps = len(steps)
    c = [s.compute_time_s for s in steps]
    tensors = problem.tensors
    names = {t.name: i for i, t in enumerate(tensors)}
    resident: list[set[int]] = []
    exposed_each = []
    windows = []
    for t, code in zip(tensors, codes):
        p, lf, fb, lb = t.produced_at, t.last_forward_use, t.first_backward_use, t.last_backward_use
        if DECISION_NAMES[code] == "keep":
            resident.append(set(range(p, lb + 1)))
        elif DECISION_NAMES[code] == "recompute":
            resident.append(set(range(p, lf + 1)) | set(range(fb, lb + 1)))
        else:
            transfer = t.nbytes / problem.host_link_bandwidth
            done, hidden_out = lf, sum(c[p + 1 : lf + 1])
            while hidden_out < transfer and done < fb - 1:
                done += 1
                hidden_out += c[done]
            start, hidden_in = fb, 0.0
            while hidden_in < transfer and start > done + 1:
                start -= 1
                hidden_in += c[start]
            resident.append(set(range(p, done + 1)) | set(range(start, lb + 1)))
            exposed_each.append(max(0.0, transfer - hidden_out) + max(0.0, transfer - hidden_in))
            windows.append(((p + 1, done), (start, fb - 1), transfer))
    memory = [problem.baseline_bytes[s] + sum(t.nbytes for t, r in zip(tensors, resident) if s in r)
              for s in range(n_steps)]
    for t, code in zip(tensors, codes):
        if DECISION_NAMES[code] == "recompute":
            memory[t.first_backward_use] += t.recompute_work_bytes
    extra = sum(t.recompute_cost_s for t, code in zip(tensors, codes) if DECISION_NAMES[code] == "recompute")
    fetch = 0.0
    extended: dict[int, int] = {}
    points = sorted({t.first_backward_use for t, code in zip(tensors, codes) if DECISION_NAMES[code] == "recompute"})
    for s in points:
        todo = [names[n] for x, code in zip(tensors, codes)
                if DECISION_NAMES[code] == "recompute" and x.first_backward_use == s
                for n in x.recompute_inputs if n in names]
        done_here: set[int] = set()
        while todo:
            y = todo.pop()
            if y in done_here:
                continue
            done_here.add(y)
            if s in resident[y]:
                continue
            kind = DECISION_NAMES[codes[y]]
            if kind == "keep":
                extended[y] = max(extended.get(y, s), s)
            elif kind == "recompute":
                memory[s] += tensors[y].nbytes + tensors[y].recompute_work_bytes
                extra += tensors[y].recompute_cost_s
                todo += [names[n] for n in tensors[y].recompute_inputs if n in names]
            else:
                memory[s] += tensors[y].nbytes
                fetch += tensors[y].nbytes / problem.host_link_bandwidth
    for y, end in extended.items():
        for s in range(tensors[y].last_backward_use + 1, end + 1):
            memory[s] += tensors[y].nbytes
    link = 0.0
    for direction in (0, 1):
        for b in range(n_steps):
            link = max(link, sum(w[2] for w in windows if w[direction][1] <= b) - sum(c[: b + 1]))
            link = max(link, sum(w[2] for w in windows if w[direction][0] >= b) - sum(c[b:]))
    transfer_exposed = max(sum(exposed_each), link) + fetch
    return memory, sum(c) + extra + transfer_exposed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(min_tensors=1, max_tensors=4))
def test_fast_evaluator_matches_reference(problem):
    tables = build_tables(problem)
    for codes in itertools.product(*tables.allowed):
        fast = evaluate_codes(tables, codes)
        memory, step_time = _reference(problem, codes)
        assert list(fast.memory_curve) == memory, codes
        assert math.isclose(fast.step_time_s, step_time, rel_tol=1e-12, abs_tol=1e-15), codes


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_tensors=6))
def test_link_state_matches_link_bound(problem):
    tables = build_tables(problem)
    offloadable = [i for i, allowed in enumerate(tables.allowed) if OFFLOAD_CODE in allowed]
    for size in range(len(offloadable) + 1):
        base = offloadable[:size]
        state = LinkState(tables, base)
        assert math.isclose(state.bound, link_bound(tables, base), abs_tol=1e-15)
        for extra in offloadable[size:]:
            assert math.isclose(state.bound_with(extra), link_bound(tables, base + [extra]), abs_tol=1e-15)
