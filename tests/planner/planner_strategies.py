"""Hypothesis strategies and brute force for the planner tests."""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import strategies as st

from mxcompile.planner.memory import KEEP_CODE, build_tables, evaluate_codes
from mxcompile.planner.problem import BACKWARD, FORWARD, Problem, SavedTensor, Step

MS = 1e-3
TIME_TOL = 1e-9  # relative tolerance when comparing step times


@st.composite
def problems(draw, max_tensors: int = 6, max_forward: int = 5, max_backward: int = 5, min_tensors: int = 0) -> Problem:
    """Small random problems with chains, non-recomputable tensors and offload windows."""
    n_fwd = draw(st.sampled_from(range(1, max_forward + 1)))
    n_bwd = draw(st.sampled_from(range(1, max_backward + 1)))
    n_steps = n_fwd + n_bwd
    times = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=n_steps, max_size=n_steps))
    steps = tuple(
        Step(f"s{t}", FORWARD if t < n_fwd else BACKWARD, times[t] * MS) for t in range(n_steps)
    )
    n = draw(st.sampled_from(range(min_tensors, max_tensors + 1)))  # uniform: integers() favours tiny
    tensors: list[SavedTensor] = []
    for i in range(n):
        p = draw(st.integers(0, n_fwd - 1))
        lf = draw(st.integers(p, n_fwd - 1))
        fb = draw(st.integers(n_fwd, n_steps - 1))
        lb = draw(st.integers(fb, n_steps - 1))
        earlier = [t.name for t in tensors if t.produced_at <= p]
        inputs = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=2)) if earlier else []
        if draw(st.booleans()):
            inputs.append("w")
        tensors.append(
            SavedTensor(
                name=f"t{i}",
                nbytes=draw(st.integers(0, 64)),
                produced_at=p,
                last_forward_use=lf,
                first_backward_use=fb,
                last_backward_use=lb,
                recompute_cost_s=draw(st.sampled_from([0.0, 0.25, 1.0, 2.0, 5.0])) * MS,
                recompute_inputs=tuple(inputs),
                recomputable=draw(st.booleans()) or draw(st.booleans()),
                offloadable=draw(st.booleans()) or draw(st.booleans()),
                recompute_work_bytes=draw(st.sampled_from([0, 0, 8, 40])),
            )
        )
    baseline = tuple(draw(st.lists(st.integers(0, 32), min_size=n_steps, max_size=n_steps)))
    bandwidth = draw(st.sampled_from([None, 8e3, 32e3, 1e6]))  # bytes/s: 64 B take 8 ms .. 0.06 ms
    problem = Problem(steps, tuple(tensors), baseline, budget_bytes=1, resident_inputs=("w",),
                      host_link_bandwidth=bandwidth)
    tables = build_tables(problem)
    keep_peak = evaluate_codes(tables, [KEEP_CODE] * n).peak_bytes
    min_peak = min(evaluate_codes(tables, codes).peak_bytes for codes in itertools.product(*tables.allowed))
    if draw(st.integers(0, 9)) == 0:  # one in ten: infeasible when possible
        budget = draw(st.integers(1, max(min_peak - 1, 1)))
    else:
        budget = draw(st.integers(max(min_peak, 1), max(keep_peak, 1)))
    return replace(problem, budget_bytes=budget)


def all_assignments(problem: Problem):
    """Every assignment as per-tensor codes, with its evaluation."""
    tables = build_tables(problem)
    for codes in itertools.product(*tables.allowed):
        yield codes, evaluate_codes(tables, codes)


def brute_force(problem: Problem):
    """(best time within budget or None, smallest peak over all assignments)."""
    best_time = None
    min_peak = None
    for _, evaluation in all_assignments(problem):
        if min_peak is None or evaluation.peak_bytes < min_peak:
            min_peak = evaluation.peak_bytes
        if evaluation.peak_bytes <= problem.budget_bytes:
            if best_time is None or evaluation.step_time_s < best_time:
                best_time = evaluation.step_time_s
    return best_time, min_peak
