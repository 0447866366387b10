"""The public quantize / GEMM functions with a choice of implementation.

`kernel="torch"` runs the numerics core (the definition), `kernel="triton"` the generated
Triton kernel (on CUDA, or on CPU under TRITON_INTERPRET=1), `kernel="auto"` Triton for CUDA
tensors and the torch path elsewhere. Both give the same bits for quantization.
"""

from __future__ import annotations

import torch

from .numerics import DEFAULT_BLOCK_SIZE, MXTensor, elem_format
from .numerics import mx_matmul as _mx_matmul_reference
from .numerics import quantize_mx as _quantize_mx_reference
from .numerics.quantize import check_quantizable

KERNELS = ("auto", "torch", "triton")


def _use_triton(kernel: str, device: torch.device) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not accepted; accepted: {list(KERNELS)}")
    if kernel == "auto":
        return device.type == "cuda"
    if kernel == "triton":
        from .triton_templates import triton_available

        available, why = triton_available(device)
        if not available:
            raise RuntimeError(f"kernel='triton' cannot run here: {why}")
        return True
    return False


def quantize_mx(
    x: torch.Tensor,
    axis: int = -1,
    *,
    elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = DEFAULT_BLOCK_SIZE,
    kernel: str = "auto",
) -> MXTensor:
    """Quantize `x` to MX along `axis` (see `mxcompile.numerics.quantize_mx`); `kernel` picks
    the implementation: "auto", "torch" or "triton"."""
    if not isinstance(x, torch.Tensor) or not _use_triton(kernel, x.device):
        return _quantize_mx_reference(x, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    from .triton_templates import quantize_mx_triton

    fmt = elem_format(elem)
    axis = check_quantizable(x, axis, block_size)
    data, scale = quantize_mx_triton(x, axis, fmt.name, scale_mode, block_size)
    return MXTensor(data, scale.view(torch.float8_e8m0fnu), axis, fmt.name, block_size,
                    scale_mode, x.dtype)


def mx_matmul(
    a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.float32, *, kernel: str = "auto"
) -> torch.Tensor:
    """The MX GEMM a @ b (see `mxcompile.numerics.mx_matmul`); `kernel` as in `quantize_mx`.
    The Triton kernel takes 2-D operands."""
    if not isinstance(a, MXTensor) or not _use_triton(kernel, a.data.device):
        return _mx_matmul_reference(a, b, out_dtype)
    from .triton_templates import mx_mm_triton

    if a.data.ndim != 2 or b.data.ndim != 2 or a.axis != 1 or b.axis != 0:
        raise ValueError(
            "kernel='triton' takes 2-D operands, a quantized along axis 1 and b along axis 0; "
            f"got a {tuple(a.shape)} axis {a.axis}, b {tuple(b.shape)} axis {b.axis}"
        )
    return mx_mm_triton(a.data, a.scale_bytes, b.data, b.scale_bytes, a.block_size, out_dtype)
