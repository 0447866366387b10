"""Validation of the planning problem: every error names the offending field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mxcompile.planner import Problem, SavedTensor, Step


def _problem(**changes) -> Problem:
    steps = (Step("f0", "forward", 1e-3), Step("f1", "forward", 1e-3), Step("b0", "backward", 1e-3))
    tensors = (
        SavedTensor("a", 10, 0, 0, 2),
        SavedTensor("b", 10, 1, 1, 2, recompute_inputs=("a", "w")),
    )
    fields = dict(steps=steps, tensors=tensors, baseline_bytes=(0, 0, 0), budget_bytes=100, resident_inputs=("w",))
    fields.update(changes)
    return Problem(**fields)


def test_valid_problem_and_defaults():
    problem = _problem()
    assert problem.n_forward_steps == 2
    assert problem.tensors[0].last_backward_use == 2  # defaults to first_backward_use
    assert problem.transfer_time_s(problem.tensors[0]) is None
    assert problem.allowed_decisions(problem.tensors[0]) == ("keep", "recompute")
    with_link = replace(problem, host_link_bandwidth=10.0)
    assert with_link.transfer_time_s(with_link.tensors[0]) == 1.0
    assert with_link.allowed_decisions(with_link.tensors[0]) == ("keep", "recompute", "offload")


@pytest.mark.parametrize(
    "build, expected",
    [
        (lambda: Step("x", "sideways", 0.0), "phase"),
        (lambda: Step("x", "forward", -1.0), "compute_time_s"),
        (lambda: Step("x", "forward", float("nan")), "compute_time_s"),
        (lambda: SavedTensor("", 1, 0, 0, 1), "SavedTensor.name"),
        (lambda: SavedTensor("a", -1, 0, 0, 1), "nbytes"),
        (lambda: SavedTensor("a", 1.5, 0, 0, 1), "nbytes"),
        (lambda: SavedTensor("a", 1, 2, 1, 3), "last_forward_use"),
        (lambda: SavedTensor("a", 1, 0, 1, 1), "first_backward_use"),
        (lambda: SavedTensor("a", 1, 0, 0, 3, last_backward_use=2), "last_backward_use"),
        (lambda: SavedTensor("a", 1, 0, 0, 1, recompute_cost_s=-1.0), "recompute_cost_s"),
        (lambda: SavedTensor("a", 1, 0, 0, 1, recompute_inputs=("a",)), "recompute_inputs"),
        (lambda: SavedTensor("a", 1, 0, 0, 1, recomputable=1), "recomputable"),
        (lambda: _problem(baseline_bytes=(0, 0)), "baseline_bytes"),
        (lambda: _problem(baseline_bytes=(0, -1, 0)), "baseline_bytes[1]"),
        (lambda: _problem(budget_bytes=0), "budget_bytes"),
        (lambda: _problem(budget_bytes=10.0), "budget_bytes"),
        (lambda: _problem(host_link_bandwidth=0.0), "host_link_bandwidth"),
        (
            lambda: _problem(steps=(Step("f0", "forward", 0), Step("b0", "backward", 0), Step("f1", "forward", 0))),
            "Problem.steps[2]",
        ),
        (lambda: _problem(tensors=(SavedTensor("a", 1, 0, 0, 2), SavedTensor("a", 1, 0, 0, 2))), "used twice"),
        (lambda: _problem(tensors=(SavedTensor("a", 1, 2, 2, 3),)), "produced_at=2 is not a forward step"),
        (lambda: _problem(tensors=(SavedTensor("a", 1, 0, 0, 1),)), "first_backward_use"),
        (lambda: _problem(tensors=(SavedTensor("a", 1, 0, 0, 2, recompute_inputs=("zz",)),)), "recompute_inputs"),
        (
            lambda: _problem(
                tensors=(SavedTensor("a", 1, 0, 0, 2, recompute_inputs=("b",)), SavedTensor("b", 1, 1, 1, 2))
            ),
            "produced at step 1",
        ),
        (
            lambda: _problem(
                tensors=(
                    SavedTensor("a", 1, 0, 0, 2, recompute_inputs=("b",)),
                    SavedTensor("b", 1, 0, 0, 2, recompute_inputs=("a",)),
                )
            ),
            "cycle",
        ),
        (lambda: _problem(resident_inputs=("w", "a")), "resident_inputs"),
    ],
)
def test_errors_name_the_field(build, expected):
    with pytest.raises(ValueError, match=None) as info:
        build()
    assert expected in str(info.value)
