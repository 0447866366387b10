"""The exact planner: optimal against brute force, infeasible budgets, determinism."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from mxcompile.planner import BudgetInfeasibleError, plan_activation_memory
from mxcompile.planner.ilp import min_peak
from mxcompile.planner.synthetic import transformer_problem
from planner.planner_strategies import TIME_TOL, all_assignments, brute_force, problems

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=40, **SETTINGS)
@given(problems(min_tensors=3, max_tensors=6))
def test_ilp_is_optimal_against_brute_force(problem):
    best_time, smallest_peak = brute_force(problem)
    if best_time is None:
        with pytest.raises(BudgetInfeasibleError) as info:
            plan_activation_memory(problem, solver="ilp")
        assert info.value.min_peak_bytes == smallest_peak
        assert info.value.exact
        return
    plan = plan_activation_memory(problem, solver="ilp")
    assert plan.solver == "ilp"
    assert plan.peak_bytes <= problem.budget_bytes
    assert plan.step_time_s <= best_time * (1 + TIME_TOL) + 1e-15
    assert plan.step_time_s >= best_time * (1 - TIME_TOL) - 1e-15
    evaluations = [e for _, e in all_assignments(problem)]
    keep_peak = evaluations[0].peak_bytes  # the first assignment keeps everything
    if keep_peak <= problem.budget_bytes:
        assert plan.peak_bytes == keep_peak and plan.extra_time_s == 0.0
        assert all(d.reason == "kept: budget not binding" for d in plan.decisions)
    else:
        # Tie-break: the lowest peak among the fastest plans.
        fastest_peaks = [
            e.peak_bytes
            for e in evaluations
            if e.peak_bytes <= problem.budget_bytes and e.step_time_s <= best_time * (1 + TIME_TOL) + 1e-15
        ]
        assert plan.peak_bytes == min(fastest_peaks)


@settings(max_examples=25, **SETTINGS)
@given(problems(min_tensors=2, max_tensors=5))
def test_ilp_monotone_in_budget(problem):
    _, smallest = brute_force(problem)
    keep_peak = plan_activation_memory(replace(problem, budget_bytes=2**40), solver="ilp").peak_bytes
    budgets = sorted({smallest, (smallest + keep_peak) // 2, keep_peak - 1, keep_peak} - {0})
    plans = [plan_activation_memory(replace(problem, budget_bytes=b), solver="ilp") for b in budgets if b >= smallest]
    for low, high in zip(plans, plans[1:]):
        assert low.peak_bytes <= high.peak_bytes
        assert low.step_time_s >= high.step_time_s * (1 - TIME_TOL)


def test_infeasible_budget_message_gives_the_smallest_feasible_budget():
    problem, _ = transformer_problem(2, budget_fraction=0.5, tokens=1024, hidden=256)
    smallest = min_peak(problem)[0].peak_bytes
    tight = replace(problem, budget_bytes=smallest - 1)
    with pytest.raises(BudgetInfeasibleError) as info:
        plan_activation_memory(tight, solver="ilp")
    message = str(info.value)
    assert f"raise memory_budget to at least {smallest} bytes" in message
    assert "proven minimal" in message
    assert info.value.min_peak_bytes == smallest and info.value.exact
    assert isinstance(info.value, ValueError)
    plan = plan_activation_memory(replace(problem, budget_bytes=smallest), solver="ilp")
    assert plan.peak_bytes == smallest


def test_baseline_over_budget_is_reported():
    problem, _ = transformer_problem(1, budget_fraction=0.5, tokens=1024, hidden=256)
    over = replace(problem, budget_bytes=max(problem.baseline_bytes) - 1)
    with pytest.raises(BudgetInfeasibleError, match="the baseline alone"):
        plan_activation_memory(over, solver="ilp")


def test_ilp_deterministic():
    problem, _ = transformer_problem(2, budget_fraction=0.45, tokens=1024, hidden=256)
    first = plan_activation_memory(problem, solver="ilp")
    second = plan_activation_memory(problem, solver="ilp")
    rebuilt, _ = transformer_problem(2, budget_fraction=0.45, tokens=1024, hidden=256)
    third = plan_activation_memory(rebuilt, solver="ilp")
    assert first == second == third
    assert first.optimal and math.isfinite(first.step_time_s)


def test_ilp_with_tie_groups_gives_groups_one_decision():
    problem, groups = transformer_problem(3, budget_fraction=0.4, tokens=1024, hidden=256)
    plan = plan_activation_memory(problem, solver="ilp", tie_groups=groups)
    decided = plan.assignment()
    for group in groups:
        assert len({decided[name] for name in group}) == 1
    untied = plan_activation_memory(problem, solver="ilp")
    assert untied.step_time_s <= plan.step_time_s * (1 + TIME_TOL)
