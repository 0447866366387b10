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
each tile along the contraction axis of the product it feeds, with the helpers of `common.py`
(the restatement of `mxcompile.numerics`). Tiles are multiples of SCALE_BLOCK and start at
multiples of it, so every quantization block lies inside one tile and the result does not
depend on the tile sizes beyond the fp32 summation order (unlike the forward, whose P is
quantized relative to a running maximum). A ragged query length is zero-padded to a block
(padded rows have Q = dO = 0 and P = 0).

Template parameters: forward and grad element formats, scale mode, cast.
`tl.constexpr`s: CAUSAL, MX_QK, MX_PV, HEAD_DIM, SCALE_BLOCK, BLOCK_M, BLOCK_N.
Shapes: q, o, do (BH, S_q, D); k, v (BH, S_k, D); lse, delta (BH, S_q). S_k and D are
multiples of SCALE_BLOCK (D a power of two); causal masking is top-left aligned, S_q == S_k.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from ..numerics.formats import elem_format
from ..numerics.formats import scale_mode as scale_mode_named
from ..numerics.quantize import dequantize_along, quantize_along
from .common import DOT_SCALED_FORMATS, MODULE_HEADER, TRITON_FP8_TYPES, render_mx_helpers
from .configs import attention_backward_autotune_configs, interpreter_attention_backward_config
from .render import load_source, render

ATTENTION_BACKWARD_MODES = ("both", "qk_only", "off")
_LOG2E = math.log2(math.e)
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_PREPROCESS_BLOCK_M = 64


@dataclass(frozen=True)
class AttentionBackwardKey:
    """Specialisation key of the rendered MX attention backward kernels: the element format of
    Q, K, V and P (`forward_elem`), of dO and dS (`grad_elem`), the scale mode and the cast."""

    forward_elem: str = "e4m3"
    grad_elem: str = "e4m3"
    scale_mode: str = "rceil"
    cast: str = "software"


# Operand helpers, rendered once per element format (suffix _fwd / _grad) on top of that
# format's `_mx_quantize_blocks`.
_OPERANDS = """\
@triton.jit
def _mx_lhs${sfx}(x, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    \"\"\"fp32 x (ROWS, COLS) as a left dot_scaled operand, in MX along COLS (its contraction
    axis): FP8 data (ROWS, COLS) and uint8 scales (ROWS, COLS // SCALE_BLOCK).\"\"\"
    blocks = tl.reshape(x, (ROWS, COLS // SCALE_BLOCK, SCALE_BLOCK))
    data, scale = _mx_quantize_blocks${sfx}(blocks, 2)
    return tl.reshape(data, (ROWS, COLS)).to(${fp8_type}, bitcast=True), scale


@triton.jit
def _mx_rhs${sfx}(x, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    \"\"\"fp32 x (ROWS, COLS) as a right dot_scaled operand, in MX along ROWS (its contraction
    axis): FP8 data (ROWS, COLS) and uint8 scales (COLS, ROWS // SCALE_BLOCK), the layout
    dot_scaled wants.\"\"\"
    blocks = tl.reshape(x, (ROWS // SCALE_BLOCK, SCALE_BLOCK, COLS))
    data, scale = _mx_quantize_blocks${sfx}(blocks, 1)
    return tl.reshape(data, (ROWS, COLS)).to(${fp8_type}, bitcast=True), tl.trans(scale)
"""

_KERNELS = """\
@triton.jit
def mx_attention_bwd_preprocess_kernel(
    # Pointers: the forward output O and its gradient dO; delta (fp32, one per query row).
    o_ptr, do_ptr, delta_ptr,
    # Sizes
    S_Q,
    # Strides (elements): head, row, column; head, row of delta
    stride_oh, stride_om, stride_od, stride_doh, stride_dom, stride_dod, stride_eh, stride_em,
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # delta = rowsum(dO * O) in fp32, the D of dS = P * (dP - D).
    pid_m = tl.program_id(axis=0).to(tl.int64)
    head = tl.program_id(axis=1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < S_Q
    o = tl.load(
        o_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        mask=mask_m[:, None], other=0.0,
    ).to(tl.float32)
    do = tl.load(
        do_ptr + head * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
        mask=mask_m[:, None], other=0.0,
    ).to(tl.float32)
    delta = tl.reduce(o * do, 1, _mx_sum_combine_fwd)
    tl.store(delta_ptr + head * stride_eh + offs_m * stride_em, delta, mask=mask_m)


@triton.jit
def mx_attention_bwd_dkdv_kernel(
    # Pointers: Q, K, V, dO (high precision, quantized here); logsumexp and delta (fp32, one
    # per query row); the outputs dK, dV.
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    # Sizes; the softmax scale, and the same times log2(e) (S in base-2 units)
    S_Q, S_K, sm_scale, qk_scale,
    # Strides (elements): head, row, column of each tensor; head, row of lse and delta
    stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd, stride_doh, stride_dom, stride_dod,
    stride_lh, stride_lm, stride_eh, stride_em,
    stride_dkh, stride_dkn, stride_dkd, stride_dvh, stride_dvn, stride_dvd,
    # Meta-parameters
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dK = dS^T Q in MX (else fp32 operands)
    MX_PV: tl.constexpr,  # dV = P^T dO and dP = dO V^T in MX (else fp32 operands)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per program, a multiple of SCALE_BLOCK
):
    # Phase 1: this program's key tile and head; 64-bit offsets.
    pid_n = tl.program_id(axis=0).to(tl.int64)
    head = tl.program_id(axis=1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < S_K

    # Phase 2: load K and V once; both along head_dim, the contraction axis of
    # S^T = K Q^T and dP^T = V dO^T (the transposed products keep keys as rows).
    k = tl.load(
        k_ptr + head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=mask_n[:, None], other=0.0,
    ).to(tl.float32)
    v = tl.load(
        v_ptr + head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=mask_n[:, None], other=0.0,
    ).to(tl.float32)
    if MX_QK:
        k_data, k_scale = _mx_lhs_fwd(k, BLOCK_N, HEAD_DIM, SCALE_BLOCK)
    if MX_PV:
        v_data, v_scale = _mx_lhs_fwd(v, BLOCK_N, HEAD_DIM, SCALE_BLOCK)
    dk = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)

    # Phase 3: walk over the query tiles that see these keys (causal: from the tile holding
    # the first key's query on; earlier queries attend to none of them).
    if CAUSAL:
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for m0 in range(lo, S_Q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < S_Q
        q = tl.load(
            q_ptr + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=mask_m[:, None], other=0.0,
        ).to(tl.float32)
        do = tl.load(
            do_ptr + head * stride_doh + offs_m[:, None] * stride_dom
            + offs_d[None, :] * stride_dod,
            mask=mask_m[:, None], other=0.0,
        ).to(tl.float32)
        lse2 = tl.load(lse_ptr + head * stride_lh + offs_m * stride_lm, mask=mask_m, other=0.0)
        lse2 = lse2 * 1.4426950408889634
        delta = tl.load(delta_ptr + head * stride_eh + offs_m * stride_em, mask=mask_m, other=0.0)
        # S^T = K Q^T (keys x queries): Q^T along head_dim.
        if MX_QK:
            qt_data, qt_scale = _mx_rhs_fwd(tl.trans(q), HEAD_DIM, BLOCK_M, SCALE_BLOCK)
            s_t = tl.dot_scaled(k_data, k_scale, "${f}", qt_data, qt_scale, "${f}")
        else:
            s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
        # P^T from the saved logsumexp (normalized); exactly 0 outside the valid entries.
        valid = mask_n[:, None] & mask_m[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
        if MX_PV:
            # dV += P^T dO: P^T and dO along the queries.
            p_data, p_scale = _mx_lhs_fwd(p_t, BLOCK_N, BLOCK_M, SCALE_BLOCK)
            do_data, do_scale = _mx_rhs_grad(do, BLOCK_M, HEAD_DIM, SCALE_BLOCK)
            dv = tl.dot_scaled(p_data, p_scale, "${f}", do_data, do_scale, "${g}", dv)
            # dP^T = V dO^T: dO^T along head_dim.
            dot_data, dot_scale = _mx_rhs_grad(tl.trans(do), HEAD_DIM, BLOCK_M, SCALE_BLOCK)
            dp_t = tl.dot_scaled(v_data, v_scale, "${f}", dot_data, dot_scale, "${g}")
        else:
            dv = tl.dot(p_t, do, dv, input_precision="ieee")
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        # dS^T = P^T (dP^T - delta), fp32.
        ds_t = (dp_t - delta[None, :]) * p_t
        # dK += dS^T Q: dS^T and Q along the queries.
        if MX_QK:
            ds_data, ds_scale = _mx_lhs_grad(ds_t, BLOCK_N, BLOCK_M, SCALE_BLOCK)
            q_data, q_scale = _mx_rhs_fwd(q, BLOCK_M, HEAD_DIM, SCALE_BLOCK)
            dk = tl.dot_scaled(ds_data, ds_scale, "${g}", q_data, q_scale, "${f}", dk)
        else:
            dk = tl.dot(ds_t, q, dk, input_precision="ieee")

    # Phase 4: store dK (times the softmax scale) and dV.
    dk_ptrs = (
        dk_ptr + head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    )
    tl.store(dk_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask_n[:, None])
    dv_ptrs = (
        dv_ptr + head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    )
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=mask_n[:, None])


@triton.jit
def mx_attention_bwd_dq_kernel(
    # Pointers: Q, K, V, dO (high precision, quantized here); logsumexp and delta (fp32, one
    # per query row); the output dQ.
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    # Sizes; the softmax scale, and the same times log2(e) (S in base-2 units)
    S_Q, S_K, sm_scale, qk_scale,
    # Strides (elements): head, row, column of each tensor; head, row of lse and delta
    stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd, stride_doh, stride_dom, stride_dod,
    stride_lh, stride_lm, stride_eh, stride_em,
    stride_dqh, stride_dqm, stride_dqd,
    # Meta-parameters
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dQ = dS K in MX (else fp32 operands)
    MX_PV: tl.constexpr,  # dP = dO V^T in MX (else fp32 operands)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per step, a multiple of SCALE_BLOCK
):
    # Phase 1: this program's query tile and head; 64-bit offsets.
    pid_m = tl.program_id(axis=0).to(tl.int64)
    head = tl.program_id(axis=1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < S_Q

    # Phase 2: load Q, dO and the row statistics once; Q and dO along head_dim, the
    # contraction axis of S = Q K^T and dP = dO V^T.
    q = tl.load(
        q_ptr + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None], other=0.0,
    ).to(tl.float32)
    do = tl.load(
        do_ptr + head * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
        mask=mask_m[:, None], other=0.0,
    ).to(tl.float32)
    lse2 = tl.load(lse_ptr + head * stride_lh + offs_m * stride_lm, mask=mask_m, other=0.0)
    lse2 = lse2 * 1.4426950408889634
    delta = tl.load(delta_ptr + head * stride_eh + offs_m * stride_em, mask=mask_m, other=0.0)
    if MX_QK:
        q_data, q_scale = _mx_lhs_fwd(q, BLOCK_M, HEAD_DIM, SCALE_BLOCK)
    if MX_PV:
        do_data, do_scale = _mx_lhs_grad(do, BLOCK_M, HEAD_DIM, SCALE_BLOCK)
    dq = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)

    # Phase 3: walk over the key tiles these queries see (causal: up to the diagonal).
    if CAUSAL:
        hi = tl.minimum(S_K, (pid_m + 1) * BLOCK_M)
    else:
        hi = S_K
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < S_K
        k = tl.load(
            k_ptr + head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=mask_n[:, None], other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=mask_n[:, None], other=0.0,
        ).to(tl.float32)
        # S = Q K^T: K^T along head_dim.
        if MX_QK:
            kt_data, kt_scale = _mx_rhs_fwd(tl.trans(k), HEAD_DIM, BLOCK_N, SCALE_BLOCK)
            s = tl.dot_scaled(q_data, q_scale, "${f}", kt_data, kt_scale, "${f}")
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        # dP = dO V^T: V^T along head_dim.
        if MX_PV:
            vt_data, vt_scale = _mx_rhs_fwd(tl.trans(v), HEAD_DIM, BLOCK_N, SCALE_BLOCK)
            dp = tl.dot_scaled(do_data, do_scale, "${g}", vt_data, vt_scale, "${f}")
        else:
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = (dp - delta[:, None]) * p
        # dQ += dS K: dS and K along the keys.
        if MX_QK:
            ds_data, ds_scale = _mx_lhs_grad(ds, BLOCK_M, BLOCK_N, SCALE_BLOCK)
            kn_data, kn_scale = _mx_rhs_fwd(k, BLOCK_N, HEAD_DIM, SCALE_BLOCK)
            dq = tl.dot_scaled(ds_data, ds_scale, "${g}", kn_data, kn_scale, "${f}", dq)
        else:
            dq = tl.dot(ds, k, dq, input_precision="ieee")

    # Phase 4: store dQ (times the softmax scale).
    dq_ptrs = (
        dq_ptr + head * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_m[:, None])
"""


@functools.cache
def mx_attention_backward_kernel_source(key: AttentionBackwardKey) -> str:
    """The rendered Triton source of the MX attention backward kernels for `key`."""
    mode = scale_mode_named(key.scale_mode)
    parts = [render(MODULE_HEADER, key=repr(key))]
    for elem, sfx in ((key.forward_elem, "_fwd"), (key.grad_elem, "_grad")):
        fmt = elem_format(elem)
        parts.append(render_mx_helpers(fmt, mode, key.cast, suffix=sfx))
        parts.append(render(_OPERANDS, sfx=sfx, fp8_type=TRITON_FP8_TYPES[fmt.name]))
    f = DOT_SCALED_FORMATS[elem_format(key.forward_elem).name]
    g = DOT_SCALED_FORMATS[elem_format(key.grad_elem).name]
    parts.append(render(_KERNELS, f=f, g=g))
    return "\n\n".join(parts)


def mx_attention_backward_module(
    key: AttentionBackwardKey, *, interpret: bool | None = None
) -> ModuleType:
    source = mx_attention_backward_kernel_source(key)
    return load_source(source, "mx_attention_bwd", interpret=interpret)


@functools.cache
def _autotuned(key: AttentionBackwardKey, name: str, block_size: int) -> Any:
    import triton

    configs = [
        c for c in attention_backward_autotune_configs(name)
        if c.kwargs["BLOCK_M"] % block_size == 0 and c.kwargs["BLOCK_N"] % block_size == 0
    ]  # fmt: skip
    module = mx_attention_backward_module(key, interpret=False)
    kernel = getattr(module, f"mx_attention_bwd_{name}_kernel")
    tune_key = ["S_Q", "S_K", "HEAD_DIM", "CAUSAL", "MX_QK", "MX_PV"]
    return triton.autotune(configs=configs, key=tune_key)(kernel)


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
    mode: str = "both",
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
    op. `mode`: "both", "qk_only", "off" (see the module docstring). `tiles` ({"BLOCK_M",
    "BLOCK_N"}, used by both kernels) overrides autotuning."""
    from . import _check_tiles, _interpreting, _require

    if mode not in ATTENTION_BACKWARD_MODES:
        accepted = list(ATTENTION_BACKWARD_MODES)
        raise ValueError(f"mode={mode!r} is not accepted; use one of {accepted}")
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
        sm_scale=float(sm_scale), causal=causal, mx_qk=mode in ("both", "qk_only"),
        mx_pv=mode == "both", block_size=block_size, tiles=tiles, interpret=_interpreting(),
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
    module = mx_attention_backward_module(key, interpret=interpret)

    def launcher(kernel: Any) -> Any:
        return wrap(kernel) if wrap is not None else kernel

    launcher(module.mx_attention_bwd_preprocess_kernel)[
        (triton.cdiv(s_q, _PREPROCESS_BLOCK_M), heads)
    ](
        out, grad_out, delta, s_q, *out.stride(), *grad_out.stride(), *delta.stride(),
        HEAD_DIM=d, BLOCK_M=_PREPROCESS_BLOCK_M,
    )  # fmt: skip
    meta: dict[str, Any] = {
        "CAUSAL": causal, "MX_QK": mx_qk, "MX_PV": mx_pv, "HEAD_DIM": d, "SCALE_BLOCK": block_size,
    }  # fmt: skip
    common = (
        s_q, s_k, sm_scale, sm_scale * _LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *lse.stride(), *delta.stride(),
    )  # fmt: skip
    for name, grid_len, outputs in (("dkdv", s_k, (dk, dv)), ("dq", s_q, (dq,))):
        kernel_meta = dict(meta)
        if tiles is None and not interpret:
            kernel = _autotuned(key, name, block_size)
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


def _mx(x: torch.Tensor, axis: int, elem: str, mode: str) -> torch.Tensor:
    """x in MX along axis (blocks of 32), dequantized exactly to fp32: what a product sees."""
    axis = axis % x.ndim
    data, scale = quantize_along(x, axis, elem_format(elem), scale_mode_named(mode), 32)
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
    mode="both",
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
    lse2 = F.pad(lse.float(), (0, pad), value=float("inf")).unsqueeze(-1) * _LOG2E
    kf, vf = k.float(), v.float()
    mx_qk, mx_pv = mode in ("both", "qk_only"), mode == "both"

    def qk(x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        return _mx(x, axis, elem, scale_mode) if mx_qk else x

    def pv(x: torch.Tensor, axis: int, elem: str) -> torch.Tensor:
        return _mx(x, axis, elem, scale_mode) if mx_pv else x

    delta = (dof * of).sum(dim=-1, keepdim=True)
    s2 = qk(qf, -1, forward_elem) @ qk(kf, -1, forward_elem).transpose(-1, -2)
    s2 = s2 * (sm_scale * _LOG2E)
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
