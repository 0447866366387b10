"""The public quantize / dequantize / GEMM functions with a choice of implementation.

`kernel="auto"` calls the mxcompile ops (`mxcompile.ops`): the torch reference on CPU, the
Triton kernels on CUDA where they support the call (their `register_kernel("cuda")`
implementations). `kernel="torch"` runs the numerics core (the definition) directly;
`kernel="triton"` the Triton kernel (on CUDA, or on CPU under TRITON_INTERPRET=1). All give the
same bits for quantization.

Inside a user's torch.compile region (default backend, Inductor) the ops are opaque: Inductor
calls them as they run eagerly, so compiled results are bit-identical to eager ones. The ops
carry uint8 scale bytes; the MXTensor the user sees carries torch.float8_e8m0fnu scales,
converted at this edge with `numerics.e8m0_from_bytes` / `bytes_from_e8m0`, which compile
(Inductor's CPU code generation cannot view tensors as float8_e8m0fnu).
"""

from __future__ import annotations

import torch

from .numerics import DEFAULT_BLOCK_SIZE, MXTensor, e8m0_from_bytes, elem_format
from .numerics import dequantize_mx as _dequantize_mx_reference
from .numerics import mx_matmul as _mx_matmul_reference
from .numerics import quantize_mx as _quantize_mx_reference
from .numerics import scale_mode_named
from .numerics.quantize import check_dequantizable, check_mx_matmul_operands, check_quantizable
from .ops.mx_mm import MX_MM
from .ops.quantize import DEQUANTIZE, QUANTIZE

KERNELS = ("auto", "torch", "triton")


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not accepted; accepted: {list(KERNELS)}")


def _require_triton(device: torch.device) -> None:
    from .triton_templates import triton_available

    available, why = triton_available(device)
    if not available:
        raise RuntimeError(f"kernel='triton' cannot run here: {why}")


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
    _check_kernel(kernel)
    if kernel == "torch":
        return _quantize_mx_reference(x, axis, elem=elem, scale_mode=scale_mode, block_size=block_size)
    fmt, scale_mode = elem_format(elem), scale_mode_named(scale_mode)
    axis = check_quantizable(x, axis, block_size)
    if kernel == "triton":
        from .triton_templates import quantize_mx_triton

        _require_triton(x.device)
        data, scale = quantize_mx_triton(x, axis, fmt.name, scale_mode.value, block_size)
    else:
        data, scale = QUANTIZE(x, axis, fmt.name, scale_mode.value, block_size)
    return MXTensor(data, e8m0_from_bytes(scale), axis, fmt.name, block_size, scale_mode.value, x.dtype)


def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32, *, kernel: str = "auto") -> torch.Tensor:
    """The values an MXTensor represents, as `dtype` (see `mxcompile.numerics.dequantize_mx`);
    `kernel`: "auto" (the `mxcompile::dequantize` op) or "torch" (the numerics core). There is
    no Triton dequantize kernel: "triton" is refused."""
    _check_kernel(kernel)
    if kernel == "triton":
        raise ValueError("kernel='triton': there is no Triton dequantize kernel; use 'auto' or 'torch'")
    if kernel == "torch":
        return _dequantize_mx_reference(mx, dtype)
    check_dequantizable(mx, dtype)
    return DEQUANTIZE(mx.data, mx.scale_bytes, mx.axis, mx.block_size, dtype)


def mx_matmul(
    a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.float32, *, kernel: str = "auto"
) -> torch.Tensor:
    """The MX GEMM a @ b (see `mxcompile.numerics.mx_matmul`); `kernel` as in `quantize_mx`.
    "auto" is the `mxcompile::mx_mm` op, which multiplies bf16-dequantized operands for
    non-fp32 outputs where bf16 GEMMs are native, fp32 ones elsewhere
    (`mxcompile.ops.mx_mm.gemm_operand_dtype`). The Triton kernel takes 2-D
    operands."""
    _check_kernel(kernel)
    if kernel == "torch":
        return _mx_matmul_reference(a, b, out_dtype)
    check_mx_matmul_operands(a, b)
    if kernel == "auto":
        return MX_MM(a.data, a.scale_bytes, b.data, b.scale_bytes, a.block_size, out_dtype)
    from .triton_templates import mx_mm_triton

    _require_triton(a.data.device)
    if a.data.ndim != 2 or b.data.ndim != 2:
        raise ValueError(
            "kernel='triton' takes 2-D operands, a quantized along axis 1 and b along axis 0; "
            f"got a {tuple(a.shape)} axis {a.axis}, b {tuple(b.shape)} axis {b.axis}"
        )
    return mx_mm_triton(a.data, a.scale_bytes, b.data, b.scale_bytes, a.block_size, out_dtype)
