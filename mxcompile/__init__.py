"""mxcompile: a torch.compile backend for MXFP8 training.

    torch.compile(model, backend="mxfp8")

rewrites every eligible GEMM of the forward and backward graphs into MX-quantize -> MX GEMM.
Importing this package registers nothing global beyond the `mxcompile::` torch.library ops.
"""

from ._version import __version__
from .numerics import MXTensor, dequantize_mx, mx_matmul, quantize_mx

__all__ = ["MXTensor", "__version__", "dequantize_mx", "mx_matmul", "quantize_mx"]
