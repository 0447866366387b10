"""A weight shared by two modules (GPT-2's lm_head tied to its token embedding): the lm_head's
weight-gradient GEMM is a weight-gradient GEMM although its result is summed with the
embedding's gradient before it reaches the graph output. Before the fix it was labelled an
input-gradient GEMM, and under `backend="nvfp4"` converted to MXFP8 as "not a linear layer's
GEMM" while the recipe keeps the lm_head in high precision."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mxcompile
from mxcompile.config import MXConfig
from mxcompile.report import KEPT

VOCAB, WIDTH, TOKENS = 64, 64, 64
LAYERS = 4  # round(0.15 * 4) = 1: the recipe keeps the last layer, and the lm_head besides
LM_HEAD_ROLES = ["input_grad", "output", "weight_grad"]


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        logits = self.lm_head(h)
        return F.cross_entropy(logits, ids)


def _lm_head_decisions(config: MXConfig) -> list:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (TOKENS,))
    report = mxcompile.explain(TiedModel(), ids, config=config)
    return [d for d in report.decisions if d.module == "lm_head"]


def test_tied_lm_head_stays_in_high_precision_under_nvfp4():
    decisions = _lm_head_decisions(MXConfig.for_recipe("nvfp4"))
    assert sorted(d.kind for d in decisions) == LM_HEAD_ROLES
    assert all(d.decision == KEPT and "lm_head stays in high precision" in d.reason for d in decisions), decisions


def test_tied_lm_head_weight_gradient_is_one_under_mxfp8():
    decisions = _lm_head_decisions(MXConfig(hp_weight_grad=True))
    assert sorted(d.kind for d in decisions) == LM_HEAD_ROLES
    weight_grad = next(d for d in decisions if d.kind == "weight_grad")
    assert weight_grad.decision == KEPT and "hp_weight_grad=True" in weight_grad.reason
