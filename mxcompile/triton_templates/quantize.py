"""Launcher of the MX quantize kernel (`kernels/quantize.py`): one read of a 2-D high-precision
tensor writes its row-wise (blocks along the last axis) and/or column-wise (blocks along the
first axis) MX copies.

`tl.constexpr`s: ELEM, SCALE_MODE, CAST, X_BF16_BITS, ROWWISE, COLWISE, SCALE_BLOCK, BLOCK_M,
BLOCK_N. Reference: `quantize_reference`, i.e. `mxcompile.numerics.quantize_along`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..numerics.formats import ElemFormat, ScaleMode, elem_format, scale_mode_named
from ..numerics.quantize import quantize_along
from .common import check_cast
from .configs import autotuned, interpreter_quantize_config, quantize_autotune_configs
from .loader import kernel_module

# Meta-parameters that select a different compiled kernel: autotuning keeps a best config each.
_SPECIALISATION = ["ELEM", "SCALE_MODE", "CAST", "X_BF16_BITS", "ROWWISE", "COLWISE"]


@functools.cache
def _autotuned(block_size: int) -> Any:
    configs = [
        c
        for c in quantize_autotune_configs()
        if c.kwargs["BLOCK_M"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]
    if not configs:
        raise ValueError(f"no quantize tile config fits block_size={block_size}")
    kernel = kernel_module("quantize", interpret=False).mx_quantize_kernel
    return autotuned(kernel, configs, ["M", "N", *_SPECIALISATION])


def quantize_launch(
    x: torch.Tensor,
    *,
    rowwise: bool,
    colwise: bool,
    fmt: ElemFormat,
    scale_mode: ScaleMode,
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
    check_cast(cast)
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
    meta = {
        "ELEM": fmt.name, "SCALE_MODE": scale_mode.value, "CAST": cast, "X_BF16_BITS": bf16,
        "ROWWISE": rowwise, "COLWISE": colwise, "SCALE_BLOCK": block_size,
    }  # fmt: skip

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    if m == 0 or n == 0:  # nothing to compute; Triton rejects an empty grid
        return row_data, row_scale, col_data, col_scale
    if tiles is None and not interpret:
        kernel = _autotuned(block_size)
    else:
        kernel = kernel_module("quantize", interpret=interpret).mx_quantize_kernel
        meta.update(tiles or interpreter_quantize_config())
    if wrap is not None:
        kernel = wrap(kernel)
    kernel[grid](*args, **meta)
    return row_data, row_scale, col_data, col_scale


def quantize_reference(
    x: torch.Tensor, axis: int, elem: str = "e4m3", scale_mode: str = "rceil", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the quantize kernel: the numerics core itself."""
    return quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode_named(scale_mode), block_size)
