"""MX GEMM kernel with fused epilogues: C = epilogue(A @ B) where A (M, K) is MX-quantized along
K (scales (M, K / SCALE_BLOCK)) and B (K, N) is MX-quantized along K (scales (K / SCALE_BLOCK, N)).

Two main-loop paths, selected by the `USE_DOT_SCALED` constexpr:
  * `tl.dot_scaled`: native block-scaled MMA on sm100+, emulated by Triton elsewhere (operands
    are upcast to bf16 with their scales applied). Needs SCALE_BLOCK == 32.
  * "Hopper" path: one FP8 `tl.dot` per SCALE_BLOCK-wide slice of K, accumulated in fp32, with
    both scales (a row vector and a column vector) applied to that slice's fp32 partial product.

Template parameters: operand element formats, the epilogue (an ordered tuple of ops, each
rendered as a few lines of Triton), and the element format / scale mode / cast of the optional
MX-quantized output. `tl.constexpr`s: USE_DOT_SCALED, STORE_C, QUANTIZE_OUT, SCALE_BLOCK, tiles.

Epilogue ops (applied in the order given, in fp32, before the cast to the output dtype):
  bias       acc + bias[n]                     (bias: (N,))
  gelu_tanh  GELU, tanh approximation          (torch.nn.functional.gelu(approximate="tanh"))
  gelu_erf   GELU, exact erf form              (torch.nn.functional.gelu(approximate="none"))
  silu       acc * sigmoid(acc)
  mul        acc * mul[m, n]                   (SwiGLU gate product: silu(x Wg) * (x Wu))
  residual   acc + residual[m, n]
After the cast, QUANTIZE_OUT MX-quantizes the (cast) output along its last axis, bit-exactly as
`mxcompile.numerics.quantize_along(c, 1, ...)` would quantize the stored C.

Reference: `mx_mm_reference` (numerics-core dequantize, fp32 matmul, torch epilogue).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from ..numerics.formats import elem_format, scale_mode
from ..numerics.quantize import dequantize_along
from .common import DOT_SCALED_FORMATS, MODULE_HEADER, render_mx_helpers
from .configs import interpreter_mx_mm_config, mx_mm_autotune_configs
from .render import indent, load_source, render

EPILOGUE_OPS: tuple[str, ...] = ("bias", "gelu_tanh", "gelu_erf", "silu", "mul", "residual")
ACTIVATIONS = ("gelu_tanh", "gelu_erf", "silu")


@dataclass(frozen=True)
class MXMMKey:
    """Specialisation key of a rendered MX GEMM kernel (one source per key)."""

    a_elem: str = "e4m3"
    b_elem: str = "e4m3"
    epilogue: tuple[str, ...] = ()
    out_elem: str = "e4m3"  # format of the optional MX-quantized output
    out_scale_mode: str = "rceil"
    cast: str = "software"


def check_epilogue(epilogue: tuple[str, ...] | list[str] | str | None) -> tuple[str, ...]:
    """Normalise an epilogue spec ("bias,silu", a sequence of names, or None) to a tuple."""
    if epilogue is None:
        return ()
    if isinstance(epilogue, str):
        epilogue = [op.strip() for op in epilogue.split(",") if op.strip()]
    ops = tuple(epilogue)
    for op in ops:
        if op not in EPILOGUE_OPS:
            raise ValueError(f"epilogue op {op!r} is not supported; accepted: {list(EPILOGUE_OPS)}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"epilogue {list(ops)} repeats an op; each op may appear once")
    return ops


# Each snippet updates `acc` (fp32, (BLOCK_M, BLOCK_N)); offs_m/offs_n/mask_m/mask_n are in scope.
_EPILOGUE_SNIPPETS: dict[str, str] = {
    "bias": """\
# Epilogue: bias add (one value per output column).
bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
acc = acc + bias[None, :]
""",
    "gelu_tanh": """\
# Epilogue: GELU, tanh approximation; 1 + tanh(u) = 2 / (1 + exp(-2u)).
inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
acc = acc / (1.0 + tl.exp(-2.0 * inner))
""",
    "gelu_erf": """\
# Epilogue: GELU, exact form 0.5 * x * (1 + erf(x / sqrt(2))).
acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
""",
    "silu": """\
# Epilogue: SiLU, x * sigmoid(x).
acc = acc / (1.0 + tl.exp(-acc))
""",
    "mul": """\
# Epilogue: elementwise product with a second tensor (the SwiGLU gate product).
mul_ptrs = mul_ptr + offs_m[:, None] * stride_mulm + offs_n[None, :] * stride_muln
acc = acc * tl.load(mul_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
""",
    "residual": """\
# Epilogue: residual add.
res_ptrs = residual_ptr + offs_m[:, None] * stride_resm + offs_n[None, :] * stride_resn
acc = acc + tl.load(res_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
""",
}

_KERNEL = """\
@triton.jit
def mx_mm_kernel(
    # Pointers: FP8 operands and their uint8 E8M0 scales; the output C; epilogue operands;
    # the MX-quantized output (FP8 data as uint8, contiguous; uint8 scales, contiguous).
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    bias_ptr, mul_ptr, residual_ptr, q_data_ptr, q_scale_ptr,
    # Sizes
    M, N, K,
    # Strides (elements)
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bk, stride_bn, stride_bsk, stride_bsn,
    stride_cm, stride_cn,
    stride_bias, stride_mulm, stride_muln, stride_resm, stride_resn,
    # Meta-parameters
    USE_DOT_SCALED: tl.constexpr,  # True: tl.dot_scaled; False: FP8 tl.dot per scale block
    STORE_C: tl.constexpr,  # store C in c_ptr's dtype
    QUANTIZE_OUT: tl.constexpr,  # store C MX-quantized along N (needs BLOCK_N % SCALE_BLOCK == 0)
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of SCALE_BLOCK
    GROUP_M: tl.constexpr,
):
    # Phase 1: map the 1-D program id to a C tile, walking GROUP_M tile rows column by column
    # so that consecutive programs share A and B tiles in L2 (the matmul tutorial's ordering).
    pid = tl.program_id(axis=0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = (first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group).to(tl.int64)
    pid_n = ((pid % (GROUP_M * tiles_n)) // rows_in_group).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_blocks = K // SCALE_BLOCK

    # Phase 2: main loop over K; fp32 accumulator. K is a multiple of SCALE_BLOCK, so masked
    # lanes are whole scale blocks: data 0, scale byte 127 (1.0), contributing exactly 0.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_DOT_SCALED:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            b = tl.load(
                b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
            offs_kb = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
            mask_kb = offs_kb < k_blocks
            a_scale = tl.load(
                a_scale_ptr + offs_m[:, None] * stride_asm + offs_kb[None, :] * stride_ask,
                mask=mask_m[:, None] & mask_kb[None, :], other=127,
            )
            # dot_scaled takes B's scales as (BLOCK_N, BLOCK_K // 32): load them transposed.
            b_scale = tl.load(
                b_scale_ptr + offs_n[:, None] * stride_bsn + offs_kb[None, :] * stride_bsk,
                mask=mask_n[:, None] & mask_kb[None, :], other=127,
            )
            acc = tl.dot_scaled(a, a_scale, "${a_format}", b, b_scale, "${b_format}", acc)
        else:
            for kk in tl.static_range(0, BLOCK_K, SCALE_BLOCK):
                offs_k = k0 + kk + tl.arange(0, SCALE_BLOCK)
                mask_k = offs_k < K
                a = tl.load(
                    a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0,
                )
                b = tl.load(
                    b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0,
                )
                kb = (k0 + kk) // SCALE_BLOCK
                # The block index as vectors (the interpreter rejects a scalar term in a mask).
                kb_m = offs_m * 0 + kb
                kb_n = offs_n * 0 + kb
                a_scale = _mx_scale_fp32(tl.load(
                    a_scale_ptr + offs_m * stride_asm + kb_m * stride_ask,
                    mask=mask_m & (kb_m < k_blocks), other=127,
                ))
                b_scale = _mx_scale_fp32(tl.load(
                    b_scale_ptr + kb_n * stride_bsk + offs_n * stride_bsn,
                    mask=mask_n & (kb_n < k_blocks), other=127,
                ))
                partial = tl.dot(a, b, out_dtype=tl.float32)
                acc += (partial * a_scale[:, None]) * b_scale[None, :]

    # Phase 3: fused epilogue (rendered from the specialisation's op list), in fp32.
${epilogue}

    # Phase 4: cast to C's dtype and store C and/or its MX-quantized copy.
    out = acc.to(c_ptr.dtype.element_ty)
    mask = mask_m[:, None] & mask_n[None, :]
    if STORE_C:
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, out, mask=mask)
    if QUANTIZE_OUT:
        blocks = tl.reshape(out.to(tl.float32), (BLOCK_M, BLOCK_N // SCALE_BLOCK, SCALE_BLOCK))
        data, scale = _mx_quantize_blocks(blocks, 2)
        tl.store(
            q_data_ptr + offs_m[:, None] * N + offs_n[None, :],
            tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask,
        )
        offs_sn = pid_n * (BLOCK_N // SCALE_BLOCK) + tl.arange(0, BLOCK_N // SCALE_BLOCK)
        tl.store(
            q_scale_ptr + offs_m[:, None] * (N // SCALE_BLOCK) + offs_sn[None, :], scale,
            mask=mask_m[:, None] & (offs_sn < N // SCALE_BLOCK)[None, :],
        )
"""


@functools.cache
def mx_mm_kernel_source(key: MXMMKey) -> str:
    """The rendered Triton source of the MX GEMM kernel for `key` (cached by key)."""
    ops = check_epilogue(key.epilogue)
    if ops:
        epilogue = "\n".join(indent(_EPILOGUE_SNIPPETS[op], 4) for op in ops)
    else:
        epilogue = "    # (no epilogue ops)"
    for name in (key.a_elem, key.b_elem):
        elem_format(name)
    return (
        render(MODULE_HEADER, key=repr(key))
        + render_mx_helpers(elem_format(key.out_elem), scale_mode(key.out_scale_mode), key.cast)
        + "\n\n"
        + render(
            _KERNEL,
            a_format=DOT_SCALED_FORMATS[key.a_elem],
            b_format=DOT_SCALED_FORMATS[key.b_elem],
            epilogue=epilogue,
        )
    )


def mx_mm_module(key: MXMMKey, *, interpret: bool | None = None) -> ModuleType:
    return load_source(mx_mm_kernel_source(key), "mx_mm", interpret=interpret)


@functools.cache
def _autotuned(key: MXMMKey, block_size: int) -> Any:
    import triton

    configs = [
        c
        for c in mx_mm_autotune_configs()
        if c.kwargs["BLOCK_K"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]
    if not configs:
        raise ValueError(f"no MX GEMM tile config fits block_size={block_size}")
    kernel = mx_mm_module(key, interpret=False).mx_mm_kernel
    return triton.autotune(
        configs=configs, key=["M", "N", "K", "USE_DOT_SCALED", "STORE_C", "QUANTIZE_OUT"]
    )(kernel)


def mx_mm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    block_size: int,
    out_dtype: torch.dtype,
    key: MXMMKey,
    use_dot_scaled: bool,
    store_c: bool = True,
    quantize_out: bool = False,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Thin launcher: allocate outputs, pick the kernel, launch. No validation (see __init__).

    Returns (c or None, quantized data or None, quantized scales or None).
    """
    import triton

    m, k = a.shape
    n = b.shape[1]
    device = a.device
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    c = torch.empty((m, n), dtype=out_dtype, device=device) if store_c else None
    # Without C, the kernel still reads C's dtype from c_ptr: pass a 1-element dummy of it.
    c_arg = c if c is not None else torch.empty(1, dtype=out_dtype, device=device)
    q_data = q_scale = None
    if quantize_out:
        q_data = torch.empty((m, n), dtype=elem_format(key.out_elem).dtype, device=device)
        q_scale = torch.empty((m, n // block_size), dtype=torch.uint8, device=device)

    def strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
        return tuple(t.stride()) if t is not None else (0,) * ndim

    args = (
        a, a_scale, b, b_scale, c_arg,
        bias if bias is not None else dummy,
        mul if mul is not None else dummy,
        residual if residual is not None else dummy,
        q_data.view(torch.uint8) if q_data is not None else dummy,
        q_scale if q_scale is not None else dummy,
        m, n, k,
        *a.stride(), *a_scale.stride(), *b.stride(), *b_scale.stride(),
        *(c.stride() if c is not None else (0, 0)),
        *strides(bias, 1), *strides(mul, 2), *strides(residual, 2),
    )  # fmt: skip
    meta = {
        "USE_DOT_SCALED": use_dot_scaled,
        "STORE_C": store_c,
        "QUANTIZE_OUT": quantize_out,
        "SCALE_BLOCK": block_size,
    }

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if m == 0 or n == 0:  # nothing to compute; Triton rejects an empty grid
        return c, q_data, q_scale
    if tiles is None and not interpret:
        kernel = _autotuned(key, block_size)
    else:
        kernel = mx_mm_module(key, interpret=interpret).mx_mm_kernel
        meta.update({"GROUP_M": 8, **(tiles or interpreter_mx_mm_config())})
    if wrap is not None:
        kernel = wrap(kernel)
    kernel[grid](*args, **meta)
    return c, q_data, q_scale


def apply_epilogue_reference(
    acc: torch.Tensor,
    epilogue: tuple[str, ...],
    *,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The epilogue ops in torch, in fp32, in the given order."""
    for op in epilogue:
        if op == "bias":
            acc = acc + bias.float()
        elif op == "gelu_tanh":
            acc = F.gelu(acc, approximate="tanh")
        elif op == "gelu_erf":
            acc = F.gelu(acc, approximate="none")
        elif op == "silu":
            acc = F.silu(acc)
        elif op == "mul":
            acc = acc * mul.float()
        elif op == "residual":
            acc = acc + residual.float()
        else:
            raise ValueError(f"unknown epilogue op {op!r}")
    return acc


def mx_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.float32,
    epilogue: tuple[str, ...] | str | None = (),
    *,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of the MX GEMM kernel: numerics-core dequantize (exact, fp32),
    fp32 matmul, the epilogue in fp32, cast to out_dtype."""
    a_hp = dequantize_along(a, a_scale, 1, block_size, torch.float32)
    b_hp = dequantize_along(b, b_scale, 0, block_size, torch.float32)
    acc = apply_epilogue_reference(
        a_hp @ b_hp, check_epilogue(epilogue), bias=bias, mul=mul, residual=residual
    )
    return acc.to(out_dtype)
