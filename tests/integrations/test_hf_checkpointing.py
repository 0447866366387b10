"""Hugging Face gradient checkpointing trains in MX (issue 46).

With `gradient_checkpointing_enable()` dynamo cannot trace HF's checkpointed layer call: the
layers ran eagerly in full precision and nothing said so. mxcompile compiles each checkpointed
layer on its own (mxcompile/checkpointed_layers.py) and says so once. Checked here, per zoo
model and checkpoint form (reentrant or not):

- the gradients equal the eager MX oracle's bit for bit (graphs run op by op through the CPU
  lowering up to Inductor, as tests/models/test_gradient_oracle.py does; the oracle runs the
  same checkpointed model eagerly, its recomputation included);
- every checkpointed layer has its GEMMs in MX in the compiled graphs (the run-time share of
  step_coverage.py is not asked for here: it profiles a step, which crashed processes now and
  then; tests/test_step_coverage.py);
- the three ways of compiling the issue names (`torch.compile(model, backend="mxfp8")`,
  `mxcompile.compile`, the Trainer through `integrations.hf.compile_model`) through the real
  backend (Inductor), with gradients within INDUCTOR_BOUND of the oracle's.

On the code before the fix every one of these fails: the layers' gradients were fp32's, about
0.08 (relative) from the oracle's, and no layer had a GEMM in any compiled graph.
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
from mxcompile.checkpointed_layers import MXCheckpointingWarning, _innermost, checkpointed_layers
from mxcompile.report import CONVERTED
from mxcompile.config import MXConfig
from mxcompile.ops.attention import ATTENTION, ATTENTION_BACKWARD

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


# A layer graph shared by every layer names its modules from the layer runner's first argument,
# HF's partial(forward, layer): "args.0.mlp.down_proj" (Llama, Mixtral); where dynamo keeps the
# layer's own path, relative to the frame it traced ("h.0.mlp.c_fc" for transformer.h.0).
LAYER_GRAPH_PREFIX = "args.0."


def _in_mx(layer: str, converted: set[str]) -> bool:
    tail = ".".join(layer.split(".")[-2:])  # "h.0" of "transformer.h.0"
    return any(m.startswith(LAYER_GRAPH_PREFIX) or m.startswith(tail + ".") or f".{tail}." in m for m in converted)


def _assert_layers_in_mx(model: torch.nn.Module, layers: list[str]) -> None:
    """The layers' graph has its GEMMs in MX (before the fix: no layer GEMM in any compiled
    graph, only the lm_head's), and the compiled graphs keep under 5% of their GEMM FLOPs
    (Mixtral keeps its router GEMMs)."""
    assert layers, "no checkpointed layer found"
    reports = mxcompile.report_of(model)
    converted = {d.module for r in reports for d in r.decisions if d.decision == CONVERTED}
    missing = [layer for layer in layers if not _in_mx(layer, converted)]
    assert not missing, f"layers without GEMMs in MX: {missing}; modules converted: {sorted(converted)}"
    total = sum(r.gemm_flops_total for r in reports)
    assert sum(r.gemm_flops_converted for r in reports) >= MIN_CONVERTED_FLOP_SHARE * total


def _checkpointed_layer_names(model: torch.nn.Module) -> list[str]:
    return _innermost([name for name, _ in checkpointed_layers(model)])


@pytest.mark.parametrize("name,reentrant", CASES)
def test_checkpointed_gradients_equal_the_oracles(name, reentrant):
    model = _checkpointed(name, reentrant)
    layers = _checkpointed_layer_names(model)
    backend = functools.partial(compile_and_record, config=MXConfig(), lower=decomposed_eager_lowering())
    with pytest.warns(MXCheckpointingWarning, match="compiled on its own"):
        distances = compiled_distances(model, _loss_of(name), backend)
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"{name}: worst parameters {worst}"
    _assert_layers_in_mx(model, layers)


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
    layers = _checkpointed_layer_names(model)
    torch._dynamo.reset()
    from gradient_blocks import oracle_gradients

    expected = oracle_gradients(model, _loss_of("llama"))
    compiled = compile_model(model)
    with pytest.warns(MXCheckpointingWarning):
        _loss_of("llama")(compiled).backward()
    gradients = {name: param.grad.clone() for name, param in model.named_parameters()}
    for name, grad in gradients.items():
        distance = (grad - expected[name]).norm() / expected[name].norm()
        assert distance <= INDUCTOR_BOUND, f"{name}: {distance:.3g}"
    _assert_layers_in_mx(model, layers)


def test_checkpointed_layers_run_attention_with_the_least_scratch():
    """The layer runner's graphs are compiled with attention_chunking=LEAST_MEMORY: their MX
    attention ops run one batch element per call (with the whole batch, the attention backward
    of the layer being recomputed was the checkpointed step's memory peak); the model's own
    graphs keep the default."""
    model = _checkpointed("llama", reentrant=False, attention="sdpa")
    chunks: dict[str, list[int]] = {}
    inner = decomposed_eager_lowering()

    def recording_lowering(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target in (ATTENTION, ATTENTION_BACKWARD):
                names = [argument.name for argument in node.target._schema.arguments]
                chunk = dict(zip(names, node.args)).get("batch_chunk", node.kwargs.get("batch_chunk"))
                chunks.setdefault(node.target.name(), []).append(chunk)
        return inner(gm, example_inputs)

    backend = functools.partial(compile_and_record, config=MXConfig(), lower=recording_lowering)
    with pytest.warns(MXCheckpointingWarning):
        _loss_of("llama")(torch.compile(model, backend=backend)).backward()
    assert set(chunks) == {ATTENTION.name(), ATTENTION_BACKWARD.name()}, chunks
    assert all(chunk == [1] * len(chunk) for chunk in chunks.values()), chunks  # the unbudgeted chunk is BATCH
    configs = {r.config["attention_chunking"] for r in mxcompile.report_of(model)}
    assert configs == {"fastest", "least_memory"}, configs


@pytest.mark.xfail(strict=True, reason=(
    "issue 48, open: under HF reentrant checkpointing the nvfp4 gradients are 0.41-0.43 (relative) "
    "from the FP4 oracle's (2026-12-08), the product or the oracle wrong under checkpointing, not yet "
    "found; the same model without checkpointing is bit-identical (tests/models/test_fp4_gradient_oracle.py)"))
def test_checkpointed_nvfp4_gradients_equal_the_fp4_oracles():
    from fp4_oracle import NVFP4_RECIPE, fp4_compiled_distances

    model = _checkpointed("llama", reentrant=True)
    config = MXConfig.for_recipe("nvfp4", {"measure_first_step": False})
    backend = functools.partial(compile_and_record, config=config, lower=decomposed_eager_lowering())
    distances, _roles = fp4_compiled_distances(model, _loss_of("llama"), backend, NVFP4_RECIPE)
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"worst parameters {worst}"
