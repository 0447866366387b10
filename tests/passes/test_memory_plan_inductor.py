"""Issue 37: a memory budget never raises the peak under Inductor.

* A budget at or above the keep-everything peak (1.0) plans nothing: the graphs that reach the
  lowering are the unplanned partition's, unmarked, so they compile as without a budget
  (Inductor's peak-memory reordering and buffer reuse on). Before, they were marked planned and
  compiled with both off: on a 12-layer Linear(1024)+GELU MLP the step's resident peak rose from
  241 to 340 MiB at 1.0.
* Planned graphs compile with Inductor's peak-memory reordering on, each recomputation pinned
  after the backward node the plan put before it (`lowering.PinRecomputation`).

Small MLPs keep the Inductor compiles of this module short (a few seconds each, warm cache).
"""

from __future__ import annotations

import functools

import pytest
import torch

from mxcompile.backend import compile_graph
from mxcompile.config import MemoryBudget, MXConfig
from mxcompile.lowering import eager_compiler
from mxcompile.passes.meta_keys import PLANNED_GRAPH_KEY
from mxcompile.report import Report


def _mlp(layers: int = 4, width: int = 128, rows: int = 256):
    torch.manual_seed(0)
    parts = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*parts), torch.randn(rows, width)


def _lowered_graphs(budget):
    """(report, [(graph code, planned flag)] of the graphs the lowering received, gradients)
    of one eager-lowered step of the small MLP under ``budget`` (a fraction or None)."""
    torch._dynamo.reset()
    model, x = _mlp()
    config = MXConfig(memory_budget=None if budget is None else MemoryBudget.of_fraction(budget))
    report = Report(config.to_dict())
    seen = []

    def lower(gm, inputs):
        seen.append((gm.code, bool(gm.meta.get(PLANNED_GRAPH_KEY))))
        return eager_compiler(gm, inputs)

    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, lower=lower,
                                                              report=report))
    compiled(x).square().mean().backward()
    return report, seen, [p.grad.clone() for p in model.parameters()]


def test_budget_at_the_keep_everything_peak_plans_nothing() -> None:
    _, unplanned, grads = _lowered_graphs(None)
    report, at_one, grads_at_one = _lowered_graphs(1.0)
    plan = report.memory_plan
    assert plan is not None and not plan["recomputed"] and not plan["offloaded"], plan
    assert len(unplanned) == len(at_one) == 2  # forward and backward
    # Same graphs as without a budget, and not marked planned (so compiled as unplanned ones).
    assert at_one == unplanned, [flag for _, flag in at_one]
    assert plan["graphs_changed"] is False
    for a, b in zip(grads, grads_at_one):
        assert torch.equal(a, b)


def test_a_budget_that_recomputes_marks_the_graphs_and_the_recomputation() -> None:
    report, lowered, _ = _lowered_graphs(0.3)
    assert report.memory_plan["recomputed"] and report.memory_plan["graphs_changed"] is True
    assert [flag for _, flag in lowered] == [True, True]


def test_cpu_graphs_compile_without_inductor_buffer_reuse(monkeypatch) -> None:
    """Without a budget too: Inductor's buffer reuse held dead fake-quantized GEMM operands of
    the backward until a buffer of their size came along, across the attention backward (tensor
    peaks of the small Llama's step, reuse on / off: 72.9 / 62.6 MiB), above the memory plan's
    keep-everything model. Inductor itself is stubbed: this checks the setting it compiles with."""
    import torch._inductor.compile_fx as compile_fx
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import config as inductor_config

    seen = []

    def compile_fx_inner(gm, example_inputs, **kwargs):
        seen.append(inductor_config.allow_buffer_reuse)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", compile_fx_inner)
    torch._dynamo.reset()
    model, x = _mlp(layers=1, width=64, rows=64)
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=MXConfig()))
    compiled(x).square().mean().backward()
    torch._dynamo.reset()
    assert seen == [False, False], seen  # forward and backward


# --------------------------------------------------------------------------- under Inductor
# 12 x Linear(256, 256) + GELU on 1024 rows: large enough that Inductor's peak-memory reordering
# matters (1 MiB activations), small enough to compile in seconds. Peaks are the profiler's
# tensor-storage peaks of one step (what the plan models; parameters and inputs excluded).
# Measured 2026-12-06 (tensor bytes): mxfp8 no budget 21069832; 1.0 / 0.5 / 0.3: 25436160 /
# 20193280 / 19136512 with planned graphs compiled unreordered (before issue 37), 21069832 /
# 15826952 / 13729800 with pinned reordering; torch's activation_memory_budget 0.5: 16777224.
BIG = {"layers": 12, "width": 256, "rows": 1024}
FRACTIONS = (1.0, 0.5, 0.3)
TORCH_FRACTION = 0.5
NO_OP_TOLERANCE = 0.03  # issue 37: a budget of 1.0 gives the no-budget peak within 3%


def _inductor_step(budget, scheduled=None):
    """(memory_plan report, tensor peak bytes) of one step of the BIG MLP compiled by the mxfp8
    backend with Inductor. ``scheduled`` collects, per graph Inductor reorders for peak memory,
    its final kernel order as (plain positions, recomputing positions) of each kernel."""
    import torch._inductor.memory as inductor_memory

    from mxcompile.measure.memory import tensor_peak_bytes

    torch._dynamo.reset()
    model, x = _mlp(**BIG)
    if budget is not None and not isinstance(budget, MemoryBudget):
        budget = MemoryBudget.of_fraction(budget)
    config = MXConfig(memory_budget=budget)
    report = Report(config.to_dict())
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, report=report))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    reorder = inductor_memory.reorder_for_peak_memory

    def recording(*args, **kwargs):
        from mxcompile.lowering import _origin_positions

        order = reorder(*args, **kwargs)
        scheduled.append([_origin_positions(node) for node in order])
        return order

    if scheduled is None:
        step()
    else:  # record Inductor's scheduling: compile for real, not from a cache
        inductor_memory.reorder_for_peak_memory = recording
        try:
            with torch.compiler.config.patch(force_disable_caches=True):
                step()
        finally:
            inductor_memory.reorder_for_peak_memory = reorder
    return report.memory_plan, tensor_peak_bytes(step)


def _torch_step_peak(fraction: float) -> int:
    import torch._functorch.config as functorch_config

    from mxcompile.measure.memory import tensor_peak_bytes

    torch._dynamo.reset()
    model, x = _mlp(**BIG)
    compiled = torch.compile(model)

    def step() -> None:
        with functorch_config.patch(activation_memory_budget=fraction):
            model.zero_grad(set_to_none=True)
            compiled(x).square().mean().backward()

    step()
    return tensor_peak_bytes(step)


@pytest.fixture(scope="module")
def inductor_runs():
    scheduled: list = []
    runs = {None: _inductor_step(None)}
    for fraction in FRACTIONS:
        runs[fraction] = _inductor_step(fraction, scheduled if fraction == FRACTIONS[-1] else None)
    return runs, scheduled


@pytest.mark.slow
def test_inductor_budget_of_one_is_the_no_budget_step(inductor_runs) -> None:
    runs, _ = inductor_runs
    unplanned, at_one = runs[None][1], runs[1.0][1]
    # Before issue 37: 25436160 B against 21069832 B (+21%).
    assert abs(at_one - unplanned) <= NO_OP_TOLERANCE * unplanned, (at_one, unplanned)


@pytest.mark.slow
def test_inductor_peak_falls_with_the_budget_and_stays_within_it(inductor_runs) -> None:
    runs, _ = inductor_runs
    peaks = [runs[None][1]] + [runs[f][1] for f in FRACTIONS]
    assert peaks == sorted(peaks, reverse=True), peaks  # no budget, 1.0, 0.5, 0.3
    assert peaks[-1] < peaks[0], peaks  # and a budget does lower it
    for fraction in FRACTIONS:
        plan, peak = runs[fraction]
        # The plan's budget counts the parameters and inputs, resident before the step.
        assert peak <= plan["budget_bytes"] - plan["input_bytes"], (fraction, peak, plan["budget_bytes"])


@pytest.mark.slow
def test_inductor_at_or_under_torch_at_matched_bytes(inductor_runs) -> None:
    """Issue 37's comparison: given as a byte budget what torch's step at activation_memory_budget
    0.5 (its lowest peak on this model) used, its tensor peak plus the parameters and inputs, the
    mxfp8 step peaks at or under torch's.

    Equal fractions are not equal bytes: each scales its own range, ours from the lowest peak
    our plans reach to keeping everything. Until 2026-12-07 this test compared mxfp8 at 0.5 with
    torch at 0.5 (before issue 37: 20193280 B against 16777224 B). Then the memory model stopped
    counting the GELU intermediates Inductor never stores: the range shrank to the bytes that
    exist, and mxfp8's 0.5 keeps more (16875528 B, 0.6% over torch's) for less recomputation."""
    runs, _ = inductor_runs
    torch_peak = _torch_step_peak(TORCH_FRACTION)
    plan, peak = _inductor_step(MemoryBudget.of_bytes(torch_peak + runs[TORCH_FRACTION][0]["input_bytes"]))
    assert plan["recomputed"], plan
    assert peak <= torch_peak, (peak, torch_peak)


@pytest.mark.slow
def test_inductor_reorders_planned_graphs_with_recomputation_pinned(inductor_runs) -> None:
    """Planned graphs go through Inductor's peak-memory reordering (before issue 37 they did
    not: nothing was recorded), and in the order it picks every kernel that recomputes comes
    after a kernel holding the last plain node the plan put before it."""
    runs, scheduled = inductor_runs
    assert runs[FRACTIONS[-1]][0]["recomputed"]
    assert len(scheduled) == 2, len(scheduled)  # forward and backward
    backward = scheduled[-1]
    pinned = [(min(rec), i) for i, (_, rec) in enumerate(backward) if rec]
    checked = 0
    for first, at in pinned:
        anchor = max((max(plain) for plain, rec in backward if plain and not rec and max(plain) < first), default=None)
        if anchor is None:  # planned before every plain kernel of the backward: nothing to follow
            continue
        before = {max(plain) for plain, rec in backward[:at] if plain and not rec}
        assert anchor in before, (first, anchor)
        checked += 1
    assert checked >= len(runs[FRACTIONS[-1]][0]["recomputed"]) - 1, (checked, pinned)
