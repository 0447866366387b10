"""LoRA fine-tuning (PEFT) under the mxfp8 backend: a tiny Llama (random weights from a small
config) with rank-8 adapters on q_proj and v_proj trains 2 steps. The frozen base model's GEMMs
and attention run in MX; LoRA's GEMMs that contract over the rank (8, which a 32-element MX
block would pad 4x) are kept in high precision, each with that reason. The graphs run eagerly
(`recording_eager_backend`: the backend's rewrite and reports without Inductor's compile time)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import mxcompile
from hf_zoo import MIN_CONVERTED_FLOP_SHARE, kept_gemms, recording_eager_backend
from mxcompile.report import CONVERTED, KEPT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="LoRA through PEFT (pip install peft)")

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 256, 64, 128, 2, 2
BATCH, SEQ, STEPS, RANK = 2, 32, 2, 8
LORA = re.compile(r"\.lora_[AB]\.")
RANK_PADDING = f"contraction length {RANK} pads to 32"


def test_lora_trains_with_the_base_gemms_in_mx() -> None:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=SEQ))
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    compiled = torch.compile(model, backend=recording_eager_backend())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(STEPS):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses), losses

    params = dict(model.named_parameters())
    assert all(not torch.equal(params[name], before) for name, before in trainable.items()), "an adapter did not train"
    assert all(torch.equal(params[name], before) for name, before in frozen.items()), "a frozen weight moved"

    reports = mxcompile.report_of(model)
    assert len(reports) == 1, [r.summary() for r in reports]  # one training graph for both steps
    report = reports[0]
    assert report.converted_flop_fraction >= MIN_CONVERTED_FLOP_SHARE, kept_gemms(report)
    base_gemms = [d for d in report.decisions if not LORA.search(d.module)]
    lora_gemms = [d for d in report.decisions if LORA.search(d.module)]
    assert {d.kind for d in base_gemms} >= {"output", "input_grad", "attention"}
    # The base weights are frozen: no weight gradient is computed for them.
    assert not [d for d in base_gemms if d.kind == "weight_grad"]
    assert all(d.decision == CONVERTED for d in base_gemms), kept_gemms(report)
    kept = [d for d in lora_gemms if d.decision == KEPT]
    # Per adapter (q_proj, v_proj) and layer: lora_B's forward, and lora_A's input gradient where
    # one is needed (not in layer 0, whose input, the frozen embedding's output, needs none).
    adapters = 2
    assert len(kept) == adapters * LAYERS + adapters * (LAYERS - 1), kept_gemms(report)
    assert sorted(d.graph for d in kept) == ["backward"] * adapters * (LAYERS - 1) + ["forward"] * adapters * LAYERS
    assert all(RANK_PADDING in d.reason for d in kept), kept_gemms(report)
    names = dict(model.named_modules())
    assert all(d.module in names for d in report.decisions), sorted({d.module for d in report.decisions} - set(names))
    assert {d.module for d in kept if d.graph == "forward"} == {
        f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_B.default"
        for layer in range(LAYERS) for proj in ("q_proj", "v_proj")}
    # LoRA's GEMMs that contract over the hidden size or the tokens run in MX.
    assert all(d.decision == CONVERTED for d in lora_gemms if d not in kept)
    assert {d.kind for d in lora_gemms if d.decision == CONVERTED} == {"output", "input_grad", "weight_grad"}
