"""The NVFP4 recipe's high-precision layers are the whole model's under HF gradient
checkpointing too (mxcompile/model_layers.py). There every checkpointed layer runs through one
compiled function, checkpointed_layers._run_layer(function, *args), whose graphs name the layer's
modules from its argument (`args.0.mlp.down_proj`); a reentrant checkpoint compiles its joint
graph in the backward, with no model on the stack. Before the fix the model's names did not
resolve there and the rule applied per layer graph: with high_precision_layers=9 and 7 linear
layers per graph, every layer kept all 7.

The model: the zoo's tiny Llama (hf_zoo skips without transformers) (2 decoder layers of 7 linear layers, then the lm_head),
reentrant checkpointing, one training step; about 10 s here (2 shared cores, mostly dynamo
tracing the model and its layers)."""

from __future__ import annotations

import functools

import pytest
import torch

import mxcompile
from gradient_blocks import decomposed_eager_lowering
from hf_zoo import LAYERS, SEQ, ZOO
from mxcompile.backend import compile_and_record
from mxcompile.checkpointed_layers import MXCheckpointingWarning
from mxcompile.config import MXConfig
from mxcompile.report import KEPT

# The layer runner's graphs name the layer from its first argument, HF's partial(forward, layer).
LAYER_GRAPH_PREFIX = "args.0."
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# How the report's reasons begin for the recipe's linear-layer GEMMs: kept by the rule, or in NVFP4.
RULE = "high_precision_layers"
RECIPE_LINEAR = (RULE, "nvfp4 linear-layer")
# 9 of the model's 14 layer linears: all of the last layer's 7, and the first layer's last 2
KEPT_LAYERS = 9
EXPECTED = {f"model.layers.0.mlp.{name}" for name in MLP[1:]} | {
    f"model.layers.1.self_attn.{name}" for name in ATTENTION} | {f"model.layers.1.mlp.{name}" for name in MLP}


def _kept(report) -> set[str]:
    """A layer graph's linear layers kept by the recipe's rule, by their graph names."""
    return {d.module for d in report.decisions if d.decision == KEPT and d.reason.startswith(RULE)}


def test_checkpointed_layers_keep_the_models_last_layers():
    assert LAYERS == 2
    torch.manual_seed(0)
    model = ZOO["llama"].build().train()
    model.set_attn_implementation("eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    config = MXConfig.for_recipe("nvfp4", {"high_precision_layers": KEPT_LAYERS, "measure_first_step": False})
    torch._dynamo.reset()
    batch = ZOO["llama"].batch(SEQ)
    with pytest.warns(MXCheckpointingWarning):
        torch.compile(model, backend=functools.partial(compile_and_record, config=config,
                                                       lower=decomposed_eager_lowering()))(**batch).loss.backward()

    kept, graphs, reasons = set(), {}, []
    for i, layer in enumerate(model.model.layers):
        # the graphs this layer ran: the forward's, compiled without gradients (an inference
        # graph), and the recomputation's joint graph; both follow the recipe, alike
        ran = [r for r in mxcompile.report_of(layer) if any(d.reason.startswith(RECIPE_LINEAR) for d in r.decisions)]
        assert len(ran) == 2, (i, len(ran))
        graphs[i] = {id(r) for r in ran}
        names = _kept(ran[0])
        assert _kept(ran[1]) == names, (i, names, _kept(ran[1]))
        assert all(name.startswith(LAYER_GRAPH_PREFIX) for name in names), names
        kept |= {f"model.layers.{i}.{name[len(LAYER_GRAPH_PREFIX):]}" for name in names}
        reasons += [d.reason for r in ran for d in r.decisions if d.module in names]
    assert kept == EXPECTED, sorted(kept ^ EXPECTED)
    # the report names each kept layer as the model does
    assert all("of the LlamaForCausalLM model" in reason for reason in reasons), reasons
    assert not graphs[0] & graphs[1]  # different decisions: each layer ran its own runner graphs
    assert set().union(*(_kept(r) for r in mxcompile.report_of(model.lm_head))) == {"lm_head"}
