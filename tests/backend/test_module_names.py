"""Decisions name modules as `named_modules()` does, also through wrappers that dynamo walks by
`__dict__['_modules']` (PEFT), and an include/exclude pattern that matches no module warns with
the closest names instead of silently selecting nothing (issue 35)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import mxcompile
from mxcompile.backend import MXPatternWarning, compile_graph
from mxcompile.config import MXConfig
from mxcompile.lowering import eager_compiler
from mxcompile.passes.graph_facts import clean_module_path


@pytest.mark.parametrize("dynamo_path, name", [
    ("L['self'].layers[0].attn", "layers.0.attn"),
    ("L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model'].lm_head", "base_model.model.lm_head"),
    ("L['self']._modules['encoder'].layer[3]", "encoder.layer.3"),
])
def test_dynamo_paths_become_named_modules_names(dynamo_path, name):
    assert clean_module_path(dynamo_path) == name


def _tiny_lora_llama():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def test_peft_decisions_name_modules_as_named_modules_and_exclude_works():
    model = _tiny_lora_llama()
    ids = torch.randint(0, 256, (2, 32))
    config = MXConfig.from_options({"exclude": ("base_model.model.lm_head",)})
    report = mxcompile.explain(model, input_ids=ids, labels=ids, config=config)
    names = {name for name, _ in model.named_modules()}
    decided = {d.module for d in report.decisions if d.module}
    assert decided and decided <= names, sorted(decided - names)
    head = [d for d in report.decisions if d.module == "base_model.model.lm_head"]
    assert head and all("exclude pattern" in d.reason for d in head)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 64)

    def forward(self, x):
        return self.lm_head(torch.relu(self.encoder(x)))


def test_a_pattern_that_matches_no_module_warns_with_the_closest_names():
    backend = functools.partial(compile_graph, config=MXConfig.from_options({"exclude": ("lm_haed",)}),
                                lower=eager_compiler, describe=False)
    torch._dynamo.reset()
    with pytest.warns(MXPatternWarning, match=r"exclude pattern 'lm_haed' matches no module.*'lm_head'"):
        torch.compile(_Net(), backend=backend)(torch.randn(4, 64))


def test_patterns_that_match_do_not_warn():
    backend = functools.partial(compile_graph, config=MXConfig.from_options({"include": ("lm_head",)}),
                                lower=eager_compiler, describe=False)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MXPatternWarning)
        torch.compile(_Net(), backend=backend)(torch.randn(4, 64))
