"""The torch reference of MX attention: a key-tiled (flash-style) attention whose GEMMs are
MX GEMMs.

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

The ops, their layouts, their lowering and their CUDA kernels: `mxcompile.ops.attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics import elem_format, fake_quantize_along
from ..numerics import scale_mode_named
from . import native
from .cpu_kernels import fake_quantized, runs_compiled
from .quantize import _is_transposed_contiguous

ATTENTION_MODES = ("both", "qk_only", "off")
# Gradient element format when the forward op is differentiated through its registered autograd
# (the MXFP8 recipe default); the graph rewrite calls the backward op with config.grad_elem and
# `mx_attention(grad_elem=...)` chooses its own.
DEFAULT_GRAD_ELEM = "e4m3"
DEFAULT_KEY_TILE = 128  # keys per tile, rounded down to a multiple of the block size
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def check_attention_mode(attention_mode: str) -> None:
    """Raise ValueError unless `attention_mode` is one of ATTENTION_MODES."""
    if attention_mode not in ATTENTION_MODES:
        accepted = list(ATTENTION_MODES)
        raise ValueError(f"attention_mode={attention_mode!r} is not accepted; accepted: {accepted}")


@dataclass(frozen=True)
class AttentionOptions:
    """The non-tensor arguments of the attention ops, in one value. `grad_elem` is used by the
    backward only (the forward op's schema has none: its registered autograd uses
    DEFAULT_GRAD_ELEM). The op schemas stay positional (torch.library takes no dataclasses);
    `forward_args` / `backward_args` give them in schema order."""

    is_causal: bool
    scale: float
    attention_mode: str
    forward_elem: str
    scale_mode: str
    block_size: int
    key_tile: int
    grad_elem: str = DEFAULT_GRAD_ELEM
    batch_chunk: int = 1  # batch elements the ops' torch implementation runs at a time

    def __post_init__(self) -> None:
        check_attention_mode(self.attention_mode)
        if isinstance(self.batch_chunk, bool) or not isinstance(self.batch_chunk, int) or self.batch_chunk < 1:
            raise ValueError(f"batch_chunk={self.batch_chunk!r}: give a positive int")

    @classmethod
    def from_forward_args(cls, is_causal: bool, scale: float, attention_mode: str, forward_elem: str,
                          scale_mode: str, block_size: int, key_tile: int, batch_chunk: int = 1, *,
                          grad_elem: str = DEFAULT_GRAD_ELEM) -> AttentionOptions:
        """From the trailing arguments of `mxcompile::attention`, in schema order."""
        return cls(is_causal, scale, attention_mode, forward_elem, scale_mode, block_size, key_tile, grad_elem,
                   batch_chunk)

    @classmethod
    def from_backward_args(cls, is_causal: bool, scale: float, attention_mode: str, forward_elem: str,
                           grad_elem: str, scale_mode: str, block_size: int, key_tile: int,
                           batch_chunk: int = 1) -> AttentionOptions:
        """From the trailing arguments of `mxcompile::attention_backward`, in schema order."""
        return cls(is_causal, scale, attention_mode, forward_elem, scale_mode, block_size, key_tile, grad_elem,
                   batch_chunk)

    def forward_args(self) -> tuple:
        """The trailing arguments of `mxcompile::attention`, in schema order."""
        return (self.is_causal, self.scale, self.attention_mode, self.forward_elem, self.scale_mode,
                self.block_size, self.key_tile, self.batch_chunk)

    def backward_args(self) -> tuple:
        """The trailing arguments of `mxcompile::attention_backward`, in schema order."""
        return (self.is_causal, self.scale, self.attention_mode, self.forward_elem, self.grad_elem,
                self.scale_mode, self.block_size, self.key_tile, self.batch_chunk)


def default_key_tile(block_size: int) -> int:
    """DEFAULT_KEY_TILE rounded down to a multiple of block_size (at least one block): key
    tiles must hold whole blocks, so that P's key-axis blocks never straddle two tiles."""
    return max(block_size, DEFAULT_KEY_TILE // block_size * block_size)


def _mx_rounded(x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int) -> torch.Tensor:
    """x quantized to MX along axis and dequantized exactly to fp32 (the value the GEMM sees),
    in fp32 arithmetic (no fp8 round trip: see `numerics.fake_quantize_along`). The ops are
    opaque to Inductor, so on the CPU operands are rounded by a CPU kernel of
    `mxcompile::fake_quantize` (`cpu_kernels`: one fused loop instead of about fifteen eager
    elementwise passes), in their own memory order, the result in that order too. The native
    kernels read bf16 Q, K, V and dO as they are; for the compiled graphs (where the native
    kernels are not built) they are converted to fp32 first (exact): the fp32 graphs of the
    score tiles then serve them too, two compiled graphs fewer on a cold cache (about 3 s each
    on the 2-core CPU) for one vectorized conversion pass."""
    rounded = None
    if native.available():
        rounded = fake_quantized(x.detach(), axis, elem, scale_mode, block_size, torch.float32)
    elif runs_compiled(x):
        rounded = fake_quantized(_fp32_for_rounding(x), axis, elem, scale_mode, block_size, torch.float32)
    if rounded is not None:
        return rounded
    return fake_quantize_along(x, axis % x.ndim, elem_format(elem), scale_mode_named(scale_mode), block_size)


def _fp32_for_rounding(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 (exact), detached, in the memory order the compiled rounding reads: x's own
    where it is contiguous or the transpose of a contiguous tensor, contiguous otherwise (one
    pass that converts and reorders, where `.float()` and then the kernel's `.contiguous()`
    made two: Q, K, V and dO arrive as (B, H, T, d) views of (B, T, H, d) memory)."""
    x = x.detach()
    if x.is_contiguous() or _is_transposed_contiguous(x):
        return x.float()
    return x.to(torch.float32, memory_format=torch.contiguous_format)


class _Operands:
    """Turns operands into the fp32 values a GEMM multiplies: MX-rounded along an axis when
    that GEMM family is in MX, the plain fp32 values otherwise."""

    def __init__(self, attention_mode: str, scale_mode: str, block_size: int) -> None:
        self.mx_qk = attention_mode in ("both", "qk_only")
        self.mx_pv = attention_mode == "both"
        self.scale_mode = scale_mode
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
        # Only rows before the tile's last key see part of it: later rows see all its keys.
        masked_rows = max(0, min(q_tile.shape[-2], k_hi - 1 - q_lo))
        rows = torch.arange(q_lo, q_lo + masked_rows, device=scores.device).unsqueeze(-1)
        cols = torch.arange(k_lo, k_hi, device=scores.device).unsqueeze(0)
        scores[..., :masked_rows, :].masked_fill_(cols > rows, float("-inf"))
    return scores


def _tile_starts(q_len: int, k_len: int, key_tile: int, is_causal: bool):
    """(first key, first query row) of every key tile that some query attends to."""
    for k_lo in range(0, k_len, key_tile):
        q_lo = k_lo if is_causal else 0  # top-left causal: row r sees keys 0..r
        if q_lo >= q_len:
            return
        yield k_lo, q_lo


def empty_sequence_major(like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of `shape` (B, H, T, ...) laid out (B, T, H, ...) on `like`'s device: the
    layout of the ops' logsumexp and gradients."""
    batch, heads, seq, *rest = shape
    return like.new_empty((batch, seq, heads, *rest), dtype=dtype).transpose(1, 2)


def attention_forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    options: AttentionOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-tiled MX attention forward: (output (B, Hq, Tq, dv) in q.dtype, logsumexp (B, Hq, Tq)
    fp32 in natural-log units). See the module docstring for the semantics."""
    batch, heads, q_len, _ = q.shape
    kv_heads, k_len, v_width = k.shape[1], k.shape[2], v.shape[-1]
    ops = _Operands(options.attention_mode, options.scale_mode, options.block_size)
    is_causal, scale, key_tile, forward_elem = options.is_causal, options.scale, options.key_tile, options.forward_elem
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
        p = s2.sub_(new_safe).exp2_()  # in S's buffer (S is not used again)
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
    options: AttentionOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key-tiled MX attention backward: (dq, dk, dv) in the dtypes of q, k, v. Recomputes S and
    P per tile from the saved logsumexp; every GEMM quantizes along its own contraction axis.

    Scratch: the seven rounded operands and the fp32 gradients live through the loop; the fp32
    copies the roundings read, and each tile's P once dS is formed, are dropped as soon as they
    are used (the op's peak inside a checkpointed layer's recomputation, issue 46)."""
    batch, heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    ops = _Operands(options.attention_mode, options.scale_mode, options.block_size)
    is_causal, scale, key_tile = options.is_causal, options.scale, options.key_tile
    forward_elem, grad_elem = options.forward_elem, options.grad_elem
    # Q, K and dO are each rounded along two axes: converted to fp32 once (exact), not per use.
    q5 = _fp32_for_rounding(_grouped(q, kv_heads))
    q_d = ops.qk(q5, -1, forward_elem)  # S = Q·Kᵀ: along head_dim
    q_t = ops.qk(q5, -2, forward_elem)  # dK = dSᵀ·Q: along queries
    del q5
    k4 = _fp32_for_rounding(k.unsqueeze(2))
    k_d = ops.qk(k4, -1, forward_elem)
    k_t = ops.qk(k4, -2, forward_elem)  # dQ = dS·K: along keys
    del k4
    v_d = ops.pv(v.unsqueeze(2), -1, forward_elem)  # dP = dO·Vᵀ: along dv
    do5 = _fp32_for_rounding(_grouped(grad_out, kv_heads))
    do_d = ops.pv(do5, -1, grad_elem)
    do_t = ops.pv(do5, -2, grad_elem)  # dV = Pᵀ·dO: along queries
    delta = (do5 * _grouped(out, kv_heads).float()).sum(dim=-1, keepdim=True)
    del do5
    lse2 = _grouped(lse.unsqueeze(-1), kv_heads) * _LOG2E
    mask5 = _grouped_mask(attn_mask, batch, heads, kv_heads, q_len, k_len)
    # fp32 gradients in the sequence-major order the op returns, so that one chunk's are the
    # op's outputs as they are (fp32) or after one conversion.
    dq_out, dk, dv = (empty_sequence_major(t, tuple(t.shape), torch.float32).zero_() for t in (q, k, v))
    dq = _grouped(dq_out, kv_heads)  # a view: the tiles accumulate into dq_out
    for k_lo, q_lo in _tile_starts(q_len, k_len, key_tile, is_causal):
        k_hi = min(k_lo + key_tile, k_len)
        p = _tile_scores(q_d[..., q_lo:, :], k_d[..., k_lo:k_hi, :], mask5, is_causal, scale, q_lo, k_lo)
        p.sub_(lse2[..., q_lo:, :]).exp2_()  # normalized probabilities, in S's buffer
        # Pᵀ and dSᵀ along their contraction axis: P and dS along the queries, transposed.
        dv_tile = torch.matmul(ops.pv(p, -2, forward_elem).transpose(-1, -2), do_t[..., q_lo:, :])
        dv[:, :, k_lo:k_hi] = dv_tile.sum(dim=2)
        del dv_tile
        ds = torch.matmul(do_d[..., q_lo:, :], v_d[..., k_lo:k_hi, :].transpose(-1, -2))
        ds.sub_(delta[..., q_lo:, :]).mul_(p)
        del p
        dq[..., q_lo:, :] += torch.matmul(ops.qk(ds, -1, grad_elem), k_t[..., k_lo:k_hi, :])
        dk_tile = torch.matmul(ops.qk(ds, -2, grad_elem).transpose(-1, -2), q_t[..., q_lo:, :])
        del ds
        dk[:, :, k_lo:k_hi] = dk_tile.sum(dim=2)
        del dk_tile
    del q_d, q_t, k_d, k_t, v_d, do_d, do_t
    del dq
    return dq_out.mul_(scale).to(q.dtype), dk.mul_(scale).to(k.dtype), dv.to(v.dtype)
