"""bf16 flash attention (FlashAttention-2), forward and backward: the reference the MX attention
kernels are measured against. Not used by the backend: it exists so that the static report
(`benchmarks/kernel_static.py`) can compile it beside the MX kernels with the same tiles, and a
GPU session can time it, and say what MX costs over plain bf16 attention.

The kernels are `kernels/flash_attention.py`; this module holds their thin launchers and the
torch references, fp32 `torch.nn.functional.scaled_dot_product_attention` and its autograd.
`tl.constexpr`s: CAUSAL, STORE_LSE (forward), HEAD_DIM, BLOCK_M, BLOCK_N.
Shapes: q (BH, S_q, D); k, v (BH, S_k, D); lse, delta (BH, S_q). Causal masking is top-left
aligned and needs S_q == S_k. The inputs are bf16 or fp16 (fp32 multiplies in Triton's default
precision, tf32 on a GPU, and serves the interpreter's exact checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .attention import LOG2E
from .configs import interpreter_attention_backward_config, interpreter_attention_config
from .loader import kernel_module

FLASH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows of O and dO per program of the delta kernel (the MX backward's preprocess kernel).
DELTA_BLOCK_M = 64


def _check(tensors: dict[str, torch.Tensor], causal: bool) -> None:
    q, k = tensors["q"], tensors["k"]
    for name, t in tensors.items():
        if t.dtype != q.dtype or t.dtype not in FLASH_DTYPES or t.ndim != 3:
            got = f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{name} must be 3-D bf16, fp16 or fp32 like q, got {got}")
    heads, s_q, d = q.shape
    if k.shape[0] != heads or k.shape[2] != d or tensors["v"].shape != k.shape:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())
        raise ValueError(f"shapes disagree: {shapes}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two >= 16 (tl.dot)")
    if causal and s_q != k.shape[1]:
        raise ValueError("causal=True needs S_q == S_k (top-left aligned mask)")


def _tiles(
    tiles: dict[str, int] | None, interpreter_config: Callable[[], dict[str, int]], interpret: bool
) -> dict[str, int]:
    """The launch's tiles: as given, else the interpreter's (no autotuning for a reference)."""
    if tiles is not None:
        return dict(tiles)
    if not interpret:
        raise ValueError("the bf16 reference is not autotuned: pass tiles={'BLOCK_M', 'BLOCK_N'}")
    return interpreter_config()


def flash_attention_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    tiles: dict[str, int] | None = None,
    store_lse: bool = False,
    interpret: bool,
    wrap: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Thin launcher of the forward on 3-D (heads, rows, head_dim) tensors: the output in q's
    dtype, with store_lse also the logsumexp (heads, rows) fp32, natural log. `tiles`:
    BLOCK_M, BLOCK_N (and optionally num_warps, num_stages)."""
    import triton

    _check({"q": q, "k": k, "v": v}, causal)
    heads, s_q, d = q.shape
    s_k = k.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # Without store_lse the kernel never touches lse_ptr: the output stands in for it.
    lse = torch.empty((heads, s_q), dtype=torch.float32, device=q.device) if store_lse else out
    lse_strides = lse.stride() if store_lse else (0, 0)
    result = (out, lse) if store_lse else out
    meta = {"CAUSAL": causal, "STORE_LSE": store_lse, "HEAD_DIM": d}
    meta.update(_tiles(tiles, interpreter_attention_config, interpret))
    if heads == 0 or s_q == 0:  # Triton rejects an empty grid
        return result
    kernel = kernel_module("flash_attention", interpret=interpret).flash_attention_fwd_kernel
    kernel = wrap(kernel) if wrap is not None else kernel
    kernel[(triton.cdiv(s_q, meta["BLOCK_M"]), heads)](
        q, k, v, out, lse, s_q, s_k, sm_scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse_strides, **meta,
    )  # fmt: skip
    return result


def flash_attention_backward_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin launcher of the backward on 3-D tensors and lse (heads, rows) fp32 from the forward:
    (dq, dk, dv) in the inputs' dtype. Three launches: delta, dK/dV (BLOCK_N keys per program,
    BLOCK_M queries per step), dQ (BLOCK_M queries per program, BLOCK_N keys per step)."""
    import triton

    _check({"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out}, causal)
    heads, s_q, d = q.shape
    s_k = k.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if heads == 0 or s_q == 0 or s_k == 0:  # Triton rejects an empty grid
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = {"CAUSAL": causal, "HEAD_DIM": d}
    meta.update(_tiles(tiles, interpreter_attention_backward_config, interpret))
    delta = torch.empty((heads, s_q), dtype=torch.float32, device=q.device)

    def launcher(kernel: Any) -> Any:
        return wrap(kernel) if wrap is not None else kernel

    delta_kernel = kernel_module("attention_backward", interpret=interpret)
    launcher(delta_kernel.mx_attention_bwd_preprocess_kernel)[(triton.cdiv(s_q, DELTA_BLOCK_M), heads)](
        out, grad_out, delta, s_q, *out.stride(), *grad_out.stride(), *delta.stride(),
        HEAD_DIM=d, BLOCK_M=DELTA_BLOCK_M,
    )  # fmt: skip
    module = kernel_module("flash_attention", interpret=interpret)
    common = (
        s_q, s_k, sm_scale, sm_scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *lse.stride(), *delta.stride(),
    )  # fmt: skip
    launcher(module.flash_attention_dkdv_kernel)[(triton.cdiv(s_k, meta["BLOCK_N"]), heads)](
        q, k, v, grad_out, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(), **meta
    )
    launcher(module.flash_attention_dq_kernel)[(triton.cdiv(s_q, meta["BLOCK_M"]), heads)](
        q, k, v, grad_out, lse, delta, dq, *common, *dq.stride(), **meta
    )
    return dq, dk, dv


def flash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch's scaled_dot_product_attention in fp32, and the row logsumexp (natural log, +inf
    for a row with no key): what the forward kernel computes, up to its dtype."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=sm_scale)
    s = (qf @ kf.transpose(-1, -2)) * sm_scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return out, torch.where(lse == float("-inf"), float("inf"), lse)


def flash_attention_backward_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, *,
    sm_scale: float | None = None, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of fp32 scaled_dot_product_attention by autograd."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=sm_scale)
    out.backward(grad_out.float())
    return tuple(t.grad for t in leaves)  # type: ignore[return-value]
