"""MX attention on CPU: a key-tiled (flash-style) attention whose GEMMs are MX GEMMs.

Semantics (what `mxcompile::attention` and `mxcompile::attention_backward` compute)
--------------------------------------------------------------------------------
q: (B, Hq, Tq, d), k: (B, Hkv, Tk, d), v: (B, Hkv, Tk, dv), Hq a multiple of Hkv (GQA: query
head h reads key/value head h // (Hq / Hkv)). Every GEMM quantizes both operands along its own
contraction axis, in blocks of `block_size` that share one E8M0 scale (the numerics of
`mxcompile.numerics`, the one definition), and multiplies the exact dequantized values with
fp32 accumulation:

    forward    S  = Q·Kᵀ      Q, K along head_dim             (forward_elem)
               O  = P·V       P, V along the key axis         (forward_elem)
    backward   dV = Pᵀ·dO     P, dO along the query axis      (P: forward_elem, dO: grad_elem)
               dP = dO·Vᵀ     dO, V along head_dim (dv)       (dO: grad_elem, V: forward_elem)
               dQ = dS·K      dS, K along the key axis        (dS: grad_elem, K: forward_elem)
               dK = dSᵀ·Q     dS, Q along the query axis      (dS: grad_elem, Q: forward_elem)

The softmax scale and the mask are applied in fp32 to S, the softmax is fp32, and so are
dS = P ∘ (dP - D) with D = rowsum(dO ∘ O) (the flash-attention identity, with the MX output O).
Outputs are cast back to the input dtypes.

How P is quantized. The forward never holds a whole row of P: it walks over tiles of keys with
an online softmax. It keeps the running row maximum as an integer power-of-two exponent
m = ceil(rowmax(S)·log2(e)), so the row's largest unnormalized probability lies in (1/2, 1],
quantizes the unnormalized tile p = 2**(S·log2(e) - m) along keys, and divides by the row sum
l after the GEMM: O = (Σ_tiles MX(p)·MX(V)) / l. When m grows, the accumulator is rescaled by
an exact power of two, and MX quantization commutes with power-of-two scaling, so the result
does not depend on the tile size beyond fp32 rounding. It differs from quantizing the
normalized P (what the eager GEMM rewrite does to an explicit softmax·V) only in rounding:
both are MX along the key axis.

Causal masking caveat. Quantizing along a token axis puts `block_size` (32) consecutive tokens
under one scale. S = Q·Kᵀ quantizes along head_dim, inside one token, and mixes nothing. P's
masked entries are exactly 0 and never raise a block maximum. But O = P·V quantizes V along
the keys: the scale of V[32j : 32j+32, c] is set by the largest of those 32 keys, including
keys that a query near the causal diagonal (or behind an explicit mask) does not attend to. So
a key a query cannot see can change how the values of the keys it does see are rounded (never
their attention weights): an earlier output can move, by rounding, when a later token in the
same block of 32 changes; the move is large only when that token raises the block maximum
enough to push the other values toward e4m3's subnormal range. The backward has the same property along the query axis (dV = Pᵀ·dO and
dK = dSᵀ·Q quantize dO and Q over blocks of 32 queries). The error stays within the usual MX
bound; MX attention is causal in its weights but not bit-for-bit causal in its rounding.

attention="qk_only" keeps the score path in MX (S = Q·Kᵀ and its two backward GEMMs
dQ = dS·K and dK = dSᵀ·Q) and the value path in high precision (O = P·V, dV = Pᵀ·dO,
dP = dO·Vᵀ computed from unquantized fp32 operands). Rationale: P holds probabilities spread
over many orders of magnitude, and e4m3 keeps only ~2**-9 of a block's maximum before flushing
to zero, so the value path is where attention is most sensitive to MX; the score path has
operands (projected activations) shaped like ordinary GEMM inputs. "off" is not an op mode the
rewrite uses: the graph keeps aten's attention. The op accepts "off" (everything fp32) for
tests and benchmarks.

Rows without any attended key (every score -inf, or below about -2.4e38, e.g. torch.finfo.min
masks, which overflow when converted to base 2) give output 0, logsumexp +inf and zero
gradients, like torch's _safe_softmax; torch's flash kernel instead averages V for finite-min
rows.

Memory. The forward holds per key tile one (Tq x key_tile) score and probability tile plus
fp32 copies of Q, K, V and the output accumulator, so it grows with Tq·(key_tile + d), not
Tq·Tk; the backward recomputes S and P per tile from the saved logsumexp (also MX) and holds
the same per-tile working set plus fp32 gradient accumulators. With is_causal, a key tile
starting at key s skips the query rows before s (they see none of its keys, and s is a
multiple of block_size so query-axis blocks stay aligned), which halves the work.

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
`mx_attention_backward_triton`) when they support the call, and the torch implementation above
otherwise; `triton_attention_unsupported` says why not. The Triton forward computes the same
algorithm (base-2 online softmax with an integer running maximum, P quantized per key tile),
so it is tile-size independent like this one: key_tile only sets the torch implementation's
tiles. Both agree with the torch implementation up to fp32 summation order.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from .numerics import (
    DEFAULT_BLOCK_SIZE,
    check_block_size,
    dequantize_along,
    elem_format,
    quantize_along,
)
from .numerics import scale_mode as scale_mode_named

ATTENTION_MODES = ("both", "qk_only", "off")
# Gradient element format when the forward op is differentiated through its registered autograd
# (the MXFP8 recipe default); the graph rewrite calls the backward op with config.grad_elem and
# `mx_attention(grad_elem=...)` chooses its own.
DEFAULT_GRAD_ELEM = "e4m3"
DEFAULT_KEY_TILE = 128  # keys per tile, rounded down to a multiple of the block size
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_log = logging.getLogger(__name__)


def default_key_tile(block_size: int) -> int:
    """DEFAULT_KEY_TILE rounded down to a multiple of block_size (at least one block): key
    tiles must hold whole blocks, so that P's key-axis blocks never straddle two tiles."""
    return max(block_size, DEFAULT_KEY_TILE // block_size * block_size)


def _mx_rounded(x: torch.Tensor, axis: int, elem: str, mode: str, block_size: int) -> torch.Tensor:
    """x quantized to MX along axis and dequantized exactly to fp32 (the value the GEMM sees)."""
    axis = axis % x.ndim
    data, scale = quantize_along(x, axis, elem_format(elem), scale_mode_named(mode), block_size)
    return dequantize_along(data, scale, axis, block_size, torch.float32)


class _Operands:
    """Turns operands into the fp32 values a GEMM multiplies: MX-rounded along an axis when
    that GEMM family is in MX, the plain fp32 values otherwise."""

    def __init__(self, mode: str, scale_mode_name: str, block_size: int) -> None:
        self.mx_qk = mode in ("both", "qk_only")
        self.mx_pv = mode == "both"
        self.scale_mode = scale_mode_name
        self.block_size = block_size

    def qk(self, x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        """An operand of S = Q·Kᵀ, dQ = dS·K or dK = dSᵀ·Q."""
        if self.mx_qk:
            return _mx_rounded(x, axis, elem, self.scale_mode, self.block_size)
        return x.float()

    def pv(self, x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        """An operand of O = P·V, dV = Pᵀ·dO or dP = dO·Vᵀ."""
        if self.mx_pv:
            return _mx_rounded(x, axis, elem, self.scale_mode, self.block_size)
        return x.float()


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, T, e) -> (B, Hkv, G, T, e): query heads grouped under their key/value head."""
    batch, heads, seq, width = x.shape
    return x.reshape(batch, kv_heads, heads // kv_heads, seq, width)


def _grouped_mask(
    mask: torch.Tensor | None, batch: int, heads: int, kv_heads: int, q_len: int, k_len: int
) -> torch.Tensor | None:
    """The attention mask as a 5-D view (b, Hkv or 1, G or 1, Tq, Tk) in natural-log units:
    additive float masks as they are, boolean masks (True = attend) as 0 / -inf. Size-1 query
    and key dims are expanded (a view) so that tiles can slice them."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    mask = mask.expand(mask.shape[0], mask.shape[1], q_len, k_len)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, q_len, k_len)


def _tile_scores(
    q_tile: torch.Tensor,
    k_tile: torch.Tensor,
    mask5: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    q_lo: int,
    k_lo: int,
) -> torch.Tensor:
    """S·log2(e) of one key tile for query rows q_lo.. (fp32, masked entries -inf)."""
    k_hi = k_lo + k_tile.shape[-2]
    scores = torch.matmul(q_tile, k_tile.transpose(-1, -2)).mul_(scale * _LOG2E)
    if mask5 is not None:
        scores.add_(mask5[..., q_lo:, k_lo:k_hi], alpha=_LOG2E)
    if is_causal:
        rows = torch.arange(q_lo, q_lo + q_tile.shape[-2], device=scores.device).unsqueeze(-1)
        cols = torch.arange(k_lo, k_hi, device=scores.device).unsqueeze(0)
        scores.masked_fill_(cols > rows, float("-inf"))
    return scores


def _tile_starts(q_len: int, k_len: int, key_tile: int, is_causal: bool):
    """(first key, first query row) of every key tile that some query attends to."""
    for k_lo in range(0, k_len, key_tile):
        q_lo = k_lo if is_causal else 0  # top-left causal: row r sees keys 0..r
        if q_lo >= q_len:
            return
        yield k_lo, q_lo


def attention_forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    mode: str,
    forward_elem: str,
    scale_mode_name: str,
    block_size: int,
    key_tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-tiled MX attention forward: (output (B, Hq, Tq, dv) in q.dtype, logsumexp (B, Hq, Tq)
    fp32 in natural-log units). See the module docstring for the semantics."""
    batch, heads, q_len, _ = q.shape
    kv_heads, k_len, v_width = k.shape[1], k.shape[2], v.shape[-1]
    ops = _Operands(mode, scale_mode_name, block_size)
    qf = ops.qk(_grouped(q, kv_heads), -1, forward_elem)  # (B, Hkv, G, Tq, d)
    kf = ops.qk(k.unsqueeze(2), -1, forward_elem)  # (B, Hkv, 1, Tk, d)
    vf = ops.pv(v.unsqueeze(2), -2, forward_elem)  # (B, Hkv, 1, Tk, dv), blocks along keys
    mask5 = _grouped_mask(attn_mask, batch, heads, kv_heads, q_len, k_len)
    row_shape = (*qf.shape[:-1], 1)
    # Working tensors on the inputs' device (the CUDA kernel falls back to this function).
    exponent = torch.full(row_shape, float("-inf"), device=q.device)  # running ceil(row max), base 2
    row_sum = torch.zeros(row_shape, device=q.device)
    acc = torch.zeros((*qf.shape[:-1], v_width), device=q.device)
    for k_lo, q_lo in _tile_starts(q_len, k_len, key_tile, is_causal):
        k_hi = min(k_lo + key_tile, k_len)
        s2 = _tile_scores(qf[..., q_lo:, :], kf[..., k_lo:k_hi, :], mask5, is_causal, scale, q_lo, k_lo)
        old = exponent[..., q_lo:, :]
        new = torch.maximum(old, torch.ceil(s2.amax(dim=-1, keepdim=True)))
        new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
        # Both exponents are integers (or -inf), so the rescale is an exact power of two.
        alpha = torch.exp2(old - new_safe)
        p = torch.exp2(s2 - new_safe)
        row_sum[..., q_lo:, :].mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        pv = torch.matmul(ops.pv(p, -1, forward_elem), vf[..., k_lo:k_hi, :])
        acc[..., q_lo:, :].mul_(alpha).add_(pv)
        exponent[..., q_lo:, :] = new
    attended = row_sum > 0
    out = torch.where(attended, acc / torch.where(attended, row_sum, 1.0), 0.0)
    exponent = torch.where(torch.isfinite(exponent), exponent, torch.zeros_like(exponent))
    lse = torch.where(attended, (exponent + torch.log2(row_sum)) * _LN2, float("inf"))
    out = out.reshape(batch, heads, q_len, v_width).to(q.dtype)
    return out, lse.reshape(batch, heads, q_len)


def attention_backward_impl(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
    mode: str,
    forward_elem: str,
    grad_elem: str,
    scale_mode_name: str,
    block_size: int,
    key_tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key-tiled MX attention backward: (dq, dk, dv) in the dtypes of q, k, v. Recomputes S and
    P per tile from the saved logsumexp; every GEMM quantizes along its own contraction axis."""
    batch, heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    ops = _Operands(mode, scale_mode_name, block_size)
    q5 = _grouped(q, kv_heads)
    do5 = _grouped(grad_out, kv_heads)
    q_d = ops.qk(q5, -1, forward_elem)  # S = Q·Kᵀ: along head_dim
    k_d = ops.qk(k.unsqueeze(2), -1, forward_elem)
    q_t = ops.qk(q5, -2, forward_elem)  # dK = dSᵀ·Q: along queries
    k_t = ops.qk(k.unsqueeze(2), -2, forward_elem)  # dQ = dS·K: along keys
    v_d = ops.pv(v.unsqueeze(2), -1, forward_elem)  # dP = dO·Vᵀ: along dv
    do_d = ops.pv(do5, -1, grad_elem)
    do_t = ops.pv(do5, -2, grad_elem)  # dV = Pᵀ·dO: along queries
    delta = (do5.float() * _grouped(out, kv_heads).float()).sum(dim=-1, keepdim=True)
    lse2 = _grouped(lse.unsqueeze(-1), kv_heads) * _LOG2E
    mask5 = _grouped_mask(attn_mask, batch, heads, kv_heads, q_len, k_len)
    dq = torch.zeros(q_d.shape, device=q.device)
    dk = torch.zeros(k.shape, device=k.device)
    dv = torch.zeros(v.shape, device=v.device)
    for k_lo, q_lo in _tile_starts(q_len, k_len, key_tile, is_causal):
        k_hi = min(k_lo + key_tile, k_len)
        s2 = _tile_scores(q_d[..., q_lo:, :], k_d[..., k_lo:k_hi, :], mask5, is_causal, scale, q_lo, k_lo)
        p = torch.exp2(s2.sub_(lse2[..., q_lo:, :]))  # normalized probabilities
        # Pᵀ and dSᵀ quantized along their last axis are P and dS quantized along the queries.
        dv_tile = torch.matmul(ops.pv(p.transpose(-1, -2), -1, forward_elem), do_t[..., q_lo:, :])
        dv[:, :, k_lo:k_hi] = dv_tile.sum(dim=2)
        dp = torch.matmul(do_d[..., q_lo:, :], v_d[..., k_lo:k_hi, :].transpose(-1, -2))
        ds = dp.sub_(delta[..., q_lo:, :]).mul_(p)
        dq[..., q_lo:, :] += torch.matmul(ops.qk(ds, -1, grad_elem), k_t[..., k_lo:k_hi, :])
        dk_tile = torch.matmul(ops.qk(ds.transpose(-1, -2), -1, grad_elem), q_t[..., q_lo:, :])
        dk[:, :, k_lo:k_hi] = dk_tile.sum(dim=2)
    dq = (dq * scale).reshape(q.shape).to(q.dtype)
    return dq, (dk * scale).to(k.dtype), dv.to(v.dtype)


def sequence_major(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, ...) with (B, T, H, ...) memory order."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_sequence_major(like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    batch, heads, seq, *rest = shape
    return like.new_empty((batch, seq, heads, *rest), dtype=dtype).transpose(1, 2)


def _empty_output(q: torch.Tensor, width: int) -> torch.Tensor:
    """The attention output's buffer: laid out like q (as aten's CPU flash attention does) when
    it has q's shape, contiguous otherwise."""
    if width == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:-1], width))


# Output layouts. The ops return the layouts of aten's CPU flash attention (its meta functions):
# the output laid out like the query, the logsumexp and the gradients in (B, T, H, ...) memory
# order. Their fake implementations say the same, so the nodes after a replaced aten op, traced
# against its strides, stay valid; the rewrite checks this before replacing anything.


@torch.library.custom_op("mxcompile::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    mode: str,
    forward_elem: str,
    scale_mode: str,
    block_size: int,
    key_tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX attention forward: (output, logsumexp). See mxcompile.attention."""
    return _attention_forward_torch(
        q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode, block_size, key_tile
    )


def _attention_forward_torch(q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode, block_size,
                             key_tile):
    """The op's outputs, in its layouts, from the torch implementation."""
    out, lse = attention_forward_impl(
        q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode, block_size, key_tile
    )
    return _empty_output(q, out.shape[-1]).copy_(out), sequence_major(lse)


@attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode, block_size, key_tile):
    batch, heads, q_len, _ = q.shape
    return (
        _empty_output(q, v.shape[-1]),
        _empty_sequence_major(q, (batch, heads, q_len), torch.float32),
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
    mode: str,
    forward_elem: str,
    grad_elem: str,
    scale_mode: str,
    block_size: int,
    key_tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX attention backward: (dq, dk, dv), sequence-major. See mxcompile.attention."""
    return _attention_backward_torch(
        grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode, forward_elem, grad_elem,
        scale_mode, block_size, key_tile,
    )


def _attention_backward_torch(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode, forward_elem,
                              grad_elem, scale_mode, block_size, key_tile):
    """The op's outputs, in its layouts, from the torch implementation."""
    grads = attention_backward_impl(
        grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode, forward_elem, grad_elem,
        scale_mode, block_size, key_tile,
    )
    return tuple(sequence_major(g) for g in grads)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode,
                             forward_elem, grad_elem, scale_mode, block_size, key_tile):
    return tuple(_empty_sequence_major(t, tuple(t.shape), t.dtype) for t in (q, k, v))


# The Triton kernels on CUDA. The kernels take one head count for q, k and v, no mask, and
# head_dim a power of two; the forward kernel has MX in both GEMMs. `tl.dot_scaled` groups 32
# elements per scale.
TRITON_BLOCK_SIZE = 32


def triton_attention_unsupported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    mode: str,
    forward_elem: str,
    scale_mode: str,
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
      * forward only: mode other than "both" (the forward kernel quantizes both GEMMs; the
        backward kernels do "both", "qk_only" and "off");
      * block_size other than 32 (tl.dot_scaled's MX group);
      * an element format that tl.dot_scaled does not take; a dtype other than fp32/bf16/fp16;
      * value head_dim different from the query's, or head_dim not a power of two >= 32;
      * a key length not a multiple of the block size; is_causal with query length != key
        length (the kernels' causal mask is top-left aligned on a square);
      * tensors on different devices;
      * with check_device, what `triton_available` says (no triton, no CUDA GPU, compute
        capability below sm89; CPU tensors only under TRITON_INTERPRET=1).

    key_tile is not a reason: the kernels' results do not depend on their tile sizes beyond fp32
    summation order, so they choose their own (autotuned on a GPU)."""
    from .triton_templates.common import DOT_SCALED_FORMATS

    if attn_mask is not None:
        return "an attn_mask: the Triton attention kernels take no mask (only is_causal)"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "the Triton attention kernels take 4-D (batch, heads, seq, head_dim) tensors"
    if q.shape[1] != k.shape[1] or q.shape[1] != v.shape[1]:
        return (f"grouped-query attention ({q.shape[1]} query heads, {k.shape[1]} key/value heads): "
                "the Triton attention kernels need equal head counts")
    if grad_elem is None and mode != "both":
        return f"mode={mode!r}: the Triton forward kernel has MX in both GEMMs only (mode 'both')"
    if block_size != TRITON_BLOCK_SIZE:
        return f"block_size={block_size}: tl.dot_scaled's MX group is {TRITON_BLOCK_SIZE}"
    for name, elem in (("forward_elem", forward_elem), ("grad_elem", grad_elem)):
        if elem is not None and elem not in DOT_SCALED_FORMATS:
            return f"{name}={elem!r}: tl.dot_scaled takes {sorted(DOT_SCALED_FORMATS)}"
    tensors = (q, k, v, *backward_tensors)
    lse = backward_tensors[2] if len(backward_tensors) == 3 else None
    for t in tensors:
        if t is not lse and t.dtype not in _MX_DTYPES:
            return f"dtype {t.dtype}: the Triton attention kernels take {[str(d) for d in _MX_DTYPES]}"
    if lse is not None and lse.dtype != torch.float32:
        return f"logsumexp dtype {lse.dtype}: the Triton backward takes float32"
    width = q.shape[-1]
    if v.shape[-1] != width:
        return f"value head_dim {v.shape[-1]} != query head_dim {width}: the Triton kernels need one head_dim"
    if width < TRITON_BLOCK_SIZE or width & (width - 1):
        return f"head_dim {width}: the Triton attention kernels need a power of two >= {TRITON_BLOCK_SIZE}"
    if k.shape[2] % block_size:
        return f"key length {k.shape[2]} is not a multiple of block_size={block_size}"
    if is_causal and q.shape[2] != k.shape[2]:
        return (f"is_causal with query length {q.shape[2]} != key length {k.shape[2]}: the Triton "
                "kernels' causal mask is top-left aligned on a square")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"tensors on several devices ({sorted(map(str, devices))})"
    if check_device:
        from .triton_templates import triton_available

        ok, why = triton_available(q.device, elem=forward_elem, block_size=block_size)
        if not ok:
            return why
    return None


def attention_forward_cuda(q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode, block_size,
                           key_tile):
    """`mxcompile::attention` on CUDA: the Triton forward kernel when
    `triton_attention_unsupported` says it can run (no mask, equal head counts, mode "both",
    block 32, head_dim a power of two >= 32, a square causal mask), the torch implementation
    otherwise (logged at DEBUG level with the reason). Q and K are quantized along head_dim and
    V along the keys with the numerics core (`quantize_along`), then the kernel quantizes P per
    key tile in the same format and scale mode. The outputs have the op's layouts (the fake
    implementation's): the output laid out like q, the logsumexp sequence-major. Also callable
    on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    reason = triton_attention_unsupported(q, k, v, attn_mask, is_causal, mode, forward_elem, scale_mode,
                                          block_size)
    if reason is not None:
        _log.debug("mxcompile::attention: torch implementation, not the Triton kernel: %s", reason)
        return _attention_forward_torch(q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode,
                                        block_size, key_tile)
    from .triton_templates import mx_attention_triton

    fmt, rule = elem_format(forward_elem), scale_mode_named(scale_mode)
    q_data, q_scale = quantize_along(q, 3, fmt, rule, block_size)  # along head_dim
    k_data, k_scale = quantize_along(k, 3, fmt, rule, block_size)
    v_data, v_scale = quantize_along(v, 2, fmt, rule, block_size)  # along the keys
    out, lse = mx_attention_triton(
        q_data, q_scale, k_data, k_scale, v_data, v_scale, sm_scale=scale, causal=is_causal,
        block_size=block_size, out_dtype=q.dtype, p_elem=forward_elem, p_scale_mode=scale_mode,
        return_lse=True,
    )
    return _empty_output(q, out.shape[-1]).copy_(out), sequence_major(lse)


def attention_backward_cuda(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode, forward_elem,
                            grad_elem, scale_mode, block_size, key_tile):
    """`mxcompile::attention_backward` on CUDA: the Triton backward kernels (delta, dK/dV per
    key tile, dQ per query tile; every mode) when `triton_attention_unsupported` says they can
    run, the torch implementation otherwise (logged at DEBUG level with the reason). The
    logsumexp may come from either forward path: both give the natural-log row logsumexp. The
    gradients are sequence-major, as the fake implementation says. Also callable on CPU tensors
    under TRITON_INTERPRET=1 (the tests)."""
    reason = triton_attention_unsupported(
        q, k, v, attn_mask, is_causal, mode, forward_elem, scale_mode, block_size, grad_elem=grad_elem,
        backward_tensors=(grad_out, out, lse),
    )
    if reason is not None:
        _log.debug("mxcompile::attention_backward: torch implementation, not the Triton kernels: %s", reason)
        return _attention_backward_torch(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode,
                                         forward_elem, grad_elem, scale_mode, block_size, key_tile)
    from .triton_templates import mx_attention_backward_triton

    grads = mx_attention_backward_triton(
        q, k, v, out, grad_out, lse, sm_scale=scale, causal=is_causal, mode=mode,
        forward_elem=forward_elem, grad_elem=grad_elem, scale_mode=scale_mode, block_size=block_size,
    )
    return tuple(sequence_major(g) for g in grads)


attention_op.register_kernel("cuda")(attention_forward_cuda)
attention_backward_op.register_kernel("cuda")(attention_backward_cuda)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode_name, block_size, key_tile = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, attn_mask, out, lse)
    ctx.options = (is_causal, scale, mode, forward_elem, scale_mode_name, block_size, key_tile)


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor) -> tuple:
    q, k, v, attn_mask, out, lse = ctx.saved_tensors
    is_causal, scale, mode, forward_elem, scale_mode_name, block_size, key_tile = ctx.options
    dq, dk, dv = torch.ops.mxcompile.attention_backward.default(
        grad_out, q, k, v, attn_mask, out, lse, is_causal, scale, mode, forward_elem,
        DEFAULT_GRAD_ELEM, scale_mode_name, block_size, key_tile,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


class _MXAttentionFunction(torch.autograd.Function):
    """Autograd for `mx_attention` with an explicit gradient element format."""

    @staticmethod
    def forward(ctx: Any, q, k, v, attn_mask, is_causal, scale, mode, forward_elem, grad_elem,
                scale_mode_name, block_size, key_tile):
        out, lse = torch.ops.mxcompile.attention.default(
            q, k, v, attn_mask, is_causal, scale, mode, forward_elem, scale_mode_name, block_size, key_tile
        )
        ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        ctx.options = (is_causal, scale, mode, forward_elem, grad_elem, scale_mode_name, block_size, key_tile)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, attn_mask, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.mxcompile.attention_backward.default(
            grad_out, q, k, v, attn_mask, out, lse, *ctx.options
        )
        return dq, dk, dv, *([None] * 9)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, block_size: int,
    *, need_query_blocks: bool = True,
) -> str | None:
    """Why these tensors cannot go through MX attention, or None when they can. Used by
    `mx_attention` (which raises) and by the graph rewrite (which records the reason)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim != 4:
            return f"{name} has {t.ndim} dims; MX attention takes (batch, heads, seq, head_dim)"
        if t.dtype not in _MX_DTYPES:
            return f"{name} dtype {t.dtype} is not one of {[str(d) for d in _MX_DTYPES]}"
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


def mx_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    mode: str = "both",
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
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode={mode!r} is not accepted; accepted: {list(ATTENTION_MODES)}")
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
    return _MXAttentionFunction.apply(
        q, k, v, attn_mask, is_causal, scale, mode, forward_elem, grad_elem, scale_mode, block_size, key_tile
    )
