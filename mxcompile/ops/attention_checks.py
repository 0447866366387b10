"""Which calls MX attention can take, and which of them the Triton attention kernels can run.

`check_attention_inputs` says why tensors cannot go through MX attention at all (the public
`mx_attention` raises it, the graph rewrite records it); `triton_attention_unsupported` says
why the CUDA kernels of the attention ops (`mxcompile.ops.attention`) fall back to the torch
implementation for a call.
"""

from __future__ import annotations

import torch

MX_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The Triton kernels on CUDA (`mxcompile.triton_templates.attention*`): they load Q, K, V and dO
# quantized outside them (FP8 data and E8M0 scales, by the quantize kernel), expand the tiles
# exactly to bf16 for bf16 MMAs and round P and dS to MX in registers. Their launchers take the
# OCP MX block of 32 elements, and the FP8 element formats their expansion converts.
TRITON_BLOCK_SIZE = 32
TRITON_ELEMS = ("e4m3", "e5m2")


def triton_attention_unsupported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    attention_mode: str,
    forward_elem: str,
    block_size: int,
    *,
    grad_elem: str | None = None,
    backward_tensors: tuple[torch.Tensor, ...] = (),
    check_device: bool = True,
) -> str | None:
    """Why the Triton kernels cannot run this call of `mxcompile::attention` (or, with
    `grad_elem` and `backward_tensors` = (grad_out, out, lse), of `mxcompile::attention_backward`),
    or None when they can. Reasons, in order:

      * an attn_mask: the kernels apply only is_causal;
      * grouped-query attention (fewer key/value heads than query heads): the kernels index k
        and v by the query head;
      * forward only: attention_mode other than "both" (the forward kernel has MX in both
        GEMMs; the backward kernels do "both", "qk_only" and "off");
      * block_size other than 32: the launchers take the OCP MX block only;
      * an element format other than FP8 e4m3/e5m2 (the formats the tile expansion converts);
        a dtype other than fp32/bf16/fp16;
      * value head_dim different from the query's, or head_dim not a power of two >= 32 (one
        HEAD_DIM, a power of two for tl.arange, holding whole scale blocks);
      * with MX products (attention_mode not "off"), a length they contract in blocks that is
        not a multiple of block_size: the keys (O = P·V, dQ = dS·K) and, for the backward, the
        queries (dK = dSᵀ·Q; dV = Pᵀ·dO in mode "both"); the numerics core quantizes whole
        blocks only. Lengths that are not multiples of the kernels' tiles are fine (masked);
      * is_causal with query length != key length (the kernels' causal mask is top-left
        aligned on a square);
      * tensors on different devices;
      * with check_device, what `triton_available` says (no triton, no CUDA GPU, compute
        capability below sm89; CPU tensors only under TRITON_INTERPRET=1).

    key_tile is not a reason: the kernels' results do not depend on their tile sizes beyond fp32
    summation order, so they choose their own (autotuned on a GPU)."""
    if attn_mask is not None:
        return "an attn_mask: the Triton attention kernels take no mask (only is_causal)"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "the Triton attention kernels take 4-D (batch, heads, seq, head_dim) tensors"
    if q.shape[1] != k.shape[1] or q.shape[1] != v.shape[1]:
        return (f"grouped-query attention ({q.shape[1]} query heads, {k.shape[1]} key/value heads): "
                "the Triton attention kernels need equal head counts")
    if grad_elem is None and attention_mode != "both":
        return (f"attention_mode={attention_mode!r}: the Triton forward kernel has MX in both GEMMs only "
                "(attention_mode 'both')")
    if block_size != TRITON_BLOCK_SIZE:
        return f"block_size={block_size}: the Triton attention kernels take the MX block of {TRITON_BLOCK_SIZE}"
    for name, elem in (("forward_elem", forward_elem), ("grad_elem", grad_elem)):
        if elem is not None and elem not in TRITON_ELEMS:
            return f"{name}={elem!r}: the Triton attention kernels expand FP8 {list(TRITON_ELEMS)}"
    tensors = (q, k, v, *backward_tensors)
    lse = backward_tensors[2] if len(backward_tensors) == 3 else None
    for t in tensors:
        if t is not lse and t.dtype not in MX_ATTENTION_DTYPES:
            return f"dtype {t.dtype}: the Triton attention kernels take {[str(d) for d in MX_ATTENTION_DTYPES]}"
    if lse is not None and lse.dtype != torch.float32:
        return f"logsumexp dtype {lse.dtype}: the Triton backward takes float32"
    width = q.shape[-1]
    if v.shape[-1] != width:
        return f"value head_dim {v.shape[-1]} != query head_dim {width}: the Triton kernels need one head_dim"
    if width < TRITON_BLOCK_SIZE or width & (width - 1):
        return f"head_dim {width}: the Triton attention kernels need a power of two >= {TRITON_BLOCK_SIZE}"
    if attention_mode != "off":
        lengths = [("key", k.shape[2])] + ([("query", q.shape[2])] if grad_elem is not None else [])
        for what, length in lengths:
            if length % block_size:
                return (f"{what} length {length} is not a multiple of block_size={block_size}: an MX product "
                        f"contracts the {what}s in whole blocks")
    if is_causal and q.shape[2] != k.shape[2]:
        return (f"is_causal with query length {q.shape[2]} != key length {k.shape[2]}: the Triton "
                "kernels' causal mask is top-left aligned on a square")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"tensors on several devices ({sorted(map(str, devices))})"
    if check_device:
        from ..triton_templates import triton_available

        ok, why = triton_available(q.device, elem=forward_elem, block_size=block_size)
        if not ok:
            return why
    return None



def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, block_size: int,
    *, need_query_blocks: bool = True,
) -> str | None:
    """Why these tensors cannot go through MX attention, or None when they can. Used by
    `mx_attention` (which raises) and by the graph rewrite (which records the reason)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim != 4:
            return f"{name} has {t.ndim} dims; MX attention takes (batch, heads, seq, head_dim)"
        if t.dtype not in MX_ATTENTION_DTYPES:
            return f"{name} dtype {t.dtype} is not one of {[str(d) for d in MX_ATTENTION_DTYPES]}"
    if not q.dtype == k.dtype == v.dtype:
        return f"query, key, value dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    batch, heads, q_len, width = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        return f"batch sizes differ (query {batch}, key {k.shape[0]}, value {v.shape[0]})"
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or k.shape[3] != width:
        return f"key {tuple(k.shape)} and value {tuple(v.shape)} do not fit query {tuple(q.shape)}"
    if heads % k.shape[1]:
        return f"{heads} query heads are not a multiple of {k.shape[1]} key/value heads"
    checks = [("head_dim", width), ("value head_dim", v.shape[3]), ("key length", k.shape[2])]
    if need_query_blocks:  # dV = Pᵀ·dO and dK = dSᵀ·Q contract over the queries
        checks.append(("query length", q_len))
    for what, size in checks:
        if size % block_size:
            return f"{what} {size} is not divisible by block_size={block_size}"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return f"attn_mask dtype {attn_mask.dtype} is neither bool nor floating point"
        try:
            torch.broadcast_shapes(tuple(attn_mask.shape), (batch, heads, q_len, k.shape[2]))
        except RuntimeError:
            return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to the scores {(batch, heads, q_len, k.shape[2])}"
        mask_heads = attn_mask.shape[-3] if attn_mask.ndim >= 3 else 1
        if mask_heads not in (1, heads):
            return f"attn_mask has {mask_heads} heads; give 1 or {heads}"
    return None

