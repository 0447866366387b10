"""Models from HF transformers, built from small configs with random weights (nothing is
downloaded), compile and train with the mxfp8 pipeline."""

from __future__ import annotations

import copy

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
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: compared with eager
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(config)


# One batch, three AdamW steps: the MX run's losses track the eager fp32 run's from the same
# weights. Measured: at most 0.08% apart (Llama 8e-4, GPT-2 7e-4), loss drops 0.372 vs 0.376
# (Llama) and 0.495 vs 0.490 (GPT-2), 1.2% apart. A wrong gradient moves the step-2 loss by
# a sizeable part of that ~0.2-per-step drop, far outside these bounds.
LOSS_RTOL = 5e-3
DROP_RTOL = 0.05


def _train(model, forward, ids) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_model_trains_with_every_eligible_gemm_converted(build):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    reference = copy.deepcopy(model)
    eager = _train(reference, reference, ids)
    report = Report({})
    losses = _train(model, torch.compile(model, backend=eager_mxfp8_backend(report=report)), ids)
    assert losses == pytest.approx(eager, rel=LOSS_RTOL), (losses, eager)
    assert eager[0] - eager[-1] > 0, eager  # the reference trains on its batch
    assert losses[0] - losses[-1] == pytest.approx(eager[0] - eager[-1], rel=DROP_RTOL), (losses, eager)
    kinds = {(d.graph, d.kind) for d in report.decisions if d.decision == CONVERTED}
    assert {("forward", "output"), ("backward", "input_grad"), ("backward", "weight_grad")} <= kinds
    # Every GEMM whose lengths suit the block size is converted (all of them at these sizes).
    kept = [d for d in report.decisions if d.decision != CONVERTED]
    assert not kept, kept
