"""mxcompile: a torch.compile backend for microscaling (MXFP8, NVFP4, MXFP4) training.

    torch.compile(model, backend="mxfp8")   # or backend="nvfp4" / "mxfp4": the FP4 recipes

rewrites every eligible GEMM of the forward and backward graphs into MX-quantize -> MX GEMM
(FP4 recipes: the linear layers' GEMMs in FP4; `MXConfig.for_recipe(Recipe.NVFP4, options)`
is the typed form).
Importing this package registers nothing global beyond the `mxcompile::` torch.library ops.
"""

from ._version import __version__
from .backend import MXKeptWarning, clear_reports, compile, end_measured_step, report_of, reports, step_coverage_of
from .config import AttentionChunking, AttentionMode, FsdpAllGather, GemmKernel, MemoryBudget, MXConfig, Recipe
from .explain import explain
from .api import dequantize_mx, mx_matmul, quantize_mx
from .numerics import MXTensor
from .report import Report

__all__ = [
    "AttentionChunking",
    "AttentionMode",
    "FsdpAllGather",
    "GemmKernel",
    "MemoryBudget",
    "MXConfig",
    "MXKeptWarning",
    "MXTensor",
    "Recipe",
    "Report",
    "__version__",
    "clear_reports",
    "compile",
    "dequantize_mx",
    "end_measured_step",
    "explain",
    "mx_matmul",
    "quantize_mx",
    "report_of",
    "reports",
    "step_coverage_of",
]
