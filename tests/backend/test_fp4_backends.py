"""`backend="nvfp4"` and `backend="mxfp4"` (issue 48): registered as torch.compile backends, the
README's quickstart model trains with `backend="nvfp4"` through Inductor on CPU, and
`mxcompile.report_of(model)` reports its FP4 GEMMs with each operand's format."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import mxcompile
from mxcompile.config import MXConfig
from mxcompile.fp4_backends import mxfp4_backend, nvfp4_backend
from mxcompile.report import CONVERTED

STEPS, LR, BATCH = 3, 1e-3, 64
# Each GEMM of the quickstart model under the default NVFP4 recipe: (graph, kind, module) ->
# operand formats. 0.15 of 2 linear layers rounds to none kept in high precision.
QUICKSTART_FORMATS = {
    ("forward", "output", "0"): ["nvfp4", "nvfp4 2d"],
    ("forward", "output", "2"): ["nvfp4", "nvfp4 2d"],
    ("backward", "input_grad", "2"): ["nvfp4 sr", "nvfp4 2d"],
    ("backward", "weight_grad", "2"): ["nvfp4 sr rht", "nvfp4 rht"],
    ("backward", "weight_grad", "0"): ["nvfp4 sr rht", "nvfp4 rht"],
}


def test_backends_are_registered():
    assert lookup_backend("nvfp4") is nvfp4_backend
    assert lookup_backend("mxfp4") is mxfp4_backend


def test_quickstart_trains_with_nvfp4_and_reports_its_fp4_gemms():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    compiled = torch.compile(model, backend="nvfp4")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, target = torch.randn(BATCH, 256), torch.randn(BATCH, 256)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    (report,) = mxcompile.report_of(model)
    assert report.config["recipe"] == "nvfp4"
    formats = {(d.graph, d.kind, d.module): [o.elem for o in d.operands]
               for d in report.decisions if d.decision == CONVERTED}
    assert formats == QUICKSTART_FORMATS


def test_a_config_of_another_recipe_is_refused():
    with pytest.raises(ValueError, match="the nvfp4 backend takes MXConfig.for_recipe"):
        nvfp4_backend(None, [], config=MXConfig())
    with pytest.raises(ValueError, match="give either config or options to the mxfp4 backend"):
        mxfp4_backend(None, [], {"rht": True}, config=MXConfig.for_recipe("mxfp4"))
