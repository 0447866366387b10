"""The public MX attention: `mx_attention`, with the calling convention of
F.scaled_dot_product_attention, differentiable.

The ops it calls, their semantics and their kernels are in `mxcompile.ops.attention` (schemas,
fakes, autograd, CUDA kernels), `mxcompile.ops.attention_reference` (the torch reference and
the numerics) and `mxcompile.ops.attention_checks` (which inputs MX attention and the Triton
kernels take).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .numerics import DEFAULT_BLOCK_SIZE, check_block_size, elem_format
from .numerics import scale_mode_named
from .ops.attention import ATTENTION, attention_grads, save_attention_context
from .ops.attention_checks import check_attention_inputs
from .ops.attention_reference import AttentionOptions, check_attention_mode, default_key_tile



class _MXAttentionFunction(torch.autograd.Function):
    """`mxcompile::attention` with an explicit gradient element format; the saving and the
    backward are the op's own (`save_attention_context`, `attention_grads`)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, attn_mask, options: AttentionOptions):
        out, lse = ATTENTION(q, k, v, attn_mask, *options.forward_args())
        save_attention_context(ctx, q, k, v, attn_mask, out, lse, options)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        return *attention_grads(ctx, grad_out), None, None


def mx_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    attention_mode: str = "both",
    forward_elem: str = "e4m3",
    grad_elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = DEFAULT_BLOCK_SIZE,
    key_tile: int | None = None,
) -> torch.Tensor:
    """MX attention with the calling convention of F.scaled_dot_product_attention (no dropout;
    GQA when k and v have fewer heads than q). Differentiable. key_tile: keys per tile, a
    multiple of block_size (default: default_key_tile(block_size)). Raises ValueError on inputs
    it cannot take, naming the problem."""
    check_attention_mode(attention_mode)
    elem_format(forward_elem, argument="forward_elem")
    elem_format(grad_elem, argument="grad_elem")
    scale_mode_named(scale_mode)
    check_block_size(block_size)
    key_tile = default_key_tile(block_size) if key_tile is None else key_tile
    if isinstance(key_tile, bool) or not isinstance(key_tile, int) or key_tile <= 0 or key_tile % block_size:
        raise ValueError(f"key_tile={key_tile!r}: give a positive multiple of block_size={block_size}")
    if attn_mask is not None and is_causal:
        raise ValueError("give either attn_mask or is_causal=True, not both (as in F.scaled_dot_product_attention)")
    reason = check_attention_inputs(q, k, v, attn_mask, block_size)
    if reason is not None:
        raise ValueError(reason)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    options = AttentionOptions(is_causal, scale, attention_mode, forward_elem, scale_mode, block_size, key_tile,
                               grad_elem)
    return _MXAttentionFunction.apply(q, k, v, attn_mask, options)
