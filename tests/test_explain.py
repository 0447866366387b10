"""`mxcompile.explain` with keyword inputs, the way HF models are called."""

from __future__ import annotations

import torch
import torch.nn as nn

import mxcompile
from mxcompile.report import CONVERTED


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, input_ids=None, *, gate):
        return self.down(torch.relu(self.up(input_ids)) * gate)


def test_explain_takes_keyword_inputs():
    torch.manual_seed(0)
    x, gate = torch.randn(32, 64), torch.rand(32, 128)
    by_keyword = mxcompile.explain(KeywordModel(), input_ids=x, gate=gate)
    mixed = mxcompile.explain(KeywordModel(), x, gate=gate)
    for report in (by_keyword, mixed):
        # two linears: output and weight_grad each, input_grad of the second (x needs no gradient)
        assert report.totals()["gemms"] == 5
        assert all(d.decision == CONVERTED for d in report.decisions)
