"""bf16 flash attention, forward and backward (FlashAttention-2, no atomics): the reference the
MX attention kernels are compared with (`mxcompile/triton_templates/flash_attention.py` holds
the launchers and the torch references). Every product is a plain `tl.dot` of the operands as
loaded (bf16 or fp16 on the tensor cores, fp32 accumulation); P and dS are cast to the dtype of
the operand they meet. The structure is the MX kernels' (`attention.py`,
`attention_backward.py`), so that compiled side by side with the same tiles their instruction
counts compare the cost of MX alone.

  flash_attention_fwd_kernel   one program per (query tile, head): base-2 online softmax over
                               the key tiles, real running maximum; optionally the logsumexp.
  flash_attention_dkdv_kernel  one program per (key tile, head): dK, dV over the query tiles.
  flash_attention_dq_kernel    one program per (query tile, head): dQ over the key tiles.
The backward's delta = rowsum(dO * O) is the MX backward's preprocess kernel (no MX in it).
"""

import triton
import triton.language as tl

from .mx_tile import (
    LN2, key_tiles_end, load_row_stats, load_rows, online_softmax_step, program_rows,
)  # fmt: skip


@triton.jit
def flash_attention_fwd_kernel(
    # Pointers: Q, K, V (bf16, fp16 or fp32); the output O; the fp32 logsumexp (natural log,
    # one per query row; written only when STORE_LSE).
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    # Sizes; the softmax scale times log2(e) (scores in base-2 units)
    S_Q, S_K, qk_scale,
    # Strides (elements): head, row, column of each tensor; head, row of the logsumexp
    stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd, stride_oh, stride_om, stride_od, stride_lh, stride_lm,
    # Meta-parameters
    CAUSAL: tl.constexpr,  # top-left aligned mask, S_Q == S_K
    STORE_LSE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Phase 1: this program's query tile and head; load the Q tile once.
    pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)
    q = load_rows(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m, 0.0)

    # Phase 2: online softmax over the key tiles (causal: up to the diagonal).
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < S_K
        # S = Q K^T, in base-2 units; -inf outside the valid entries.
        k = load_rows(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n, 0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = mask_n[None, :] & mask_m[:, None]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, False)
        # O += P V, with P in V's dtype.
        v = load_rows(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])

    # Phase 3: normalise and store (a row that attended to no key gets 0, and lse = +inf).
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    o_ptrs = o_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])
    if STORE_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) * LN2, float("inf"))
        tl.store(lse_ptr + head * stride_lh + offs_m * stride_lm, lse, mask=mask_m)


@triton.jit
def flash_attention_dkdv_kernel(
    # Pointers: Q, K, V, dO; logsumexp and delta (fp32, one per query row); the outputs dK, dV.
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    # Sizes; the softmax scale, and the same times log2(e)
    S_Q, S_K, sm_scale, qk_scale,
    # Strides (elements): head, row, column of each tensor; head, row of lse and delta
    stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd, stride_doh, stride_dom, stride_dod,
    stride_lh, stride_lm, stride_eh, stride_em,
    stride_dkh, stride_dkn, stride_dkd, stride_dvh, stride_dvn, stride_dvd,
    # Meta-parameters
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step
    BLOCK_N: tl.constexpr,  # keys per program
):  # fmt: skip
    # Phase 1: this program's key tile and head; load K and V once.
    pid_n, head, offs_n, offs_d, mask_n = program_rows(S_K, BLOCK_N, HEAD_DIM)
    k = load_rows(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n, 0.0)
    v = load_rows(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n, 0.0)
    dk = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)

    # Phase 2: walk over the query tiles that see these keys (causal: from the tile holding
    # the first key's query on). The products are transposed, keys as rows.
    if CAUSAL:
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for m0 in range(lo, S_Q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < S_Q
        q = load_rows(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m, 0.0)
        do = load_rows(
            do_ptr + head * stride_doh, offs_m, stride_dom, offs_d, stride_dod, mask_m, 0.0
        )
        lse2, delta = load_row_stats(
            lse_ptr, delta_ptr, head, offs_m, mask_m, stride_lh, stride_lm, stride_eh, stride_em
        )
        # P^T = exp2(K Q^T * scale - lse), 0 outside the valid entries.
        s_t = tl.dot(k, tl.trans(q))
        valid = mask_n[:, None] & mask_m[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
        # dV += P^T dO; dP^T = V dO^T; dS^T = P^T (dP^T - delta); dK += dS^T Q.
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)

    # Phase 3: store dK (times the softmax scale) and dV.
    dk_ptrs = (
        dk_ptr + head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    )
    tl.store(dk_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask_n[:, None])
    dv_ptrs = (
        dv_ptr + head * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    )
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=mask_n[:, None])


@triton.jit
def flash_attention_dq_kernel(
    # Pointers: Q, K, V, dO; logsumexp and delta (fp32, one per query row); the output dQ.
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    # Sizes; the softmax scale, and the same times log2(e)
    S_Q, S_K, sm_scale, qk_scale,
    # Strides (elements): head, row, column of each tensor; head, row of lse and delta
    stride_qh, stride_qm, stride_qd, stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd, stride_doh, stride_dom, stride_dod,
    stride_lh, stride_lm, stride_eh, stride_em,
    stride_dqh, stride_dqm, stride_dqd,
    # Meta-parameters
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    # Phase 1: this program's query tile and head; load Q, dO and the row statistics once.
    pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)
    q = load_rows(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m, 0.0)
    do = load_rows(do_ptr + head * stride_doh, offs_m, stride_dom, offs_d, stride_dod, mask_m, 0.0)
    lse2, delta = load_row_stats(
        lse_ptr, delta_ptr, head, offs_m, mask_m, stride_lh, stride_lm, stride_eh, stride_em
    )
    dq = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)

    # Phase 2: walk over the key tiles these queries see (causal: up to the diagonal).
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < S_K
        k = load_rows(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n, 0.0)
        v = load_rows(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n, 0.0)
        # P = exp2(Q K^T * scale - lse), 0 outside the valid entries.
        s = tl.dot(q, tl.trans(k))
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        # dP = dO V^T; dS = P (dP - delta); dQ += dS K.
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)

    # Phase 3: store dQ (times the softmax scale).
    dq_ptrs = (
        dq_ptr + head * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_m[:, None])
