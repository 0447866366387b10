"""MX flash attention forward: S = Q K^T with Q and K in MX along head_dim, an online softmax in
fp32, and O = P V with P and V in MX along the key axis (each block of SCALE_BLOCK consecutive
keys shares a scale), with the semantics of the CPU op `mxcompile::attention`
(`mxcompile.ops.attention_reference`, the definition).

Q, K and V come quantized (FP8 data and E8M0 scales, by the quantize kernel in the CUDA op),
each along the axis its product contracts: the kernel quantizes no operand. It loads FP8 tiles
(half the bytes of bf16) and expands them exactly to bf16 (an FP8 value times a power-of-two
scale; `kernels/mx_tile.load_mx_tile` states the underflow edge) for bf16 MMAs with fp32
accumulation: Hopper has no MX tensor cores, and this is exact.

P is rounded to MX in registers, per key tile, relative to the running row maximum, with the
algorithm of the CPU op: scores in base-2 units (S * sm_scale * log2(e)), the running maximum
kept as an integer exponent m = ceil(row max), so the unnormalized P = 2**(S - m) of a tile has
its largest value in (1/2, 1] and every rescale of the accumulator is an exact power of two.
MX rounding commutes with power-of-two scaling, so the result does not depend on BLOCK_N beyond
fp32 rounding. The softmax denominator sums the unrounded fp32 P. With BLOCK_N equal to the CPU
op's key_tile the kernel runs the op's sums in its order: under the interpreter it is bit-for-bit
the op (tests/triton_templates/test_attention_kernel.py).

The kernel is `kernels/attention.py`; this module holds its launcher and `mx_attention_reference`
(the kernel's algorithm on FP8 inputs in torch, for the GPU checks of `benchmarks/gpu_kernels.py`).
`tl.constexpr`s: P_ELEM, SCALE_MODE, CAUSAL, STORE_LSE, DOT, HEAD_DIM, SCALE_BLOCK, BLOCK_M,
BLOCK_N. Shapes: q (BH, S_q, D), k and v (BH, S_k, D); scales q (BH, S_q, D/bs), k (BH, S_k,
D/bs), v (BH, ceil(S_k/bs), D). Causal masking is top-left aligned and needs S_q == S_k. With
STORE_LSE the kernel also writes the row logsumexp (BH, S_q), which the backward takes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..numerics.formats import elem_format, scale_mode_named
from ..numerics.quantize import dequantize_along, quantize_along
from .configs import autotuned, attention_autotune_configs, interpreter_attention_config
from .loader import kernel_module

LOG2E = math.log2(math.e)  # scores in base 2: exp(x) = 2**(x * LOG2E)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class AttentionKey:
    """The constexpr specialisation of the MX attention forward kernel (Triton compiles one
    kernel per value): the element format and scale mode of P's rounding (the formats of Q, K
    and V come from their dtypes); validated on construction."""

    elem: str = "e4m3"
    scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        elem_format(self.elem)
        scale_mode_named(self.scale_mode)

    def meta(self) -> dict[str, str]:
        """The kernel's constexpr meta-parameters for this specialisation."""
        return {"P_ELEM": elem_format(self.elem).name, "SCALE_MODE": scale_mode_named(self.scale_mode).value}


def dot_dtype(interpret: bool) -> str:
    """The MMA operand dtype of the MX attention kernels (constexpr DOT): bf16 on a GPU; fp32
    under the interpreter, whose bf16 dot multiplies bf16 bit patterns as integers. The
    expanded MX operands are exact in both (see `kernels/mx_tile.load_mx_tile`)."""
    return "fp32" if interpret else "bf16"


# Bytes: on a GPU the kernels read scales along the rows two bytes at a time
# (`kernels/mx_tile.load_mx_tile`).
SCALE_ALIGNMENT = 2


def aligned_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scale bytes at an address the kernels can read two at a time: as they are, or copied
    (a view at an odd offset into its storage)."""
    return scales if scales.data_ptr() % SCALE_ALIGNMENT == 0 else scales.clone()


# The first compute capability whose FP8 -> bf16 conversion is one instruction per pair
# (cvt.rn.bf16x2.e4m3x2, F2FP.BF16.E4M3.UNPACK_B); sm90 converts through f16 (F2FP.F16.E4M3,
# then F2F.BF16.F16 per element). Seen in Triton 3.9's SASS, 2026-12-08.
DIRECT_FP8_CVT_CAPABILITY = 100


def direct_fp8_cvt(device: torch.device, capability: int | None) -> bool:
    """The constexpr FP8_CVT_BF16 of the MX attention kernels: whether the target converts FP8
    to bf16 in one instruction per pair, which decides how P is turned back into bf16 after its
    rounding (`kernels/mx_tile.mx_round`; both ways give the same bits). `capability` (10 *
    major + minor) is the compile target's when compiling ahead of time; None reads a CUDA
    device's, and takes False elsewhere (the interpreter does not read the flag)."""
    if capability is None and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        capability = 10 * major + minor
    return capability is not None and capability >= DIRECT_FP8_CVT_CAPABILITY


@functools.cache
def _autotuned(block_size: int, head_dim: int) -> Any:
    configs = [c for c in attention_autotune_configs(head_dim) if c.kwargs["BLOCK_N"] % block_size == 0]
    kernel = kernel_module("attention", interpret=False).mx_attention_fwd_kernel
    tune_key = ["S_Q", "S_K", *AttentionKey().meta(), "HEAD_DIM", "CAUSAL", "STORE_LSE", "DOT"]
    return autotuned(kernel, configs, tune_key)


_FP8_DTYPE_TO_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def mx_attention_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
    p_elem: str = "e4m3",
    p_scale_mode: str = "rceil",
    tiles: dict[str, int] | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MX attention forward. q (..., S_q, D), k and v (..., S_k, D) FP8; scales: q (..., S_q,
    D/bs) and k (..., S_k, D/bs) along D, v (..., ceil(S_k/bs), D) along keys. Returns (..., S_q, D);
    with return_lse=True (output, logsumexp (..., S_q) fp32, natural log), the pair
    `mx_attention_backward_triton` takes."""
    from . import _require

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FP8_DTYPE_TO_ELEM:
            raise ValueError(f"{name} must be FP8 ({list(_FP8_DTYPE_TO_ELEM)}), got {t.dtype}")
        if t.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions")
    lead = q.shape[:-2]
    s_q, d = q.shape[-2:]
    s_k = k.shape[-2]
    if k.shape[:-2] != lead or v.shape[:-2] != lead or k.shape[-1] != d or v.shape[-2:] != (s_k, d):
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(f"shapes disagree: {shapes}")
    others = {"q_scale": q_scale, "k": k, "k_scale": k_scale, "v": v, "v_scale": v_scale}
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if block_size != 32:
        raise ValueError("MX attention takes the MX block of 32 (OCP MX): block_size=32")
    if d % block_size or d & (d - 1) or d < 32:
        raise ValueError(f"head_dim={d} must be a power of two >= 32")
    if causal and s_q != s_k:
        raise ValueError("causal=True needs S_q == S_k (top-left aligned mask)")
    expected = {
        "q_scale": (q_scale, (*lead, s_q, d // block_size)),
        "k_scale": (k_scale, (*lead, s_k, d // block_size)),
        "v_scale": (v_scale, (*lead, -(-s_k // block_size), d)),
    }
    scales = {}
    for name, (t, shape) in expected.items():
        if t.dtype == torch.float8_e8m0fnu:
            t = t.view(torch.uint8)
        if t.dtype != torch.uint8 or tuple(t.shape) != shape:
            got = f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{name} must be uint8 of shape {shape}, got {got}")
        scales[name] = t
    _require(q.device, elem=p_elem, block_size=block_size)
    from . import _interpreting

    interpret = _interpreting()
    key = AttentionKey(elem_format(p_elem).name, scale_mode_named(p_scale_mode).value)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[-2:])

    result = attention_launch(
        flat(q), flat(scales["q_scale"]), flat(k), flat(scales["k_scale"]), flat(v),
        flat(scales["v_scale"]), key=key, sm_scale=float(sm_scale), causal=causal,
        block_size=block_size, out_dtype=out_dtype, tiles=tiles, interpret=interpret,
        store_lse=return_lse,
    )  # fmt: skip
    if return_lse:
        out, lse = result
        return out.reshape(*lead, s_q, d), lse.reshape(*lead, s_q)
    return result.reshape(*lead, s_q, d)


def attention_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    key: AttentionKey,
    sm_scale: float,
    causal: bool,
    block_size: int,
    out_dtype: torch.dtype,
    tiles: dict[str, int] | None,
    interpret: bool,
    wrap: Any = None,
    store_lse: bool = False,
    capability: int | None = None,
) -> Any:
    """Thin launcher on 3-D (heads, rows, cols) tensors, made contiguous (the kernel's layout);
    no validation (see mx_attention_triton). Returns the output, or (output, logsumexp (heads,
    rows) fp32) when store_lse. capability: the compile target's, when compiling ahead of time
    (`direct_fp8_cvt`)."""
    import triton

    heads, s_q, d = q.shape
    s_k = k.shape[1]
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    # Without store_lse the kernel never touches lse_ptr: the output stands in for it.
    lse = torch.empty((heads, s_q), dtype=torch.float32, device=q.device) if store_lse else out
    result = (out, lse) if store_lse else out

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(s_q, meta["BLOCK_M"]), heads)

    meta: dict[str, Any] = {
        **key.meta(), "CAUSAL": causal, "STORE_LSE": store_lse, "DOT": dot_dtype(interpret),
        "FP8_CVT_BF16": direct_fp8_cvt(q.device, capability), "HEAD_DIM": d, "SCALE_BLOCK": block_size,
    }  # fmt: skip
    if s_q == 0 or heads == 0:  # nothing to compute; Triton rejects an empty grid
        return result
    if tiles is None and not interpret:
        kernel = _autotuned(block_size, d)
    else:
        kernel = kernel_module("attention", interpret=interpret).mx_attention_fwd_kernel
        meta.update(tiles or interpreter_attention_config())
        if meta["BLOCK_N"] % block_size:
            raise ValueError(f"tiles['BLOCK_N'] must be a multiple of block_size={block_size}")
    if wrap is not None:
        kernel = wrap(kernel)
    operands = [t.contiguous() for t in (q, q_scale, k, k_scale, v, aligned_scales(v_scale))]
    kernel[grid](*operands, out, lse, s_q, s_k, sm_scale * LOG2E, **meta)
    return result


def _dequantized(q, q_scale, k, k_scale, v, v_scale, block_size):  # type: ignore[no-untyped-def]
    qf = dequantize_along(q, q_scale, q.ndim - 1, block_size, torch.float32)
    kf = dequantize_along(k, k_scale, k.ndim - 1, block_size, torch.float32)
    vf = dequantize_along(v, v_scale, v.ndim - 2, block_size, torch.float32)
    return qf, kf, vf


def _scores(qf, kf, sm_scale, causal):  # type: ignore[no-untyped-def]
    s = (qf @ kf.transpose(-1, -2)) * sm_scale
    if causal:
        s_q, s_k = s.shape[-2:]
        keep = torch.ones(s_q, s_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def mx_attention_reference(
    q,
    q_scale,
    k,
    k_scale,
    v,
    v_scale,
    *,
    sm_scale=None,
    causal=False,
    block_size=32,
    out_dtype=torch.float32,
    block_n=32,
    p_elem="e4m3",
    p_scale_mode="rceil",
    return_lse=False,
):  # type: ignore[no-untyped-def]
    """The kernel's algorithm replayed in torch with key tiles of `block_n`: online softmax in
    fp32 and base 2 with an integer running maximum, P quantized per tile along keys with
    `mxcompile.numerics.quantize_along`. With return_lse=True: (output, logsumexp fp32, natural
    log), as the kernel's STORE_LSE writes it."""
    qf, kf, vf = _dequantized(q, q_scale, k, k_scale, v, v_scale, block_size)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s_all = _scores(qf, kf, sm_scale * LOG2E, causal)
    fmt, p_scale_mode = elem_format(p_elem), scale_mode_named(p_scale_mode)
    s_k = s_all.shape[-1]
    m = torch.full(s_all.shape[:-1], float("-inf"), device=s_all.device)
    denom = torch.zeros(s_all.shape[:-1], device=s_all.device)
    acc = torch.zeros(*s_all.shape[:-1], vf.shape[-1], device=s_all.device)
    for n0 in range(0, s_k, block_n):
        s = s_all[..., n0 : n0 + block_n]
        m_new = torch.maximum(m, torch.ceil(s.amax(-1)))
        m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp2(s - m_use[..., None])
        alpha = torch.exp2(m - m_use)
        denom = denom * alpha + p.sum(-1)
        p_data, p_scale = quantize_along(p, p.ndim - 1, fmt, p_scale_mode, block_size)
        p_q = dequantize_along(p_data, p_scale, p.ndim - 1, block_size, torch.float32)
        acc = acc * alpha[..., None] + p_q @ vf[..., n0 : n0 + block_n, :]
        m = m_new
    out = torch.where(denom[..., None] > 0, acc / denom[..., None], 0.0).to(out_dtype)
    if return_lse:
        return out, torch.where(denom > 0, (m + torch.log2(denom)) * LN2, float("inf"))
    return out
