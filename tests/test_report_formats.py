"""The report names the formats it converted to (issue 48): `Report.summary()` and
`converted_by_format` from decisions built here (no compile), and the public names a user
configures an FP4 recipe with (`mxcompile.Recipe`, `MXConfig.for_recipe`) through `explain`."""

from __future__ import annotations

import torch

import mxcompile
from mxcompile.config import GemmRole, OperandKind
from mxcompile.report import CONVERTED, KEPT, GemmDecision, OperandQuantization, Report

FLOPS = 1000


def _decision(fmt, kind: str = "output") -> GemmDecision:
    """A converted GEMM whose operands are in `fmt` (an OperandFormat), or a kept one (None)."""
    operands = () if fmt is None else tuple(OperandQuantization.of(n, (32, 32), 1, fmt) for n in ("a", "b"))
    return GemmDecision("forward", "mm", "aten.mm.default", kind, ((32, 32), (32, 32)), FLOPS, "m",
                        KEPT if fmt is None else CONVERTED, "why", operands)


def test_summary_names_the_formats_and_the_recipe():
    nvfp4 = mxcompile.MXConfig.for_recipe(mxcompile.Recipe.NVFP4)
    fp4_format = nvfp4.operand_format(GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT)
    mx_format = nvfp4.mx_operand_format(nvfp4.grad_elem)
    report = Report(nvfp4.to_dict(), [_decision(fp4_format), _decision(fp4_format), _decision(mx_format),
                                      _decision(None)])
    assert report.converted_by_format() == {"nvfp4": 2, "mxfp8": 1}
    assert report.summary() == ("forward: 3 of 4 GEMMs converted (NVFP4 2, MXFP8 1), 75.0% of 4e+03 GEMM FLOPs; "
                                "1 kept (nvfp4 recipe)")
    only_fp4 = Report(nvfp4.to_dict(), [_decision(fp4_format)])
    assert only_fp4.summary().startswith("forward: 1 of 1 GEMMs in NVFP4, 100.0%")
    assert Report(nvfp4.to_dict()).summary() == "no GEMMs in this graph: nothing to run in NVFP4"
    mxfp8 = mxcompile.MXConfig()
    assert Report(mxfp8.to_dict(), [_decision(mxfp8.mx_operand_format(mxfp8.forward_elem))]).summary() == \
        "forward: 1 of 1 GEMMs in MXFP8, 100.0% of 1e+03 GEMM FLOPs; 0 kept"


def test_operand_rows_describe_their_format():
    nvfp4 = mxcompile.MXConfig.for_recipe("nvfp4")
    rows = {(role, kind): OperandQuantization.of("x", (32, 32), 0, nvfp4.operand_format(role, kind))
            for role, kind in ((GemmRole.OUTPUT, OperandKind.WEIGHT), (GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT))}
    weight, gradient = rows[GemmRole.OUTPUT, OperandKind.WEIGHT], rows[GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT]
    assert weight.describe() == "nvfp4 e2m1/16/E4M3, 2-D 16x16" and weight.tensor_scale and weight.elem == "nvfp4 2d"
    assert gradient.describe() == "nvfp4 e2m1/16/E4M3, stochastic, RHT" and gradient.elem == "nvfp4 sr rht"
    e5m2 = OperandQuantization.of("g", (32, 32), 0, mxcompile.MXConfig(block_size=16).mx_operand_format("e5m2"))
    assert (e5m2.format, e5m2.elem, e5m2.describe()) == ("mxfp8_e5m2_block16", "e5m2", "mxfp8 e5m2/16/E8M0")


def test_public_names_configure_an_fp4_recipe():
    """`mxcompile.Recipe` and `MXConfig.for_recipe`, as docs/api.md shows them, through explain."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    config = mxcompile.MXConfig.for_recipe(mxcompile.Recipe.MXFP4, {"stochastic_rounding": True})
    report = mxcompile.explain(model, torch.randn(32, 64), config=config)
    assert report.converted_by_format() == {"mxfp4": 5}  # the first layer has no input-gradient GEMM
    assert "5 of 5 GEMMs in MXFP4" in report.summary() and report.summary().endswith("(mxfp4 recipe)")


def test_the_trainer_share_names_the_formats_as_the_report_does():
    """MXShare.summary (MXReportCallback's end-of-training line) words the converted GEMMs as
    Report.summary does: one family by its name, several with their counts."""
    from mxcompile.integrations.hf import MXShare

    def share(formats):
        return MXShare(graphs=1, gemms=38, converted_gemms=24, gemm_flops=100, converted_flops=50,
                       kept_reasons=(), formats=formats).summary()

    assert share({"nvfp4": 24}).startswith("1 graph(s): 24 of 38 GEMMs in NVFP4, 50.0% of GEMM FLOPs")
    assert share({"nvfp4": 21, "mxfp8": 3}).startswith("1 graph(s): 24 of 38 GEMMs converted (NVFP4 21, MXFP8 3)")
    assert share({}).startswith("1 graph(s): 24 of 38 GEMMs in MXFP8")
