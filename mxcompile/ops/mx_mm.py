"""The MX GEMM op `mxcompile::mx_mm`.

    mxcompile::mx_mm(a, a_scale, b, b_scale, block_size, out_dtype) -> c

a (..., M, K) quantized along K times b (..., K, N) quantized along K, fp32 accumulation. The
torch reference multiplies the dequantized operands (`numerics.dequantize_along`); the CUDA
kernel, registered with `register_kernel("cuda")`, is the Triton MX GEMM of
`mxcompile.triton_templates` where it supports the call (a 2-D B), the reference otherwise. On
CPU the backend lowers the op to a high-precision matmul of fake-quantized operands
(`mxcompile.lowering.lower_mx_gemms`), or decomposes it (`DECOMPOSITIONS`).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..numerics import dequantize_along
from ..numerics.formats import block_format as block_format_named
from ..numerics.fp4_operand import fp4_gemm

_log = logging.getLogger(__name__)


@functools.cache
def cpu_has_native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX), where
    oneDNN's bf16 GEMM is about 2x faster than fp32. Elsewhere ATen's bf16 mm is emulated or a
    generic loop: on an AVX2-only EPYC a (1536 x 2048) @ (2048 x 512) bf16 mm took 4.1 s
    against 0.05 s in fp32 (../shared/FACTS.md)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def gemm_operand_dtype(out_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the MX GEMM dequantizes its operands to before multiplying (fp32 accumulation).

    bf16 for low-precision outputs on CUDA and on CPUs with native bf16 GEMMs
    (`cpu_has_native_bf16_gemm`): exact for every FP8 value times a power-of-two scale unless
    the product underflows bf16's subnormal range (scale byte < 3 for e4m3, < 10 for e5m2).
    fp32 otherwise: always exact, the same fp32-accumulated products, and on CPUs without
    native bf16 GEMMs tens of times faster. fp32 outputs get fp32 operands, so that the output
    carries no extra bf16 rounding.
    """
    if out_dtype == torch.float32:
        return torch.float32
    if torch.device(device).type == "cpu" and not cpu_has_native_bf16_gemm():
        return torch.float32
    return torch.bfloat16


_FP32_BYTES = 4


def _dequantized_peak_bytes(numel: int, scale_numel: int, dtype: torch.dtype) -> int:
    """Peak bytes `numerics.dequantize_along` holds for an operand of ``numel`` elements with
    ``scale_numel`` scales, its result included: the fp32 copy of the data and the fp32 scales,
    their fp32 product, and the cast of the product to ``dtype`` (none for fp32)."""
    cast = 0 if dtype == torch.float32 else numel * dtype.itemsize
    return 2 * _FP32_BYTES * numel + _FP32_BYTES * scale_numel + cast


def mx_mm_peak_bytes(a_numel: int, a_scale_numel: int, b_numel: int, b_scale_numel: int, out_numel: int,
                     out_dtype: torch.dtype, device: torch.device | str) -> int:
    """Peak bytes `mx_mm_reference` allocates while it runs, its output included (the bytes
    allocated before the call, such as the fp8 operands, not counted).

    It runs in three phases: A is dequantized (`_dequantized_peak_bytes`); B is dequantized
    while A's operand is held; the product of the two operands is taken in the operand dtype
    and cast to ``out_dtype`` if that differs. The peak is the largest phase. The memory
    planner's cost model (`mxcompile.cost.graph_costs.workspace_bytes`) takes the op's scratch
    from this, so it must change with the reference.
    """
    operand = gemm_operand_dtype(out_dtype, device)
    a_held = a_numel * operand.itemsize
    product = out_numel * operand.itemsize
    out = out_numel * out_dtype.itemsize if out_dtype != operand else 0
    return max(
        _dequantized_peak_bytes(a_numel, a_scale_numel, operand),
        a_held + _dequantized_peak_bytes(b_numel, b_scale_numel, operand),
        a_held + b_numel * operand.itemsize + product + out,
    )


def mx_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The torch implementation of `mxcompile::mx_mm` (scales: uint8 bytes)."""
    operand_dtype = gemm_operand_dtype(out_dtype, a.device)
    a_hp = dequantize_along(a, a_scale, a.ndim - 1, block_size, operand_dtype)
    b_hp = dequantize_along(b, b_scale, b.ndim - 2, block_size, operand_dtype)
    return torch.matmul(a_hp, b_hp).to(out_dtype)


@torch.library.custom_op("mxcompile::mx_mm", mutates_args=())
def mx_mm_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """MX GEMM: a (..., M, K) quantized along K times b (..., K, N) quantized along K (uint8
    scale bytes)."""
    return mx_mm_reference(a, a_scale, b, b_scale, block_size, out_dtype).contiguous()


@mx_mm_op.register_fake
def _mx_mm_fake(a, a_scale, b, b_scale, block_size, out_dtype):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]), dtype=out_dtype)


def triton_mx_mm_unsupported(a: torch.Tensor, b: torch.Tensor, block_size: int) -> str | None:
    """Why the Triton MX GEMM cannot run this call of `mxcompile::mx_mm`, or None."""
    from ..triton_templates import triton_available

    if b.ndim != 2:
        return f"b has {b.ndim} dims: the Triton MX GEMM takes a 2-D B"
    ok, why = triton_available(a.device, block_size=block_size)
    return None if ok else why


def mx_mm_with_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton MX GEMM on the op's operands: a (..., M, K) flattened to 2-D, b (K, N)."""
    from ..triton_templates import _interpreting, _operand_elem, device_capability, resolve_gemm_path
    from ..triton_templates.mx_gemm import MXMMKey, mx_mm_launch

    lead = a.shape[:-1]
    key = MXMMKey(_operand_elem(a, "a"), _operand_elem(b, "b"))
    c, _, _ = mx_mm_launch(
        a.reshape(-1, a.shape[-1]), a_scale.reshape(-1, a_scale.shape[-1]), b, b_scale,
        block_size=block_size, out_dtype=out_dtype, key=key,
        path=resolve_gemm_path("auto", block_size, device_capability(a.device)), interpret=_interpreting(),
    )  # fmt: skip
    if c is None:
        raise RuntimeError("mx_mm_launch returned no output although store_c is set")
    return c.reshape(*lead, b.shape[-1])


@mx_mm_op.register_kernel("cuda")
def mx_mm_cuda(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`mxcompile::mx_mm` on CUDA: the Triton MX GEMM when `triton_mx_mm_unsupported` says it
    can run, the torch reference otherwise (logged at DEBUG level with the reason). Also
    callable on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    reason = triton_mx_mm_unsupported(a, b, block_size)
    if reason is not None:
        _log.debug("mxcompile::mx_mm: torch reference, not the Triton kernel: %s", reason)
        return mx_mm_reference(a, a_scale, b, b_scale, block_size, out_dtype).contiguous()
    return mx_mm_with_triton(a, a_scale, b, b_scale, block_size, out_dtype)


def mx_mm_fp4_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_tensor_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_tensor_scale: torch.Tensor,
    block_format: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """FP4 GEMM (MXFP4 or NVFP4, `block_format`): a (..., M, K) and b (..., K, N), each packed
    along K by `mxcompile::quantize_fp4`, with their scale bytes and tensor scales. The block
    values are multiplied in fp32 and the product times fp32(S_dec(a) * S_dec(b)) is cast to
    out_dtype (`numerics.fp4_operand.fp4_gemm`). fp32 operands on every device: NVFP4's block
    values q * s are exact in bf16 too, but a bf16 product would be rounded before the tensor
    scale is applied."""
    from .quantize import DEQUANTIZE_FP4

    a_values = DEQUANTIZE_FP4(a, a_scale, a.ndim - 1, block_format, torch.float32)
    b_values = DEQUANTIZE_FP4(b, b_scale, b.ndim - 2, block_format, torch.float32)
    return fp4_gemm(a_values, a_tensor_scale, b_values, b_tensor_scale, out_dtype).contiguous()


mx_mm_fp4_op = torch.library.custom_op("mxcompile::mx_mm_fp4", mutates_args=())(mx_mm_fp4_reference)


@mx_mm_fp4_op.register_fake
def _mx_mm_fp4_fake(a, a_scale, a_tensor_scale, b, b_scale, b_tensor_scale, block_format, out_dtype):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]), dtype=out_dtype)


@mx_mm_fp4_op.register_kernel("cuda")
def mx_mm_fp4_cuda(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_tensor_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_tensor_scale: torch.Tensor,
    block_format: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`mxcompile::mx_mm_fp4` on CUDA: the Triton FP4 GEMM for a 2-D B where Triton can run
    (`triton_mx_mm_unsupported`), the op's torch implementation otherwise (logged at DEBUG
    level with the reason). Also callable on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    reason = triton_mx_mm_unsupported(a, b, block_format_named(block_format).block_size)
    if reason is not None:
        _log.debug("mxcompile::mx_mm_fp4: torch implementation, not the Triton kernel: %s", reason)
        return mx_mm_fp4_reference(a, a_scale, a_tensor_scale, b, b_scale, b_tensor_scale, block_format,
                                   out_dtype)
    from ..triton_templates import _interpreting, device_capability
    from ..triton_templates.mx_gemm_fp4 import fp4_mm_launch, resolve_fp4_gemm_path

    # a (..., M, K/2) flattened to 2-D; the path for this GPU.
    c = fp4_mm_launch(
        a.reshape(-1, a.shape[-1]), a_scale.reshape(-1, a_scale.shape[-1]), a_tensor_scale.to(torch.float32),
        b, b_scale, b_tensor_scale.to(torch.float32), block_format=block_format, out_dtype=out_dtype,
        path=resolve_fp4_gemm_path("auto", device_capability(a.device)), interpret=_interpreting(),
    )  # fmt: skip
    return c.reshape(*a.shape[:-1], b.shape[-1])


MX_MM = torch.ops.mxcompile.mx_mm.default  # the overload the graph passes insert
MX_MM_FP4 = torch.ops.mxcompile.mx_mm_fp4.default

DECOMPOSITIONS: dict = {
    MX_MM: lambda *a: mx_mm_reference(*a).contiguous(),
}

