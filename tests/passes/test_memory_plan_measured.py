"""The memory plan against a measured step: the peak of live tensor storage (torch.profiler's
allocator events) of one training step of the small GPT and a small HF Llama, each with its
loss inside the compiled graph, at 100%, 75%, 50% and 30% of the activation memory a plan can
take off the peak. Eager lowering runs the rewritten graphs op by op, so the measured peak is
the planner's own model of the step; Inductor is checked once (it fuses, and planned graphs
compile without its buffer reuse, so its peak stays at or under the model's)."""

from __future__ import annotations

import functools

import pytest
import torch

from mx_testing import eager_mxfp8_backend
from mxcompile.backend import compile_graph
from mxcompile.config import MXConfig
from mxcompile.measure.memory import tensor_peak_bytes
from mxcompile.examples.gpt import LanguageModelLoss, gpt_factory, lm_loss
from mxcompile.lowering import inductor_compiler
from mxcompile.report import Report

FRACTIONS = (1.0, 0.75, 0.5, 0.3)
PREDICTION_TOLERANCE = 0.10  # the measured peak is at most 10% under the predicted one
MONOTONE_SLACK = 0.01
NO_OP_TOLERANCE = 0.03  # a budget of 1.0 measures within 3% of no budget (issue 37's target)
GPT_BATCH = 4

pytestmark = pytest.mark.slow


class _LlamaLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(idx).logits, idx)


def _small_gpt():
    model, (idx,) = gpt_factory("small", batch_size=GPT_BATCH)
    return LanguageModelLoss(model), idx


def _small_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    idx = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    return _LlamaLoss(model), idx


def _measure(build, budget, lower=None):
    """(memory_plan report, step peak bytes, parameter gradients) of one planned step."""
    torch._dynamo.reset()
    module, idx = build()
    config = MXConfig(memory_budget=budget)
    report = Report(config.to_dict())
    backend = (eager_mxfp8_backend(config, report) if lower is None
               else functools.partial(compile_graph, config=config, lower=lower, report=report))
    compiled = torch.compile(module, backend=backend)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        compiled(idx).backward()

    step()
    peak = tensor_peak_bytes(step)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return report.memory_plan, peak, grads


@pytest.fixture(scope="module", params=[_small_gpt, _small_llama], ids=["gpt-small", "llama-small"])
def measured(request):
    return _measure(request.param, None), {f: _measure(request.param, f) for f in FRACTIONS}


def test_measured_peak_within_budget_and_as_predicted(measured) -> None:
    _, runs = measured
    for fraction, (plan, peak, _) in runs.items():
        assert plan["budget_met"], fraction
        # The measured step starts with parameters and inputs alive; the plan counts them.
        budget = plan["budget_bytes"] - plan["input_bytes"]
        predicted = plan["realized_peak_bytes"] - plan["input_bytes"]
        # A budget is a limit: the measured peak is at or under it, to the byte.
        assert peak <= budget, (fraction, peak, budget)
        # The model is an upper bound of what the step allocates, and not a loose one where a
        # plan acts. A budget of 1.0 runs the unplanned graphs, with the attention ops on whole
        # batches; there the model's attention scratch (one element's worst case times the
        # chunk) is looser: 11-12% over the measured step here (see test_peak_falls_with_the_budget
        # for 1.0 against the step without a budget).
        assert peak <= predicted, (fraction, peak, predicted)
        if fraction < 1.0:
            assert predicted - peak <= PREDICTION_TOLERANCE * predicted, (fraction, peak, predicted)


def test_peak_falls_with_the_budget(measured) -> None:
    (_, unplanned_peak, _), runs = measured
    predicted = [runs[f][0]["realized_peak_bytes"] for f in FRACTIONS]
    assert predicted == sorted(predicted, reverse=True)
    peaks = [runs[f][1] for f in FRACTIONS]
    # Measured peaks follow the predicted ones up to the model's error, which can exceed the
    # step between two close budgets (llama-small: 0.5 -> 0.3 measured +0.7% while predicted
    # -1.9%); allow MONOTONE_SLACK of the peak between neighbours.
    for higher, lower in zip(peaks, peaks[1:]):
        assert lower <= higher * (1 + MONOTONE_SLACK), peaks
    assert peaks[-1] < peaks[0] <= unplanned_peak
    # A budget of 1.0 is the step without one (issue 37: within 3%; it was 19-22% under,
    # the attention op running one batch element at a time under any budget).
    assert peaks[0] >= (1 - NO_OP_TOLERANCE) * unplanned_peak, (peaks[0], unplanned_peak)


def test_gradients_bit_identical_under_every_budget(measured) -> None:
    (_, _, reference), runs = measured
    for fraction, (plan, _, grads) in runs.items():
        assert fraction == 1.0 or plan["recomputed"], fraction
        for name, grad in reference.items():
            if "emb" in name:
                # CPU embedding backward accumulates repeated ids in a thread-dependent order
                # (two unplanned steps differ too); torch.use_deterministic_algorithms would
                # fix it but changes the step's memory, which is what this module measures.
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(grad, grads[name]), (fraction, name)


def test_inductor_peak_within_budget_at_half_the_activation_memory() -> None:
    """Under Inductor the planned step peaks at or under its budget too. Inductor's buffer reuse
    held a dead 2 MiB MLP gradient across the next attention backward (whose scratch Inductor's
    own estimate does not see): 32743432 B against 32424448 B until the lowering turned buffer
    reuse off for planned graphs (then 25864208 B). One compile of the small GPT (~500 s cold on
    2 busy cores): the tiny GPT does not reach the budget."""
    plan, peak, _ = _measure(_small_gpt, 0.5, lower=inductor_compiler)
    assert peak <= plan["budget_bytes"] - plan["input_bytes"], (peak, plan["budget_bytes"] - plan["input_bytes"])
