"""Models from HF transformers, built from small configs with random weights (nothing is
downloaded), compile and train with the mxfp8 pipeline."""

from __future__ import annotations

import pytest
import torch

from mx_testing import eager_mxfp8_backend
from mxcompile.report import CONVERTED, Report

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, SEQ, BATCH = 256, 64, 32, 2


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=SEQ,
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_model_trains_with_every_eligible_gemm_converted(build):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    report = Report({})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(report=report))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    kinds = {(d.graph, d.kind) for d in report.decisions if d.decision == CONVERTED}
    assert {("forward", "output"), ("backward", "input_grad"), ("backward", "weight_grad")} <= kinds
    # Every GEMM whose lengths suit the block size is converted (all of them at these sizes).
    kept = [d for d in report.decisions if d.decision != CONVERTED]
    assert not kept, kept
