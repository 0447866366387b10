"""The MX attention ops: `mxcompile::attention` (forward) and `mxcompile::attention_backward`.

    mxcompile::attention(q, k, v, attn_mask, is_causal, scale, attention_mode, forward_elem,
                         scale_mode, block_size, key_tile, batch_chunk=1) -> (out, logsumexp)
    mxcompile::attention_backward(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale,
                                  attention_mode, forward_elem, grad_elem, scale_mode, block_size,
                                  key_tile, batch_chunk=1) -> (dq, dk, dv)

key_tile and batch_chunk set only the torch implementation's tiles (keys per tile, batch
elements per call): the values do not depend on them beyond fp32 summation order (key_tile)
or at all (batch_chunk); its scratch grows with both.

Semantics and the torch reference: `mxcompile.ops.attention_reference` (key-tiled, online
fp32 softmax, every GEMM MX along its own contraction axis). This module holds the schemas,
the fakes (the output layouts below), the autograd of the forward op (written once, also used
by the public `mxcompile.attention.mx_attention`), and the CUDA kernels.

Output layouts. The ops return the layouts of aten's CPU flash attention (its meta functions):
the output laid out like the query, the logsumexp and the gradients in (B, T, H, ...) memory
order. Their fake implementations say the same, so the nodes after a replaced aten op, traced
against its strides, stay valid; the rewrite checks this before replacing anything.

Lowering: opaque. The ops stay one node each through partitioning and Inductor (which runs
them as fallback kernels); `mxcompile.lowering` does not decompose them. Tracing the tile loop
into the graph would unroll Tk/key_tile iterations of ~40 ops each, so Inductor's compile time
and graph size would grow with the sequence length (and every new length would recompile
another unrolled loop), and its scheduler would be free to fuse across tiles, so the memory
bound would no longer hold by construction. The price is that quantization inside a tile runs
as unfused eager PyTorch ops.

CUDA. Both ops have a CUDA kernel (`attention_forward_cuda`, `attention_backward_cuda`,
registered with `register_kernel("cuda")`, so eager calls and Inductor's fallback kernels reach
it alike) that runs the Triton kernels of `mxcompile.triton_templates` (`mx_attention_triton`,
`mx_attention_backward_triton`) when they support the call, and the torch implementation
otherwise; `triton_attention_unsupported` (`mxcompile.ops.attention_checks`) says why not. The
Triton forward computes the same algorithm (base-2 online softmax with an integer running
maximum, P quantized per key tile), so it is tile-size independent like the torch one: key_tile
only sets the torch implementation's tiles. Both agree with the torch implementation up to
fp32 summation order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..numerics import elem_format, quantize_along, scales_shape
from ..numerics import scale_mode_named
from .attention_checks import triton_attention_unsupported
from .attention_reference import (AttentionOptions, attention_backward_impl, attention_forward_impl,
                                  empty_sequence_major)
from .quantize import quantize_with_triton, triton_quantize_unsupported

_log = logging.getLogger(__name__)


def sequence_major(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, ...) with (B, T, H, ...) memory order."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_output(q: torch.Tensor, width: int) -> torch.Tensor:
    """The attention output's buffer: laid out like q (as aten's CPU flash attention does) when
    it has q's shape, contiguous otherwise."""
    if width == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:-1], width))


@torch.library.custom_op("mxcompile::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    attention_mode: str,
    forward_elem: str,
    scale_mode: str,
    block_size: int,
    key_tile: int,
    batch_chunk: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX attention forward: (output, logsumexp). See mxcompile.ops.attention_reference."""
    options = AttentionOptions.from_forward_args(is_causal, scale, attention_mode, forward_elem, scale_mode,
                                                 block_size, key_tile, batch_chunk)
    return _attention_forward_torch(q, k, v, attn_mask, options)


# A chunk the rewrite lets the torch implementation run at once, when no memory budget asks
# for the least scratch: whole batch elements, at most this many query elements in all (or one
# element). The implementation's ~40 ops per key tile then serve several elements, and its
# scratch, up to ~28 fp32 copies of a chunk's query at head_dim 32 (`cost.graph_costs`), stays
# under ~65 MiB.
# Measured on the 2-core CPU (2026-12-06, causal, bf16, 8 heads of 64, key tile 128, forward +
# backward, medians of 10-12 interleaved repeats): 2**19 beats 2**20 where they differ, since
# the score tiles' eager passes then stay near the caches (batch 8, sequence 256: 58.9 ms at
# 4 elements per chunk against 71.0 ms at 8; sequence 1024, batch 4: 305 ms at 1 against 330
# at 4; chunks of 2 measured within 5% of the chosen sizes).
ATTENTION_CHUNK_QUERY_NUMEL = 1 << 19


def batch_chunk_for(batch: int, element_numel: int) -> int:
    """Batch elements per chunk for a query of `element_numel` elements per batch element
    (see ATTENTION_CHUNK_QUERY_NUMEL)."""
    return max(1, min(batch, ATTENTION_CHUNK_QUERY_NUMEL // max(1, element_numel)))


def _batch_chunks(batch: int, chunk: int) -> list[slice]:
    return [slice(lo, min(lo + chunk, batch)) for lo in range(0, batch, chunk)]


def _batch_mask(attn_mask: torch.Tensor | None, batch: int, part: slice) -> torch.Tensor | None:
    """The part of ``attn_mask`` (broadcastable to (batch, H, Tq, Tk)) for the batch elements ``part``."""
    if attn_mask is None or attn_mask.ndim < 4 or attn_mask.shape[0] != batch:
        return attn_mask
    return attn_mask[part]


def _attention_forward_torch(q, k, v, attn_mask, options: AttentionOptions):
    """The op's outputs, in its layouts, from the torch implementation, run `batch_chunk` batch
    elements at a time: its scratch (fp32 copies of the operands, `attention_reference`'s
    "Memory") is that of one chunk, not of the batch. Every block of the MX quantization lies
    within one (batch element, head), so the values are those of one batched call."""
    batch, heads, q_len, _ = q.shape
    out = _empty_output(q, v.shape[-1])
    lse = empty_sequence_major(q, (batch, heads, q_len), torch.float32)
    for part in _batch_chunks(batch, options.batch_chunk):
        out_b, lse_b = attention_forward_impl(q[part], k[part], v[part], _batch_mask(attn_mask, batch, part),
                                              options)
        out[part].copy_(out_b)
        lse[part].copy_(lse_b)
        del out_b, lse_b  # not held through the next chunk's call
    return out, lse


@attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, is_causal, scale, attention_mode, forward_elem, scale_mode, block_size,
                    key_tile, batch_chunk=1):
    batch, heads, q_len, _ = q.shape
    return (
        _empty_output(q, v.shape[-1]),
        empty_sequence_major(q, (batch, heads, q_len), torch.float32),
    )


@torch.library.custom_op("mxcompile::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
    attention_mode: str,
    forward_elem: str,
    grad_elem: str,
    scale_mode: str,
    block_size: int,
    key_tile: int,
    batch_chunk: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX attention backward: (dq, dk, dv), sequence-major. See mxcompile.ops.attention_reference."""
    options = AttentionOptions.from_backward_args(is_causal, scale, attention_mode, forward_elem, grad_elem,
                                                  scale_mode, block_size, key_tile, batch_chunk)
    return _attention_backward_torch(grad_out, q, k, v, attn_mask, out, lse, options)


def _attention_backward_torch(grad_out, q, k, v, attn_mask, out, lse, options: AttentionOptions):
    """The op's outputs, in its layouts, from the torch implementation, `batch_chunk` batch
    elements at a time (as `_attention_forward_torch`)."""
    batch = q.shape[0]
    chunks = _batch_chunks(batch, options.batch_chunk)
    if len(chunks) == 1:  # the implementation's gradients are sequence-major: no second buffer
        return attention_backward_impl(grad_out, q, k, v, attn_mask, out, lse, options)
    grads = tuple(empty_sequence_major(t, tuple(t.shape), t.dtype) for t in (q, k, v))
    for part in chunks:
        parts = attention_backward_impl(grad_out[part], q[part], k[part], v[part], _batch_mask(attn_mask, batch, part),
                                        out[part], lse[part], options)
        for grad, grad_b in zip(grads, parts):
            grad[part].copy_(grad_b)
        del parts, grad_b  # not held through the next chunk's call
    return grads


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, attention_mode,
                             forward_elem, grad_elem, scale_mode, block_size, key_tile, batch_chunk=1):
    return tuple(empty_sequence_major(t, tuple(t.shape), t.dtype) for t in (q, k, v))


HEAD_DIM_AXIS, SEQUENCE_AXIS = 3, 2  # of a (batch, heads, sequence, head_dim) operand


def _quantize_operand(x: torch.Tensor, axis: int, elem: str, scale_mode: str,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention operand (batch, heads, sequence, head_dim) quantized along head_dim or the
    sequence into contiguous data and scales: with one Triton quantize kernel where it runs
    (the operand as a (rows, head_dim) matrix, quantized along its rows or its columns; blocks
    of 32 rows stay within one head when the sequence is a multiple of the block), else with
    the numerics core in eager ops (about fifteen kernels per operand)."""
    along_sequence = axis == SEQUENCE_AXIS
    if triton_quantize_unsupported(x, elem, block_size) is None and (
            not along_sequence or x.shape[SEQUENCE_AXIS] % block_size == 0):
        data, scale = quantize_with_triton(x.reshape(-1, x.shape[-1]), 0 if along_sequence else 1, elem,
                                           scale_mode, block_size)
        return data.reshape(x.shape), scale.reshape(scales_shape(x.shape, axis, block_size))
    return quantize_along(x, axis, elem_format(elem), scale_mode_named(scale_mode), block_size)


@attention_op.register_kernel("cuda")
def attention_forward_cuda(q, k, v, attn_mask, is_causal, scale, attention_mode, forward_elem, scale_mode,
                           block_size, key_tile, batch_chunk=1):
    """`mxcompile::attention` on CUDA: the Triton forward kernel when
    `triton_attention_unsupported` says it can run (no mask, equal head counts, attention_mode
    "both", block 32, head_dim a power of two >= 32, a square causal mask), the torch implementation
    otherwise (logged at DEBUG level with the reason). Q and K are quantized along head_dim and
    V along the keys (`_quantize_operand`), then the kernel expands them exactly for bf16 MMAs
    and rounds P to MX per key tile in the same format and scale mode. The outputs have the op's layouts (the fake
    implementation's): the output laid out like q, the logsumexp sequence-major. Also callable
    on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    options = AttentionOptions.from_forward_args(is_causal, scale, attention_mode, forward_elem, scale_mode,
                                                 block_size, key_tile, batch_chunk)
    reason = triton_attention_unsupported(q, k, v, attn_mask, is_causal, attention_mode, forward_elem,
                                          block_size)
    if reason is not None:
        _log.debug("mxcompile::attention: torch implementation, not the Triton kernel: %s", reason)
        return _attention_forward_torch(q, k, v, attn_mask, options)
    from ..triton_templates import mx_attention_triton

    q_data, q_scale = _quantize_operand(q, HEAD_DIM_AXIS, forward_elem, scale_mode, block_size)
    k_data, k_scale = _quantize_operand(k, HEAD_DIM_AXIS, forward_elem, scale_mode, block_size)
    v_data, v_scale = _quantize_operand(v, SEQUENCE_AXIS, forward_elem, scale_mode, block_size)
    out, lse = mx_attention_triton(
        q_data, q_scale, k_data, k_scale, v_data, v_scale, sm_scale=scale, causal=is_causal,
        block_size=block_size, out_dtype=q.dtype, p_elem=forward_elem, p_scale_mode=scale_mode,
        return_lse=True,
    )
    return _empty_output(q, out.shape[-1]).copy_(out), sequence_major(lse)


@attention_backward_op.register_kernel("cuda")
def attention_backward_cuda(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, attention_mode,
                            forward_elem, grad_elem, scale_mode, block_size, key_tile, batch_chunk=1):
    """`mxcompile::attention_backward` on CUDA: the Triton backward kernels (delta, dK/dV per
    key tile, dQ per query tile; every attention mode) when `triton_attention_unsupported` says they can
    run, on Q, K, V and dO quantized here along each product's contraction axis (Q and dO along
    head_dim and the queries, K along head_dim and the keys, V along head_dim; the GEMM families
    out of MX in high precision), the torch implementation otherwise (logged at DEBUG level with the reason). The
    logsumexp may come from either forward path: both give the natural-log row logsumexp. The
    gradients are sequence-major, as the fake implementation says. Also callable on CPU tensors
    under TRITON_INTERPRET=1 (the tests)."""
    options = AttentionOptions.from_backward_args(is_causal, scale, attention_mode, forward_elem, grad_elem,
                                                  scale_mode, block_size, key_tile, batch_chunk)
    reason = triton_attention_unsupported(
        q, k, v, attn_mask, is_causal, attention_mode, forward_elem, block_size, grad_elem=grad_elem,
        backward_tensors=(grad_out, out, lse),
    )
    if reason is not None:
        _log.debug("mxcompile::attention_backward: torch implementation, not the Triton kernels: %s", reason)
        return _attention_backward_torch(grad_out, q, k, v, attn_mask, out, lse, options)
    from ..triton_templates import mx_attention_backward_triton
    from ..triton_templates.attention_backward import quantize_backward_operands

    def quantize(x: torch.Tensor, axis: int, elem: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_operand(x, axis % x.ndim, elem, scale_mode, block_size)

    operands = quantize_backward_operands(q, k, v, grad_out, quantize, attention_mode=attention_mode,
                                          forward_elem=forward_elem, grad_elem=grad_elem)
    grads = mx_attention_backward_triton(
        operands, out, grad_out, lse, sm_scale=scale, causal=is_causal, attention_mode=attention_mode,
        forward_elem=forward_elem, grad_elem=grad_elem, scale_mode=scale_mode, block_size=block_size,
        out_dtypes=(q.dtype, k.dtype, v.dtype),
    )
    return tuple(sequence_major(g) for g in grads)


# The autograd of the forward op, written once: the op's registered autograd (gradient format
# DEFAULT_GRAD_ELEM) and `mxcompile.attention.mx_attention` (a chosen gradient format) both
# save with `save_attention_context` and differentiate with `attention_grads`.


def save_attention_context(ctx: Any, q, k, v, attn_mask, out, lse, options: AttentionOptions) -> None:
    """Save what `attention_grads` needs on an autograd context."""
    ctx.save_for_backward(q, k, v, attn_mask, out, lse)
    ctx.attention_options = options


def attention_grads(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward saved by `save_attention_context`: the backward op."""
    q, k, v, attn_mask, out, lse = ctx.saved_tensors
    return ATTENTION_BACKWARD(grad_out, q, k, v, attn_mask, out, lse, *ctx.attention_options.backward_args())


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, attn_mask, *rest = inputs
    save_attention_context(ctx, q, k, v, attn_mask, *output, AttentionOptions.from_forward_args(*rest))


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor) -> tuple:
    return *attention_grads(ctx, grad_out), *([None] * _ARGS_AFTER_QKV)


# The overloads the graph passes insert.
ATTENTION = torch.ops.mxcompile.attention.default
ATTENTION_BACKWARD = torch.ops.mxcompile.attention_backward.default
# Arguments of `mxcompile::attention` after q, k, v: attn_mask and the seven options.
_ARGS_AFTER_QKV = 8

attention_op.register_autograd(_backward, setup_context=_setup_context)
