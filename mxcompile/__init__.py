"""mxcompile: a torch.compile backend for MXFP8 training.

    torch.compile(model, backend="mxfp8")

rewrites every eligible GEMM of the forward and backward graphs into MX-quantize -> MX GEMM.
Importing this package registers nothing global beyond the `mxcompile::` torch.library ops.
"""

from ._version import __version__
from .backend import MXKeptWarning, clear_reports, compile, report_of, reports, step_coverage_of
from .config import AttentionMode, FsdpAllGather, GemmKernel, MemoryBudget, MXConfig
from .explain import explain
from .api import dequantize_mx, mx_matmul, quantize_mx
from .numerics import MXTensor
from .report import Report

__all__ = [
    "AttentionMode",
    "FsdpAllGather",
    "GemmKernel",
    "MemoryBudget",
    "MXConfig",
    "MXKeptWarning",
    "MXTensor",
    "Report",
    "__version__",
    "clear_reports",
    "compile",
    "dequantize_mx",
    "explain",
    "mx_matmul",
    "quantize_mx",
    "report_of",
    "reports",
    "step_coverage_of",
]
