"""mxcompile.measure.steps: argument checks of the step factories, and torch's memory budget
patched only while a step runs."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config

from mxcompile.measure import steps


def test_step_factories_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="model="):
        steps.build_model("gpt-huge")
    with pytest.raises(ValueError, match="memory_budget="):
        steps.mxfp8_budget_step("gpt-tiny", memory_budget=1.5)
    with pytest.raises(ValueError, match="activation_memory_budget="):
        steps.torch_budget_step("gpt-tiny", activation_memory_budget=0)
    with pytest.raises(ValueError, match="lower="):
        steps.torch_budget_step("gpt-tiny", lower="triton")
    with pytest.raises(ValueError, match="factory="):
        steps.measure_step("no_colon", time_steps=1)


def test_torch_budget_applies_only_while_a_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def record_compile(module, backend):  # eager: the test is about the config, not Inductor
        def run(*args):
            seen.append((backend, functorch_config.activation_memory_budget))
            return module(*args)
        return run

    monkeypatch.setattr(torch, "compile", record_compile)
    default = functorch_config.activation_memory_budget
    step = steps.torch_budget_step("gpt-tiny", activation_memory_budget=0.25, batch_size=1, lower="eager")
    assert functorch_config.activation_memory_budget == default
    step()
    assert seen == [("aot_eager_decomp_partition", 0.25)]
    assert functorch_config.activation_memory_budget == default
