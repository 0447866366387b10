"""MX flash attention backward kernels (FlashAttention-2 style, no atomics). See
`mxcompile/triton_templates/attention_backward.py` for the semantics (which operand is quantized
along which axis, the modes), the shapes and the reference.

Both the dK/dV and the dQ kernel recompute S and P and compute dP for one (query tile, key tile)
pair; `_scores_and_probs`, `_dot_nt` and `_dot_acc` are those steps, written once. The dK/dV
kernel works on the transposed products (keys as rows); `QUERY_ROWS` says which way round.
"""

import triton
import triton.language as tl

from .mx_tile import (
    key_tiles_end, load_row_stats, load_rows, mx_lhs, mx_rhs, program_rows, sum_combine,
)


@triton.jit
def _dot_nt(
    lhs, lhs_scale, rhs,
    MX: tl.constexpr, LHS_ELEM: tl.constexpr, RHS_ELEM: tl.constexpr,
    COLS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    SCALE_MODE: tl.constexpr, CAST: tl.constexpr,
):  # fmt: skip
    """lhs · rhsᵀ, contracted over head_dim; rhs is fp32 (COLS, HEAD_DIM). With MX, lhs is
    already an MX left operand (data, scales along head_dim) and rhsᵀ is quantized here along
    head_dim; without, lhs is fp32 and lhs_scale unused."""
    if MX:
        rhs_data, rhs_scale = mx_rhs(
            tl.trans(rhs), HEAD_DIM, COLS, SCALE_BLOCK, RHS_ELEM, SCALE_MODE, CAST
        )
        product = tl.dot_scaled(lhs, lhs_scale, LHS_ELEM, rhs_data, rhs_scale, RHS_ELEM)
    else:
        product = tl.dot(lhs, tl.trans(rhs), input_precision="ieee")
    return product


@triton.jit
def _dot_acc(
    lhs, rhs, acc,
    MX: tl.constexpr, LHS_ELEM: tl.constexpr, RHS_ELEM: tl.constexpr,
    ROWS: tl.constexpr, INNER: tl.constexpr, COLS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    SCALE_MODE: tl.constexpr, CAST: tl.constexpr,
):  # fmt: skip
    """acc + lhs · rhs for fp32 lhs (ROWS, INNER) and rhs (INNER, COLS); with MX both are
    quantized along INNER, their contraction axis."""
    if MX:
        lhs_data, lhs_scale = mx_lhs(lhs, ROWS, INNER, SCALE_BLOCK, LHS_ELEM, SCALE_MODE, CAST)
        rhs_data, rhs_scale = mx_rhs(rhs, INNER, COLS, SCALE_BLOCK, RHS_ELEM, SCALE_MODE, CAST)
        acc = tl.dot_scaled(lhs_data, lhs_scale, LHS_ELEM, rhs_data, rhs_scale, RHS_ELEM, acc)
    else:
        acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
    return acc


@triton.jit
def _scores_and_probs(
    lhs, lhs_scale, rhs, lse2, offs_rows, mask_rows, offs_cols, mask_cols, qk_scale,
    QUERY_ROWS: tl.constexpr, CAUSAL: tl.constexpr, MX_QK: tl.constexpr, ELEM: tl.constexpr,
    COLS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    SCALE_MODE: tl.constexpr, CAST: tl.constexpr,
):  # fmt: skip
    """The normalized probabilities P (QUERY_ROWS) or Pᵀ (keys as rows) of one tile pair,
    recomputed from S = lhs · rhsᵀ and the saved logsumexp `lse2` (base 2, one per query);
    exactly 0 outside the valid entries (out of range, or a key after its query when CAUSAL)."""
    s = _dot_nt(
        lhs, lhs_scale, rhs, MX_QK, ELEM, ELEM, COLS, HEAD_DIM, SCALE_BLOCK, SCALE_MODE, CAST
    )
    valid = mask_rows[:, None] & mask_cols[None, :]
    if QUERY_ROWS:
        if CAUSAL:
            valid = valid & (offs_cols[None, :] <= offs_rows[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    else:
        if CAUSAL:
            valid = valid & (offs_cols[None, :] >= offs_rows[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale - lse2[None, :]), 0.0)
    return p


@triton.jit
def _lhs_operand(
    x, MX: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ELEM: tl.constexpr, SCALE_MODE: tl.constexpr, CAST: tl.constexpr,
):  # fmt: skip
    """fp32 x (ROWS, HEAD_DIM) as the left operand of a product over head_dim (`_dot_nt`): MX
    (data, scales along head_dim) with MX, else (x, None)."""
    lhs, scale = x, None
    if MX:
        lhs, scale = mx_lhs(x, ROWS, HEAD_DIM, SCALE_BLOCK, ELEM, SCALE_MODE, CAST)
    return lhs, scale


@triton.jit
def _load_fp32(ptr, offs_rows, stride_rows, offs_d, stride_d, mask_rows):
    """A (rows, HEAD_DIM) tile of a high-precision input in fp32; masked rows read 0."""
    return load_rows(ptr, offs_rows, stride_rows, offs_d, stride_d, mask_rows, 0.0).to(tl.float32)


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
):  # fmt: skip
    # delta = rowsum(dO * O) in fp32, the D of dS = P * (dP - D).
    _pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)
    o = _load_fp32(o_ptr + head * stride_oh, offs_m, stride_om, offs_d, stride_od, mask_m)
    do = _load_fp32(do_ptr + head * stride_doh, offs_m, stride_dom, offs_d, stride_dod, mask_m)
    delta = tl.reduce(o * do, 1, sum_combine)
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
    FWD_ELEM: tl.constexpr,  # format of Q, K, V and P
    GRAD_ELEM: tl.constexpr,  # format of dO and dS
    SCALE_MODE: tl.constexpr,
    CAST: tl.constexpr,
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dK = dS^T Q in MX (else fp32 operands)
    MX_PV: tl.constexpr,  # dV = P^T dO and dP = dO V^T in MX (else fp32 operands)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per program, a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's key tile and head.
    pid_n, head, offs_n, offs_d, mask_n = program_rows(S_K, BLOCK_N, HEAD_DIM)

    # Phase 2: load K and V once; both along head_dim, the contraction axis of
    # S^T = K Q^T and dP^T = V dO^T (the transposed products keep keys as rows).
    k = _load_fp32(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n)
    v = _load_fp32(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n)
    k_lhs, k_scale = _lhs_operand(k, MX_QK, BLOCK_N, HEAD_DIM, SCALE_BLOCK, FWD_ELEM, SCALE_MODE, CAST)
    v_lhs, v_scale = _lhs_operand(v, MX_PV, BLOCK_N, HEAD_DIM, SCALE_BLOCK, FWD_ELEM, SCALE_MODE, CAST)
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
        q = _load_fp32(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m)
        do = _load_fp32(do_ptr + head * stride_doh, offs_m, stride_dom, offs_d, stride_dod, mask_m)
        lse2, delta = load_row_stats(
            lse_ptr, delta_ptr, head, offs_m, mask_m, stride_lh, stride_lm, stride_eh, stride_em
        )
        # P^T = exp2(S^T - lse) with S^T = K Q^T (keys x queries).
        p_t = _scores_and_probs(
            k_lhs, k_scale, q, lse2, offs_n, mask_n, offs_m, mask_m, qk_scale, False, CAUSAL,
            MX_QK, FWD_ELEM, BLOCK_M, HEAD_DIM, SCALE_BLOCK, SCALE_MODE, CAST,
        )  # fmt: skip
        # dV += P^T dO: P^T and dO along the queries.
        dv = _dot_acc(
            p_t, do, dv, MX_PV, FWD_ELEM, GRAD_ELEM, BLOCK_N, BLOCK_M, HEAD_DIM, SCALE_BLOCK,
            SCALE_MODE, CAST,
        )  # fmt: skip
        # dP^T = V dO^T, then dS^T = P^T (dP^T - delta), fp32.
        dp_t = _dot_nt(
            v_lhs, v_scale, do, MX_PV, FWD_ELEM, GRAD_ELEM, BLOCK_M, HEAD_DIM, SCALE_BLOCK,
            SCALE_MODE, CAST,
        )  # fmt: skip
        ds_t = (dp_t - delta[None, :]) * p_t
        # dK += dS^T Q: dS^T and Q along the queries.
        dk = _dot_acc(
            ds_t, q, dk, MX_QK, GRAD_ELEM, FWD_ELEM, BLOCK_N, BLOCK_M, HEAD_DIM, SCALE_BLOCK,
            SCALE_MODE, CAST,
        )  # fmt: skip

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
    FWD_ELEM: tl.constexpr,  # format of Q, K, V and P
    GRAD_ELEM: tl.constexpr,  # format of dO and dS
    SCALE_MODE: tl.constexpr,
    CAST: tl.constexpr,
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dQ = dS K in MX (else fp32 operands)
    MX_PV: tl.constexpr,  # dP = dO V^T in MX (else fp32 operands)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per step, a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's query tile and head.
    pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)

    # Phase 2: load Q, dO and the row statistics once; Q and dO along head_dim, the
    # contraction axis of S = Q K^T and dP = dO V^T.
    q = _load_fp32(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m)
    do = _load_fp32(do_ptr + head * stride_doh, offs_m, stride_dom, offs_d, stride_dod, mask_m)
    lse2, delta = load_row_stats(
        lse_ptr, delta_ptr, head, offs_m, mask_m, stride_lh, stride_lm, stride_eh, stride_em
    )
    q_lhs, q_scale = _lhs_operand(q, MX_QK, BLOCK_M, HEAD_DIM, SCALE_BLOCK, FWD_ELEM, SCALE_MODE, CAST)
    do_lhs, do_scale = _lhs_operand(
        do, MX_PV, BLOCK_M, HEAD_DIM, SCALE_BLOCK, GRAD_ELEM, SCALE_MODE, CAST
    )
    dq = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)

    # Phase 3: walk over the key tiles these queries see (causal: up to the diagonal).
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < S_K
        k = _load_fp32(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n)
        v = _load_fp32(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n)
        # P = exp2(S - lse) with S = Q K^T (queries x keys).
        p = _scores_and_probs(
            q_lhs, q_scale, k, lse2, offs_m, mask_m, offs_n, mask_n, qk_scale, True, CAUSAL,
            MX_QK, FWD_ELEM, BLOCK_N, HEAD_DIM, SCALE_BLOCK, SCALE_MODE, CAST,
        )  # fmt: skip
        # dP = dO V^T, then dS = P (dP - delta), fp32.
        dp = _dot_nt(
            do_lhs, do_scale, v, MX_PV, GRAD_ELEM, FWD_ELEM, BLOCK_N, HEAD_DIM, SCALE_BLOCK,
            SCALE_MODE, CAST,
        )  # fmt: skip
        ds = (dp - delta[:, None]) * p
        # dQ += dS K: dS and K along the keys.
        dq = _dot_acc(
            ds, k, dq, MX_QK, GRAD_ELEM, FWD_ELEM, BLOCK_M, BLOCK_N, HEAD_DIM, SCALE_BLOCK,
            SCALE_MODE, CAST,
        )  # fmt: skip

    # Phase 4: store dQ (times the softmax scale).
    dq_ptrs = (
        dq_ptr + head * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_m[:, None])
