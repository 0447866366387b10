"""MX quantize kernel: one read of a 2-D high-precision tensor writes its row-wise (blocks along
the last axis) and/or column-wise (blocks along the first axis) MX copies.

Template parameters: element format, scale mode, cast (see `common.CAST_MODES`).
`tl.constexpr`s: ROWWISE, COLWISE, SCALE_BLOCK, BLOCK_M, BLOCK_N.
Reference: `quantize_reference`, i.e. `mxcompile.numerics.quantize_along`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..numerics.formats import ElemFormat, ScaleMode, elem_format, scale_mode
from ..numerics.quantize import quantize_along
from .common import MODULE_HEADER, render_mx_helpers
from .configs import interpreter_quantize_config, quantize_autotune_configs
from .render import load_source, render


@dataclass(frozen=True)
class QuantizeKey:
    """Specialisation key of a rendered quantize kernel (one source per key)."""

    elem: str = "e4m3"
    scale_mode: str = "rceil"
    cast: str = "software"


_KERNEL = """\
@triton.jit
def mx_quantize_kernel(
    # Pointers: the input, then row-wise and column-wise outputs (contiguous, FP8 data as uint8).
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    # Sizes
    M, N,
    # Strides of the input (elements); the outputs are contiguous.
    stride_xm, stride_xn,
    # Meta-parameters
    X_BF16_BITS: tl.constexpr,  # x_ptr holds bf16 as int16 bit patterns
    ROWWISE: tl.constexpr,  # write data (M, N) and scales (M, N // SCALE_BLOCK)
    COLWISE: tl.constexpr,  # write data (M, N) and scales (M // SCALE_BLOCK, N)
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Phase 1: this program's tile; 64-bit offsets so tensors of >= 2**31 elements work.
    pid_m = tl.program_id(axis=0).to(tl.int64)
    pid_n = tl.program_id(axis=1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]

    # Phase 2: the one read of the input. Masked lanes read 0: the quantized axis is a multiple
    # of SCALE_BLOCK, so a block lies wholly inside or wholly outside the tensor.
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    x = tl.load(x_ptrs, mask=mask, other=0)
    if X_BF16_BITS:
        # bf16 -> fp32 is a 16-bit shift of the bits: exact for every value. (The Triton 3.9
        # interpreter's bf16 upcast mangles subnormals; on a GPU this is what cvt does.)
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    data_offsets = offs_m[:, None] * N + offs_n[None, :]

    # Phase 3: row-wise copy, blocks of SCALE_BLOCK consecutive columns.
    if ROWWISE:
        blocks = tl.reshape(x, (BLOCK_M, BLOCK_N // SCALE_BLOCK, SCALE_BLOCK))
        data, scale = _mx_quantize_blocks(blocks, 2)
        tl.store(row_data_ptr + data_offsets, tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask)
        offs_sn = pid_n * (BLOCK_N // SCALE_BLOCK) + tl.arange(0, BLOCK_N // SCALE_BLOCK)
        scale_ptrs = row_scale_ptr + offs_m[:, None] * (N // SCALE_BLOCK) + offs_sn[None, :]
        tl.store(scale_ptrs, scale, mask=mask_m[:, None] & (offs_sn < N // SCALE_BLOCK)[None, :])

    # Phase 4: column-wise copy, blocks of SCALE_BLOCK consecutive rows.
    if COLWISE:
        blocks = tl.reshape(x, (BLOCK_M // SCALE_BLOCK, SCALE_BLOCK, BLOCK_N))
        data, scale = _mx_quantize_blocks(blocks, 1)
        tl.store(col_data_ptr + data_offsets, tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask)
        offs_sm = pid_m * (BLOCK_M // SCALE_BLOCK) + tl.arange(0, BLOCK_M // SCALE_BLOCK)
        scale_ptrs = col_scale_ptr + offs_sm[:, None] * N + offs_n[None, :]
        tl.store(scale_ptrs, scale, mask=(offs_sm < M // SCALE_BLOCK)[:, None] & mask_n[None, :])
"""


@functools.cache
def quantize_kernel_source(key: QuantizeKey) -> str:
    """The rendered Triton source of the quantize kernel for `key` (cached by key)."""
    fmt = elem_format(key.elem)
    mode = scale_mode(key.scale_mode)
    return (
        render(MODULE_HEADER, key=repr(key))
        + render_mx_helpers(fmt, mode, key.cast)
        + "\n\n"
        + _KERNEL
    )


def quantize_module(key: QuantizeKey, *, interpret: bool | None = None) -> ModuleType:
    return load_source(quantize_kernel_source(key), "mx_quantize", interpret=interpret)


@functools.cache
def _autotuned(key: QuantizeKey, block_size: int) -> Any:
    import triton

    configs = [
        c
        for c in quantize_autotune_configs()
        if c.kwargs["BLOCK_M"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]
    if not configs:
        raise ValueError(f"no quantize tile config fits block_size={block_size}")
    kernel = quantize_module(key, interpret=False).mx_quantize_kernel
    key_args = ["M", "N", "X_BF16_BITS", "ROWWISE", "COLWISE"]
    return triton.autotune(configs=configs, key=key_args)(kernel)


def quantize_launch(
    x: torch.Tensor,
    *,
    rowwise: bool,
    colwise: bool,
    fmt: ElemFormat,
    mode: ScaleMode,
    block_size: int,
    cast: str = "software",
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Thin launcher: allocate outputs, pick the kernel, launch. No validation (see __init__).

    Returns (row_data, row_scale, col_data, col_scale); the copies not asked for are None.
    `tiles` fixes BLOCK_M/BLOCK_N (else: autotune on a GPU, `interpreter_quantize_config` under
    the interpreter). `wrap` is `torch.library.wrap_triton` when called inside a triton_op.
    """
    import triton

    m, n = x.shape
    key = QuantizeKey(fmt.name, mode.value, cast)
    row_data = torch.empty((m, n), dtype=fmt.dtype, device=x.device) if rowwise else None
    row_scale = (
        torch.empty((m, n // block_size), dtype=torch.uint8, device=x.device) if rowwise else None
    )
    col_data = torch.empty((m, n), dtype=fmt.dtype, device=x.device) if colwise else None
    col_scale = (
        torch.empty((m // block_size, n), dtype=torch.uint8, device=x.device) if colwise else None
    )
    # Unused outputs are given a 1-byte dummy; the kernel never touches them.
    dummy = torch.empty(1, dtype=torch.uint8, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    args = (
        x.view(torch.int16) if bf16 else x,
        row_data.view(torch.uint8) if rowwise else dummy,
        row_scale if rowwise else dummy,
        col_data.view(torch.uint8) if colwise else dummy,
        col_scale if colwise else dummy,
        m,
        n,
        x.stride(0),
        x.stride(1),
    )
    meta = {"X_BF16_BITS": bf16, "ROWWISE": rowwise, "COLWISE": colwise, "SCALE_BLOCK": block_size}

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    if m == 0 or n == 0:  # nothing to compute; Triton rejects an empty grid
        return row_data, row_scale, col_data, col_scale
    if tiles is None and not interpret:
        kernel = _autotuned(key, block_size)
    else:
        kernel = quantize_module(key, interpret=interpret).mx_quantize_kernel
        meta.update(tiles or interpreter_quantize_config())
    if wrap is not None:
        kernel = wrap(kernel)
    kernel[grid](*args, **meta)
    return row_data, row_scale, col_data, col_scale


def quantize_reference(
    x: torch.Tensor, axis: int, elem: str = "e4m3", mode: str = "rceil", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the quantize kernel: the numerics core itself."""
    return quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode(mode), block_size)
