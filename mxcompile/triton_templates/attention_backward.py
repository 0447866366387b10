"""MX flash attention backward (FlashAttention-2 split), with the semantics of the CPU op
`mxcompile::attention_backward` (`mxcompile.ops.attention_reference`, the definition): every GEMM
multiplies both operands in MX along its own contraction axis, in blocks of SCALE_BLOCK that
share an E8M0 scale, with fp32 accumulation:

    dV = Pᵀ·dO    P, dO along the queries     (P: forward format, dO: grad format)
    dP = dO·Vᵀ    dO, V along head_dim        (dO: grad format, V: forward format)
    dQ = dS·K     dS, K along the keys        (dS: grad format, K: forward format)
    dK = dSᵀ·Q    dS, Q along the queries     (dS: grad format, Q: forward format)

S = Q·Kᵀ is recomputed with Q, K along head_dim, and P = 2**(S·scale·log2(e) - lse·log2(e))
from the forward's saved logsumexp (natural log). dS = (dP - delta) ∘ P with delta =
rowsum(dO ∘ O), all in fp32. Mode "qk_only" keeps S, dQ, dK in MX and computes dV, dP from fp32
operands; "off" has no MX product.

Q, K, V and dO come quantized outside the kernels (`BackwardOperands`: Q and dO along head_dim
and along the queries, K along head_dim and along the keys, V along head_dim), so the kernels
load FP8 tiles and scales and expand them exactly to bf16 for bf16 MMAs; P and dS are rounded
to MX in registers, along the queries for dV and dK, along the keys for dQ.

Three kernels, no atomics:
  * `mx_attention_bwd_preprocess_kernel`: delta per query row.
  * `mx_attention_bwd_dkdv_kernel`: one program per (key tile, head); walks over the query
    tiles (causal: from the tile holding the key tile's first key on) and accumulates dK, dV.
  * `mx_attention_bwd_dq_kernel`: one program per (query tile, head); walks over the key tiles
    (causal: up to the diagonal) and accumulates dQ. It recomputes S, P and dP (the price of
    avoiding atomics).
Tiles are multiples of SCALE_BLOCK and start at multiples of it, so every quantization block
lies inside one tile. The op's torch implementation contracts each key tile's dK and dV over all
the queries in one product: with the dQ kernel's BLOCK_N equal to its key_tile and the dK/dV
kernel's BLOCK_M covering the queries, the kernels run its sums in its order, and under the
interpreter they are bit-for-bit the op (tests/triton_templates/test_attention_backward_kernel.py).

The kernels are `kernels/attention_backward.py`; this module holds their launcher and reference.
`tl.constexpr`s: FWD_ELEM, GRAD_ELEM, SCALE_MODE, CAUSAL, MX_QK, MX_PV, DOT, HEAD_DIM,
SCALE_BLOCK, BLOCK_M, BLOCK_N. Shapes: q, o, do (BH, S_q, D); k, v (BH, S_k, D); lse, delta
(BH, S_q); D a power of two >= 32; causal masking is top-left aligned, S_q == S_k.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from ..numerics.formats import elem_format
from ..numerics.formats import scale_mode_named
from ..numerics.quantize import dequantize_along, quantize_along
from .attention import LOG2E, aligned_scales, direct_fp8_cvt, dot_dtype
from .configs import (
    attention_backward_autotune_configs,
    autotuned,
    interpreter_attention_backward_config,
)
from .loader import kernel_module

ATTENTION_BACKWARD_MODES = ("both", "qk_only", "off")
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_PREPROCESS_BLOCK_M = 64


@dataclass(frozen=True)
class AttentionBackwardKey:
    """The constexpr specialisation of the MX attention backward kernels: the element format of
    P's rounding (`forward_elem`), of dS's (`grad_elem`), and the scale mode; validated on
    construction. (The formats of Q, K, V and dO come from their dtypes.)"""

    forward_elem: str = "e4m3"
    grad_elem: str = "e4m3"
    scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        elem_format(self.forward_elem, argument="forward_elem")
        elem_format(self.grad_elem, argument="grad_elem")
        scale_mode_named(self.scale_mode)

    def meta(self, kernel: str = "dkdv") -> dict[str, str]:
        """The constexpr meta-parameters of `kernel` ("dkdv" or "dq") for this specialisation
        (the dQ kernel rounds no P)."""
        meta = {"FWD_ELEM": elem_format(self.forward_elem).name} if kernel == "dkdv" else {}
        return {**meta, "GRAD_ELEM": elem_format(self.grad_elem).name,
                "SCALE_MODE": scale_mode_named(self.scale_mode).value}  # fmt: skip


@dataclass(frozen=True)
class Operand:
    """One operand tile source of the backward kernels: FP8 data with its uint8 E8M0 scales (an
    MX operand), or a high-precision tensor and no scales (a GEMM family out of MX)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def flat(self) -> Operand:
        """The operand as 3-D (heads, rows, cols) tensors, contiguous (the kernels' layout)."""
        scale = None if self.scale is None else _flat(self.scale)
        return Operand(_flat(self.data), scale)

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scales) as kernel arguments; the data stands in for absent scales (unread)."""
        return self.data, self.data if self.scale is None else aligned_scales(self.scale)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:]).contiguous()


@dataclass(frozen=True)
class BackwardOperands:
    """Q, K, V and dO as the backward's products read them, each quantized along the axis it is
    contracted over (`quantize_backward_operands` builds them): (..., S, D) data; scales
    (..., S, D/32) along head_dim, (..., ceil(S/32), D) along the sequence."""

    q: Operand  # along head_dim: S = Q·Kᵀ
    q_queries: Operand  # along the queries: dK = dSᵀ·Q
    k: Operand  # along head_dim: S = Q·Kᵀ
    k_keys: Operand  # along the keys: dQ = dS·K
    v: Operand  # along head_dim: dP = dO·Vᵀ
    do: Operand  # along head_dim: dP = dO·Vᵀ
    do_queries: Operand  # along the queries: dV = Pᵀ·dO

    def flat(self) -> BackwardOperands:
        return BackwardOperands(*(getattr(self, f.name).flat() for f in fields(self)))


def empty_operands(heads: int, s_q: int, s_k: int, head_dim: int, *, device: torch.device,
                   block_size: int = 32) -> BackwardOperands:  # fmt: skip
    """Uninitialised E4M3 operands of the given sizes (3-D), for compiling the kernels without
    data (meta tensors in the static report and the AOT tests)."""

    def operand(seq: int, along_seq: bool) -> Operand:
        scale = (-(-seq // block_size), head_dim) if along_seq else (seq, head_dim // block_size)
        return Operand(torch.empty(heads, seq, head_dim, dtype=torch.float8_e4m3fn, device=device),
                       torch.empty(heads, *scale, dtype=torch.uint8, device=device))  # fmt: skip

    return BackwardOperands(q=operand(s_q, False), q_queries=operand(s_q, True), k=operand(s_k, False),
                            k_keys=operand(s_k, True), v=operand(s_k, False), do=operand(s_q, False),
                            do_queries=operand(s_q, True))  # fmt: skip


# A quantizer: (tensor (..., S, D), axis, element format) -> (FP8 data, uint8 scales), blocks of 32.
Quantizer = Callable[[torch.Tensor, int, str], tuple[torch.Tensor, torch.Tensor]]


def quantize_backward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                               quantize: Quantizer, *, attention_mode: str, forward_elem: str,
                               grad_elem: str) -> BackwardOperands:  # fmt: skip
    """The operands of the backward for `attention_mode`: each tensor of an MX GEMM family
    quantized by `quantize` along the axis its products contract (the sequence is axis -2,
    head_dim -1), the others passed in high precision."""
    mx_qk, mx_pv = attention_mode in ("both", "qk_only"), attention_mode == "both"

    def operand(x: torch.Tensor, axis: int, elem: str, mx: bool) -> Operand:
        return Operand(*quantize(x, axis, elem)) if mx else Operand(x)

    return BackwardOperands(
        q=operand(q, -1, forward_elem, mx_qk), q_queries=operand(q, -2, forward_elem, mx_qk),
        k=operand(k, -1, forward_elem, mx_qk), k_keys=operand(k, -2, forward_elem, mx_qk),
        v=operand(v, -1, forward_elem, mx_pv),
        do=operand(grad_out, -1, grad_elem, mx_pv), do_queries=operand(grad_out, -2, grad_elem, mx_pv),
    )  # fmt: skip


@functools.cache
def _autotuned(name: str, block_size: int, head_dim: int) -> Any:
    configs = [
        c for c in attention_backward_autotune_configs(name, head_dim)
        if c.kwargs["BLOCK_M"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]  # fmt: skip
    module = kernel_module("attention_backward", interpret=False)
    kernel = getattr(module, f"mx_attention_bwd_{name}_kernel")
    specialisation = [*AttentionBackwardKey().meta(name), "CAUSAL", "MX_QK", "MX_PV", "DOT"]
    tune_key = ["S_Q", "S_K", "HEAD_DIM", *specialisation]
    return autotuned(kernel, configs, tune_key)


def mx_attention_backward_triton(
    operands: BackwardOperands,
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
    tiles: dict[str, int] | None = None,
    out_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.float32,) * 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX attention backward: (dq, dk, dv) in `out_dtypes`.

    operands: Q, K, V, dO quantized along each product's contraction axis
    (`quantize_backward_operands`, with MX exactly for the GEMM families of `attention_mode`:
    "both", "qk_only", "off"); out, grad_out (..., S_q, D) fp32/bf16/fp16 (delta = rowsum(dO ∘
    O)); lse (..., S_q) fp32, natural log, from `mx_attention_triton(..., return_lse=True)` or
    the CPU op. `tiles` ({"BLOCK_M", "BLOCK_N"}, used by both kernels) overrides autotuning."""
    from . import _check_tiles, _interpreting, _require

    if attention_mode not in ATTENTION_BACKWARD_MODES:
        accepted = list(ATTENTION_BACKWARD_MODES)
        raise ValueError(f"attention_mode={attention_mode!r} is not accepted; use one of {accepted}")
    mx = {"q": attention_mode != "off", "k": attention_mode != "off", "v": attention_mode == "both",
          "do": attention_mode == "both"}  # fmt: skip
    q, k = operands.q.data, operands.k.data
    lead, (s_q, d), s_k = q.shape[:-2], q.shape[-2:], k.shape[-2]
    blocks_q, blocks_k = -(-s_q // block_size), -(-s_k // block_size)
    expected = {
        "q": (q.shape, (*lead, s_q, d // block_size), mx["q"]),
        "q_queries": (q.shape, (*lead, blocks_q, d), mx["q"]),
        "k": ((*lead, s_k, d), (*lead, s_k, d // block_size), mx["k"]),
        "k_keys": ((*lead, s_k, d), (*lead, blocks_k, d), mx["k"]),
        "v": ((*lead, s_k, d), (*lead, s_k, d // block_size), mx["v"]),
        "do": (q.shape, (*lead, s_q, d // block_size), mx["do"]),
        "do_queries": (q.shape, (*lead, blocks_q, d), mx["do"]),
    }
    for name, (shape, scale_shape, is_mx) in expected.items():
        operand = getattr(operands, name)
        data, scale = operand.data, operand.scale
        dtypes = _FP8 if is_mx else _HIGH_PRECISION
        if tuple(data.shape) != tuple(shape) or data.dtype not in dtypes:
            raise ValueError(f"operands.{name}.data must be {shape} of {dtypes}, got {data.dtype} {tuple(data.shape)}")
        if is_mx and (scale is None or scale.dtype not in (torch.uint8, torch.float8_e8m0fnu)
                      or tuple(scale.shape) != tuple(scale_shape)):  # fmt: skip
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(f"operands.{name}.scale must be uint8 of shape {scale_shape}, got {got}")
        if not is_mx and scale is not None:
            raise ValueError(f"operands.{name}: attention_mode={attention_mode!r} reads it in high precision; pass no scale")
    for name, t in (("out", out), ("grad_out", grad_out)):
        if t.shape != q.shape or t.dtype not in _HIGH_PRECISION:
            raise ValueError(f"{name} must be fp32/bf16/fp16 of shape {tuple(q.shape)}, got {t.dtype} {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != (*lead, s_q):
        raise ValueError(f"lse must be fp32 of shape {(*lead, s_q)}")
    if block_size != 32:
        raise ValueError("MX attention takes the MX block of 32 (OCP MX): block_size=32")
    if d % block_size or d & (d - 1) or d < 32:
        raise ValueError(f"head_dim={d} must be a power of two >= 32")
    if causal and s_q != s_k:
        raise ValueError("causal=True needs S_q == S_k (top-left aligned mask)")
    _check_tiles(tiles, {"BLOCK_M": block_size, "BLOCK_N": block_size})
    key = AttentionBackwardKey(
        elem_format(forward_elem, argument="forward_elem").name,
        elem_format(grad_elem, argument="grad_elem").name,
        scale_mode_named(scale_mode).value,
    )
    _require(q.device, elem=key.forward_elem, block_size=block_size)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    dq, dk, dv = attention_backward_launch(
        operands.flat(), _flat(out), _flat(grad_out), lse.reshape(-1, s_q).contiguous(), key=key,
        sm_scale=float(sm_scale), causal=causal, mx_qk=mx["q"], mx_pv=mx["v"], block_size=block_size,
        tiles=tiles, interpret=_interpreting(), out_dtypes=out_dtypes,
    )  # fmt: skip
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(k.shape)


def attention_backward_launch(
    operands: BackwardOperands,
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
    out_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.float32,) * 3,
    wrap: Any = None,
    capability: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin launcher on 3-D (heads, rows, cols) contiguous operands and lse (heads, rows); no
    validation (see mx_attention_backward_triton). Three launches: delta, dK/dV, dQ.
    capability: the compile target's, when compiling ahead of time (`direct_fp8_cvt`)."""
    import triton

    heads, s_q, d = operands.q.data.shape
    s_k = operands.k.data.shape[1]
    device = operands.q.data.device
    dq, dk, dv = (torch.empty((heads, n, d), dtype=dtype, device=device)
                  for n, dtype in zip((s_q, s_k, s_k), out_dtypes))  # fmt: skip
    if heads == 0 or s_q == 0 or s_k == 0:  # Triton rejects an empty grid
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((heads, s_q), dtype=torch.float32, device=device)
    module = kernel_module("attention_backward", interpret=interpret)

    def launcher(kernel: Any) -> Any:
        return wrap(kernel) if wrap is not None else kernel

    launcher(module.mx_attention_bwd_preprocess_kernel)[
        (triton.cdiv(s_q, _PREPROCESS_BLOCK_M), heads)
    ](
        out, grad_out, delta, s_q, *out.stride(), *grad_out.stride(), *delta.stride(),
        HEAD_DIM=d, BLOCK_M=_PREPROCESS_BLOCK_M,
    )  # fmt: skip
    o = operands
    pointers = {
        "dkdv": (*o.q.pointers(), *o.q_queries.pointers(), *o.k.pointers(), *o.v.pointers(),
                 *o.do.pointers(), *o.do_queries.pointers(), lse, delta, dk, dv),
        "dq": (*o.q.pointers(), *o.k.pointers(), *o.k_keys.pointers(), *o.v.pointers(), *o.do.pointers(),
               lse, delta, dq),
    }  # fmt: skip
    for name, grid_len in (("dkdv", s_k), ("dq", s_q)):
        meta: dict[str, Any] = {
            **key.meta(name), "CAUSAL": causal, "MX_QK": mx_qk, "MX_PV": mx_pv, "DOT": dot_dtype(interpret),
            "FP8_CVT_BF16": direct_fp8_cvt(device, capability), "HEAD_DIM": d, "SCALE_BLOCK": block_size,
        }  # fmt: skip
        if tiles is None and not interpret:
            kernel = _autotuned(name, block_size, d)
        else:
            kernel = getattr(module, f"mx_attention_bwd_{name}_kernel")
            meta.update(tiles or interpreter_attention_backward_config())
        tile = "BLOCK_N" if name == "dkdv" else "BLOCK_M"

        def grid(m: dict[str, Any], n: int = grid_len, t: str = tile) -> tuple[int, int]:
            return (triton.cdiv(n, m[t]), heads)

        launcher(kernel)[grid](*pointers[name], s_q, s_k, sm_scale, sm_scale * LOG2E, **meta)
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
