"""The model zoo trains under the mxfp8 pipeline (issue 16): for each architecture, two training
steps close to eager with finite gradients, explain converting at least 95% of the GEMM FLOPs,
and an eval-mode forward under no_grad converted as well. The rewritten graphs run eagerly
(`lower=eager_compiler`): this is about the rewrite, not Inductor; one fixture per model does
all its compiles once."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

import mxcompile
from mxcompile.report import Report
from zoo import LR, SEQ, ZOO, ZooModel, assert_converted, params_marking, recording_eager_backend

STEPS = 2
LOSS_TOLERANCE = 0.10  # relative to eager's loss at the same step (dropout draws differ)


@dataclass
class ZooRun:
    eager_losses: list[float]
    mx_losses: list[float]
    nonfinite_grads: list[str]
    missing_grads: list[str]
    explained: Report
    training: list[Report]
    inference: list[Report]


def _train(model: torch.nn.Module, call, batch, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(seed)
    losses, grads = [], {}
    for _ in range(STEPS):
        loss = call(**batch).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def run_zoo_model(spec: ZooModel, seq: int = SEQ) -> ZooRun:
    torch.manual_seed(0)
    model = spec.build().train()
    batch = spec.batch(seq)
    reference = copy.deepcopy(model)
    eager_losses, eager_grads = _train(reference, reference, batch, seed=1)
    explained = mxcompile.explain(copy.deepcopy(model), **batch)
    compiled = torch.compile(model, backend=recording_eager_backend())
    mx_losses, mx_grads = _train(model, compiled, batch, seed=1)
    training = mxcompile.report_of(model)
    model.eval()
    with torch.no_grad():
        compiled(**batch)
    inference = mxcompile.report_of(model)[len(training):]
    return ZooRun(
        eager_losses, mx_losses,
        nonfinite_grads=[n for n, g in mx_grads.items() if not torch.isfinite(g).all()],
        missing_grads=sorted(set(eager_grads) - set(mx_grads)),
        explained=explained, training=training, inference=inference)


# Measured before zero-padding of contraction axes (issue 16 items 2-4) landed; strict, so they
# turn into failures (XPASS) when it does, and the mark goes.
NOT_CONVERTED: dict[str, str] = {
    "vit": "53% of GEMM FLOPs converted: 12 weight-grad GEMMs kept, 'contraction length 260 is not "
           "divisible by block_size=32' (27%); attention kept, 'key length 65 is not divisible by "
           "block_size=32' (20%)",
}
NOT_TRAINING: dict[str, str] = {}


@pytest.fixture(scope="module")
def zoo_runs():
    """name -> ZooRun, each model run once on first use and shared by the tests."""
    runs: dict[str, ZooRun] = {}

    def get(name: str) -> ZooRun:
        if name not in runs:
            runs[name] = run_zoo_model(ZOO[name])
        return runs[name]

    return get


@pytest.mark.parametrize("name", params_marking(NOT_TRAINING))
def test_two_steps_close_to_eager_with_finite_gradients(zoo_runs, name):
    run = zoo_runs(name)
    for step, (eager, mx) in enumerate(zip(run.eager_losses, run.mx_losses)):
        assert abs(mx - eager) <= LOSS_TOLERANCE * abs(eager), (step, run.eager_losses, run.mx_losses)
    assert not run.nonfinite_grads, run.nonfinite_grads
    assert not run.missing_grads, run.missing_grads


@pytest.mark.parametrize("name", params_marking(NOT_CONVERTED))
def test_explain_converts_most_gemm_flops(zoo_runs, name):
    run = zoo_runs(name)
    assert_converted(run.explained)
    assert run.training, "the training compile left no report"
    for report in run.training:
        assert_converted(report)


@pytest.mark.parametrize("name", params_marking(NOT_CONVERTED))
def test_eval_forward_under_no_grad_is_converted(zoo_runs, name):
    run = zoo_runs(name)
    assert run.inference, "the eval forward compiled no graph"
    for report in run.inference:
        assert {d.graph for d in report.decisions} <= {"inference"}
        assert_converted(report)
