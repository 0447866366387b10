"""Hugging Face gradient checkpointing trains in MX (issue 46).

With `gradient_checkpointing_enable()` dynamo cannot trace HF's checkpointed layer call: the
layers ran eagerly in full precision and nothing said so. mxcompile compiles each checkpointed
layer on its own (mxcompile/checkpointed_layers.py) and says so once. Checked here, per zoo
model and checkpoint form (reentrant or not):

- the gradients equal the eager MX oracle's bit for bit (graphs run op by op through the CPU
  lowering up to Inductor, as tests/models/test_gradient_oracle.py does; the oracle runs the
  same checkpointed model eagerly, its recomputation included);
- the step's run-time MX share (mxcompile/step_coverage.py) is the whole step: no GEMM ran
  eagerly, and every compiled GEMM was converted;
- the three ways of compiling the issue names (`torch.compile(model, backend="mxfp8")`,
  `mxcompile.compile`, the Trainer through `integrations.hf.compile_model`) through the real
  backend (Inductor), with gradients within INDUCTOR_BOUND of the oracle's.

On the code before the fix every one of these fails: the layers' gradients were fp32's, about
0.08 (relative) from the oracle's, and the run-time share about 7%.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._inductor.config as inductor_config

import mxcompile
from gradient_blocks import EXACT, INDUCTOR_BOUND, compiled_distances, decomposed_eager_lowering
from hf_zoo import MIN_CONVERTED_FLOP_SHARE, SEQ, ZOO
from mxcompile.backend import compile_and_record
from mxcompile.checkpointed_layers import MXCheckpointingWarning
from mxcompile.config import MXConfig

transformers = pytest.importorskip("transformers")

# (model, use_reentrant): both forms on Llama, and GPT-2, BERT and the MoE model (Mixtral).
CASES = [("llama", True), ("llama", False), ("gpt2", False), ("bert", True), ("mixtral", False)]


@pytest.fixture(autouse=True)
def eager_random_ops():
    """Dropout through torch's own random ops on both sides (not Inductor's seeded prims)."""
    with inductor_config.patch(fallback_random=True):
        yield


def _checkpointed(name: str, reentrant: bool, attention: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    model = ZOO[name].build().train()
    model.set_attn_implementation(attention)  # eager: the attention GEMMs reach the oracle as bmm's
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _loss_of(name: str):
    batch = ZOO[name].batch(SEQ)

    def loss_of(module):
        torch.manual_seed(1)  # the same dropout draws on both sides
        return module(**batch).loss
    return loss_of


def _assert_step_in_mx(model: torch.nn.Module) -> None:
    """The measured step ran no GEMM outside the compiled graphs, and its MX share is the
    compiled graphs' (Mixtral keeps its router GEMMs: 99.9%)."""
    measured = {r.step_coverage for r in mxcompile.report_of(model) if r.step_coverage is not None}
    assert len(measured) == 1, f"{len(measured)} measured steps"
    coverage = measured.pop()
    assert coverage.eager_gemms == 0 and coverage.eager_flops == 0, coverage.warning()
    assert coverage.mx_flop_fraction == coverage.mx_flops / coverage.compiled_flops
    assert coverage.mx_flop_fraction >= MIN_CONVERTED_FLOP_SHARE, coverage.summary()


@pytest.mark.parametrize("name,reentrant", CASES)
def test_checkpointed_gradients_equal_the_oracles(name, reentrant):
    model = _checkpointed(name, reentrant)
    backend = functools.partial(compile_and_record, config=MXConfig(), lower=decomposed_eager_lowering())
    with pytest.warns(MXCheckpointingWarning, match="compiled on its own"):
        distances = compiled_distances(model, _loss_of(name), backend)
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"{name}: worst parameters {worst}"
    _assert_step_in_mx(model)


def _compile_with_mxcompile_compile(model):
    return mxcompile.compile(model)


def _compile_with_torch_compile(model):
    return torch.compile(model, backend="mxfp8")


def _compile_in_place_for_the_trainer(model):
    from mxcompile.integrations.hf import compile_model

    return compile_model(model)  # Module.compile, as the Trainer gets it (tests/integrations/test_hf_trainer.py)


@pytest.mark.slow
@pytest.mark.parametrize("compile_model", [_compile_with_torch_compile, _compile_with_mxcompile_compile,
                                           _compile_in_place_for_the_trainer])
def test_checkpointed_llama_in_mx_through_the_real_backend(compile_model):
    model = _checkpointed("llama", reentrant=False)
    torch._dynamo.reset()
    from gradient_blocks import oracle_gradients

    expected = oracle_gradients(model, _loss_of("llama"))
    compiled = compile_model(model)
    with pytest.warns(MXCheckpointingWarning):
        _loss_of("llama")(compiled).backward()
    for name, param in model.named_parameters():
        distance = (param.grad - expected[name]).norm() / expected[name].norm()
        assert distance <= INDUCTOR_BOUND, f"{name}: {distance:.3g}"
    _assert_step_in_mx(model)
