"""MX flash attention backward (FlashAttention-2 style), with the semantics of the CPU op
`mxcompile::attention_backward` (mxcompile/attention.py): every GEMM quantizes both operands
along its own contraction axis, in blocks of SCALE_BLOCK that share an E8M0 scale, and
multiplies them with `tl.dot_scaled` (fp32 accumulation):

    dV = Pᵀ·dO    P, dO along the queries     (P: forward format, dO: grad format)
    dP = dO·Vᵀ    dO, V along head_dim        (dO: grad format, V: forward format)
    dQ = dS·K     dS, K along the keys        (dS: grad format, K: forward format)
    dK = dSᵀ·Q    dS, Q along the queries     (dS: grad format, Q: forward format)

S = Q·Kᵀ is recomputed with Q, K along head_dim, and P = 2**(S·scale·log2(e) - lse·log2(e))
from the forward's saved logsumexp (natural log; `mx_attention_triton(..., return_lse=True)`
writes it). dS = P ∘ (dP - delta) with delta = rowsum(dO ∘ O), all in fp32. Mode "qk_only"
keeps S, dQ, dK in MX and computes dV, dP from fp32 operands; "off" has no MX product.

Three kernels, no atomics:
  * `mx_attention_bwd_preprocess_kernel`: delta per query row.
  * `mx_attention_bwd_dkdv_kernel`: one program per (key tile, head); walks over the query
    tiles (causal: from the tile holding the key tile's first key on) and accumulates dK, dV.
  * `mx_attention_bwd_dq_kernel`: one program per (query tile, head); walks over the key tiles
    (causal: up to the diagonal) and accumulates dQ. It recomputes S, P and dP (the price of
    avoiding atomics).
Q, K, V and dO come in high precision (fp32, bf16 or fp16) and are quantized in the kernels,
each tile along the contraction axis of the product it feeds, with the helpers of
`kernels/mx_tile.py` (the restatement of `mxcompile.numerics`). Tiles are multiples of SCALE_BLOCK and start at
multiples of it, so every quantization block lies inside one tile and the result does not
depend on the tile sizes beyond the fp32 summation order (unlike the forward, whose P is
quantized relative to a running maximum). A ragged query length is zero-padded to a block
(padded rows have Q = dO = 0 and P = 0).

The kernels are `kernels/attention_backward.py`; this module holds their launcher and reference.
`tl.constexpr`s: FWD_ELEM, GRAD_ELEM, SCALE_MODE, CAST, CAUSAL, MX_QK, MX_PV, HEAD_DIM,
SCALE_BLOCK, BLOCK_M, BLOCK_N.
Shapes: q, o, do (BH, S_q, D); k, v (BH, S_k, D); lse, delta (BH, S_q). S_k and D are
multiples of SCALE_BLOCK (D a power of two); causal masking is top-left aligned, S_q == S_k.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..numerics.formats import elem_format
from ..numerics.formats import scale_mode_named
from ..numerics.quantize import dequantize_along, quantize_along
from .attention import LOG2E
from .common import check_cast
from .configs import (
    attention_backward_autotune_configs,
    autotuned,
    interpreter_attention_backward_config,
)
from .loader import kernel_module

ATTENTION_BACKWARD_MODES = ("both", "qk_only", "off")
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_PREPROCESS_BLOCK_M = 64


@dataclass(frozen=True)
class AttentionBackwardKey:
    """The constexpr specialisation of the MX attention backward kernels: the element format of
    Q, K, V and P (`forward_elem`), of dO and dS (`grad_elem`), the scale mode and the cast;
    validated on construction."""

    forward_elem: str = "e4m3"
    grad_elem: str = "e4m3"
    scale_mode: str = "rceil"
    cast: str = "software"

    def __post_init__(self) -> None:
        elem_format(self.forward_elem, argument="forward_elem")
        elem_format(self.grad_elem, argument="grad_elem")
        scale_mode_named(self.scale_mode)
        check_cast(self.cast)

    def meta(self) -> dict[str, str]:
        """The kernels' constexpr meta-parameters for this specialisation."""
        return {
            "FWD_ELEM": elem_format(self.forward_elem).name,
            "GRAD_ELEM": elem_format(self.grad_elem).name,
            "SCALE_MODE": scale_mode_named(self.scale_mode).value,
            "CAST": self.cast,
        }


@functools.cache
def _autotuned(name: str, block_size: int) -> Any:
    configs = [
        c for c in attention_backward_autotune_configs(name)
        if c.kwargs["BLOCK_M"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]  # fmt: skip
    module = kernel_module("attention_backward", interpret=False)
    kernel = getattr(module, f"mx_attention_bwd_{name}_kernel")
    specialisation = [*AttentionBackwardKey().meta(), "CAUSAL", "MX_QK", "MX_PV"]
    tune_key = ["S_Q", "S_K", "HEAD_DIM", *specialisation]
    return autotuned(kernel, configs, tune_key)


def mx_attention_backward_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    attention_mode: str = "both",
    forward_elem: str = "e4m3",
    grad_elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = 32,
    cast: str = "software",
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX attention backward: (dq, dk, dv) in the dtypes of q, k, v.

    q, out, grad_out (..., S_q, D); k, v (..., S_k, D), all fp32/bf16/fp16 (the unquantized
    values: the kernels quantize each operand along the axis each product needs); lse
    (..., S_q) fp32, natural log, from `mx_attention_triton(..., return_lse=True)` or the CPU
    op. `attention_mode`: "both", "qk_only", "off" (see the module docstring). `tiles` ({"BLOCK_M",
    "BLOCK_N"}, used by both kernels) overrides autotuning."""
    from . import _check_tiles, _interpreting, _require

    if attention_mode not in ATTENTION_BACKWARD_MODES:
        accepted = list(ATTENTION_BACKWARD_MODES)
        raise ValueError(f"attention_mode={attention_mode!r} is not accepted; use one of {accepted}")
    tensors = {"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _HIGH_PRECISION or t.ndim < 2:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a fp32/bf16/fp16 tensor with >= 2 dims, got {got}")
    lead = q.shape[:-2]
    s_q, d = q.shape[-2:]
    s_k = k.shape[-2]
    if (
        k.shape != (*lead, s_k, d) or v.shape != k.shape
        or out.shape != q.shape or grad_out.shape != q.shape
    ):  # fmt: skip
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())
        raise ValueError(f"shapes disagree: {shapes}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != (*lead, s_q):
        raise ValueError(f"lse must be fp32 of shape {(*lead, s_q)}")
    for name, t in {**tensors, "lse": lse}.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if block_size != 32:
        raise ValueError("MX attention uses tl.dot_scaled, whose MX group is 32: block_size=32")
    if d % block_size or d & (d - 1) or d < 32:
        raise ValueError(f"head_dim={d} must be a power of two >= 32")
    if s_k % block_size:
        raise ValueError(f"S_k={s_k} must be a multiple of block_size={block_size}")
    if causal and s_q != s_k:
        raise ValueError("causal=True needs S_q == S_k (top-left aligned mask)")
    _check_tiles(tiles, {"BLOCK_M": block_size, "BLOCK_N": block_size})
    key = AttentionBackwardKey(
        elem_format(forward_elem, argument="forward_elem").name,
        elem_format(grad_elem, argument="grad_elem").name,
        scale_mode_named(scale_mode).value,
        cast,
    )
    _require(q.device, elem=key.forward_elem, block_size=block_size)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[-2:])

    dq, dk, dv = attention_backward_launch(
        flat(q), flat(k), flat(v), flat(out), flat(grad_out), lse.reshape(-1, s_q), key=key,
        sm_scale=float(sm_scale), causal=causal, mx_qk=attention_mode in ("both", "qk_only"),
        mx_pv=attention_mode == "both", block_size=block_size, tiles=tiles, interpret=_interpreting(),
    )  # fmt: skip
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def attention_backward_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    key: AttentionBackwardKey,
    sm_scale: float,
    causal: bool,
    mx_qk: bool,
    mx_pv: bool,
    block_size: int,
    tiles: dict[str, int] | None,
    interpret: bool,
    wrap: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin launcher on 3-D (heads, rows, cols) tensors and lse (heads, rows); no validation
    (see mx_attention_backward_triton). Three launches: delta, dK/dV, dQ."""
    import triton

    heads, s_q, d = q.shape
    s_k = k.shape[1]
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if heads == 0 or s_q == 0 or s_k == 0:  # Triton rejects an empty grid
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((heads, s_q), dtype=torch.float32, device=q.device)
    module = kernel_module("attention_backward", interpret=interpret)

    def launcher(kernel: Any) -> Any:
        return wrap(kernel) if wrap is not None else kernel

    launcher(module.mx_attention_bwd_preprocess_kernel)[
        (triton.cdiv(s_q, _PREPROCESS_BLOCK_M), heads)
    ](
        out, grad_out, delta, s_q, *out.stride(), *grad_out.stride(), *delta.stride(),
        HEAD_DIM=d, BLOCK_M=_PREPROCESS_BLOCK_M,
    )  # fmt: skip
    meta: dict[str, Any] = {
        **key.meta(), "CAUSAL": causal, "MX_QK": mx_qk, "MX_PV": mx_pv, "HEAD_DIM": d,
        "SCALE_BLOCK": block_size,
    }  # fmt: skip
    common = (
        s_q, s_k, sm_scale, sm_scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *lse.stride(), *delta.stride(),
    )  # fmt: skip
    for name, grid_len, outputs in (("dkdv", s_k, (dk, dv)), ("dq", s_q, (dq,))):
        kernel_meta = dict(meta)
        if tiles is None and not interpret:
            kernel = _autotuned(name, block_size)
        else:
            kernel = getattr(module, f"mx_attention_bwd_{name}_kernel")
            kernel_meta.update(tiles or interpreter_attention_backward_config())
        tile = "BLOCK_N" if name == "dkdv" else "BLOCK_M"

        def grid(m: dict[str, Any], n: int = grid_len, t: str = tile) -> tuple[int, int]:
            return (triton.cdiv(n, m[t]), heads)

        strides = [s for o in outputs for s in o.stride()]
        launcher(kernel)[grid](
            q, k, v, grad_out, lse, delta, *outputs, *common, *strides, **kernel_meta
        )
    return dq, dk, dv


def _mx(x: torch.Tensor, axis: int, elem: str, scale_mode: str) -> torch.Tensor:
    """x in MX along axis (blocks of 32), dequantized exactly to fp32: what a product sees."""
    axis = axis % x.ndim
    data, scale = quantize_along(x, axis, elem_format(elem), scale_mode_named(scale_mode), 32)
    return dequantize_along(data, scale, axis, 32, torch.float32)


def mx_attention_backward_reference(
    q,
    k,
    v,
    out,
    grad_out,
    lse,
    *,
    sm_scale=None,
    causal=False,
    attention_mode="both",
    forward_elem="e4m3",
    grad_elem="e4m3",
    scale_mode="rceil",
):  # type: ignore[no-untyped-def]
    """The kernels' algorithm in torch on whole (..., S, D) tensors, with the numerics core's
    quantizer (block 32). Tile-faithful: every quantization block of the kernels lies inside
    one tile, so their tiling changes only the fp32 summation order. A ragged query length is
    zero-padded to a multiple of 32 (Q = dO = 0, lse = +inf, so P = 0 there)."""
    s_q, d = q.shape[-2:]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    pad = (-s_q) % 32
    qf, of, dof = (F.pad(t.float(), (0, 0, 0, pad)) for t in (q, out, grad_out))
    lse2 = F.pad(lse.float(), (0, pad), value=float("inf")).unsqueeze(-1) * LOG2E
    kf, vf = k.float(), v.float()
    mx_qk, mx_pv = attention_mode in ("both", "qk_only"), attention_mode == "both"

    def qk(x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        return _mx(x, axis, elem, scale_mode) if mx_qk else x

    def pv(x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        return _mx(x, axis, elem, scale_mode) if mx_pv else x

    delta = (dof * of).sum(dim=-1, keepdim=True)
    s2 = qk(qf, -1, forward_elem) @ qk(kf, -1, forward_elem).transpose(-1, -2)
    s2 = s2 * (sm_scale * LOG2E)
    if causal:
        rows, cols = s2.shape[-2:]
        above = torch.ones(rows, cols, dtype=torch.bool, device=s2.device).triu(1)
        s2 = s2.masked_fill(above, float("-inf"))
    p = torch.exp2(s2 - lse2)
    dv = pv(p.transpose(-1, -2), -1, forward_elem) @ pv(dof, -2, grad_elem)
    dp = pv(dof, -1, grad_elem) @ pv(vf, -1, forward_elem).transpose(-1, -2)
    ds = (dp - delta) * p
    dq = qk(ds, -1, grad_elem) @ qk(kf, -2, forward_elem)
    dk = qk(ds.transpose(-1, -2), -1, grad_elem) @ qk(qf, -2, forward_elem)
    dq = (dq * sm_scale)[..., :s_q, :]
    return dq.to(q.dtype), (dk * sm_scale).to(k.dtype), dv.to(v.dtype)
