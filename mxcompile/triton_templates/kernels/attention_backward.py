"""MX flash attention backward kernels (FlashAttention-2 split, no atomics). See
`mxcompile/triton_templates/attention_backward.py` for the semantics (which operand is in MX
along which axis, the modes), the layouts and the reference.

Q, K, V and dO arrive quantized outside the kernels, each along the axis its product contracts
(an operand two products read along different axes comes twice): the kernels load FP8 tiles
and E8M0 scales and expand them exactly for the MMA (`load_mx_tile`). P and dS are rounded to
MX in registers (`mx_round`) along the axis of the product that reads them. A GEMM family out
of MX (modes "qk_only", "off") reads its high-precision operands in fp32 with fp32 MMAs.

Both the dK/dV and the dQ kernel recompute S and P and compute dP for one (query tile, key tile)
pair. The dK/dV kernel works on the transposed products (keys as rows).
"""

import triton
import triton.language as tl

from .mx_tile import key_tiles_end, load_mx_tile, load_row_stats, mx_round, program_rows, sum_combine


@triton.jit
def _operand(data_ptr, scale_ptr, head, r0, S, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
             SCALE_BLOCK: tl.constexpr, ALONG_ROWS: tl.constexpr, MX: tl.constexpr,
             DOT: tl.constexpr):  # fmt: skip
    """A (ROWS, HEAD_DIM) operand tile (rows r0 ..): with MX the expanded MX tile
    (`load_mx_tile`), else the high-precision tensor's rows in fp32 (0 past S)."""
    if MX:
        tile = load_mx_tile(data_ptr, scale_ptr, head, r0, S, ROWS, HEAD_DIM, SCALE_BLOCK, ALONG_ROWS, DOT)
    else:
        offs_r = r0 + tl.arange(0, ROWS)
        ptrs = data_ptr + head * S * HEAD_DIM + offs_r[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        tile = tl.load(ptrs, mask=(offs_r < S)[:, None], other=0.0).to(tl.float32)
    return tile


@triton.jit
def _product(lhs, rhs, acc, MX: tl.constexpr, ROWS: tl.constexpr, INNER: tl.constexpr,
             SCALE_BLOCK: tl.constexpr, ELEM: tl.constexpr, SCALE_MODE: tl.constexpr,
             SIGNED: tl.constexpr, DOT: tl.constexpr, FP8_CVT_BF16: tl.constexpr):  # fmt: skip
    """acc + lhs · rhs for fp32 lhs (ROWS, INNER), P or dS, and an operand tile rhs (INNER, cols):
    with MX, lhs is rounded to MX along INNER, its contraction axis, in registers; else an fp32
    product. SIGNED=False: lhs >= 0 (P)."""
    if MX:
        lhs = mx_round(lhs, ROWS, INNER, SCALE_BLOCK, ELEM, SCALE_MODE, SIGNED, DOT, FP8_CVT_BF16)
        acc = tl.dot(lhs, rhs, acc)
    else:
        acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
    return acc


@triton.jit
def _scores(lhs, rhs, MX: tl.constexpr):
    """lhs · rhsᵀ over head_dim, of two operand tiles (bf16 MMA with MX, fp32 without)."""
    if MX:
        product = tl.dot(lhs, tl.trans(rhs))
    else:
        product = tl.dot(lhs, tl.trans(rhs), input_precision="ieee")
    return product


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
    o_ptrs = o_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    do_ptrs = do_ptr + head * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    o = tl.load(o_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
    delta = tl.reduce(do * o, 1, sum_combine)
    tl.store(delta_ptr + head * stride_eh + offs_m * stride_em, delta, mask=mask_m)


@triton.jit
def mx_attention_bwd_dkdv_kernel(
    # Pointers (data, scales; contiguous, see `load_mx_tile`): Q along head_dim, Q along the
    # queries, K along head_dim, V along head_dim, dO along head_dim, dO along the queries
    # (a path out of MX passes its high-precision tensors and no scales); logsumexp and delta
    # (fp32 (heads, S_Q)); the outputs dK, dV (heads, S_K, HEAD_DIM), contiguous.
    q_ptr, q_scale_ptr, qt_ptr, qt_scale_ptr, k_ptr, k_scale_ptr, v_ptr, v_scale_ptr,
    do_ptr, do_scale_ptr, dot_ptr, dot_scale_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    # Sizes; the softmax scale, and the same times log2(e) (S in base-2 units)
    S_Q, S_K, sm_scale, qk_scale,
    # Meta-parameters
    FWD_ELEM: tl.constexpr,  # format of P's rounding
    GRAD_ELEM: tl.constexpr,  # format of dS's rounding
    SCALE_MODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dK = dS^T Q in MX (else fp32)
    MX_PV: tl.constexpr,  # dV = P^T dO and dP = dO V^T in MX (else fp32)
    DOT: tl.constexpr,  # MMA operand dtype of the MX products: "bf16" ("fp32" interpreted)
    FP8_CVT_BF16: tl.constexpr,  # the target converts FP8 to bf16 in one instruction (sm100+)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per program, a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's key tile and head; K and V (along head_dim, the contraction axis
    # of S^T = K Q^T and dP^T = V dO^T) loaded once.
    pid_n, head, offs_n, offs_d, mask_n = program_rows(S_K, BLOCK_N, HEAD_DIM)
    n0 = pid_n * BLOCK_N
    k = _operand(k_ptr, k_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, False, MX_QK, DOT)
    v = _operand(v_ptr, v_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, False, MX_PV, DOT)
    dk = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, HEAD_DIM), 0.0, tl.float32)

    # Phase 2: walk over the query tiles that see these keys (causal: from the tile holding
    # the first key's query on; earlier queries attend to none of them).
    if CAUSAL:
        lo = n0 // BLOCK_M * BLOCK_M
    else:
        lo = 0
    for m0 in range(lo, S_Q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < S_Q
        lse2, delta = load_row_stats(lse_ptr, delta_ptr, head, offs_m, mask_m, S_Q, 1, S_Q, 1)
        # P^T = exp2(S^T - lse), S^T = K Q^T (keys x queries); exactly 0 outside the valid
        # entries.
        q = _operand(q_ptr, q_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, False, MX_QK, DOT)
        s_t = _scores(k, q, MX_QK)
        valid = mask_n[:, None] & mask_m[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
        # dV += P^T dO: P^T rounded along the queries, dO along the queries.
        do_t = _operand(dot_ptr, dot_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, True, MX_PV, DOT)
        dv = _product(p_t, do_t, dv, MX_PV, BLOCK_N, BLOCK_M, SCALE_BLOCK, FWD_ELEM, SCALE_MODE, False, DOT,
                      FP8_CVT_BF16)
        # dP^T = V dO^T (along head_dim), then dS^T = (dP^T - delta) P^T, fp32.
        do = _operand(do_ptr, do_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, False, MX_PV, DOT)
        ds_t = (_scores(v, do, MX_PV) - delta[None, :]) * p_t
        # dK += dS^T Q: dS^T rounded along the queries, Q along the queries.
        q_t = _operand(qt_ptr, qt_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, True, MX_QK, DOT)
        dk = _product(ds_t, q_t, dk, MX_QK, BLOCK_N, BLOCK_M, SCALE_BLOCK, GRAD_ELEM, SCALE_MODE, True, DOT,
                      FP8_CVT_BF16)

    # Phase 3: store dK (times the softmax scale) and dV.
    offsets = head * S_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + offsets, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask_n[:, None])
    tl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=mask_n[:, None])


@triton.jit
def mx_attention_bwd_dq_kernel(
    # Pointers (data, scales; contiguous, see `load_mx_tile`): Q along head_dim, K along
    # head_dim, K along the keys, V along head_dim, dO along head_dim (a path out of MX passes
    # its high-precision tensors and no scales); logsumexp and delta (fp32 (heads, S_Q)); the
    # output dQ (heads, S_Q, HEAD_DIM), contiguous.
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, kt_ptr, kt_scale_ptr, v_ptr, v_scale_ptr,
    do_ptr, do_scale_ptr, lse_ptr, delta_ptr, dq_ptr,
    # Sizes; the softmax scale, and the same times log2(e) (S in base-2 units)
    S_Q, S_K, sm_scale, qk_scale,
    # Meta-parameters
    GRAD_ELEM: tl.constexpr,  # format of dS's rounding
    SCALE_MODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    MX_QK: tl.constexpr,  # S = Q K^T and dQ = dS K in MX (else fp32)
    MX_PV: tl.constexpr,  # dP = dO V^T in MX (else fp32)
    DOT: tl.constexpr,
    FP8_CVT_BF16: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program, a multiple of SCALE_BLOCK
    BLOCK_N: tl.constexpr,  # keys per step, a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's query tile and head; Q and dO (along head_dim, the contraction
    # axis of S = Q K^T and dP = dO V^T) and the row statistics loaded once.
    pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)
    m0 = pid_m * BLOCK_M
    q = _operand(q_ptr, q_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, False, MX_QK, DOT)
    do = _operand(do_ptr, do_scale_ptr, head, m0, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, False, MX_PV, DOT)
    lse2, delta = load_row_stats(lse_ptr, delta_ptr, head, offs_m, mask_m, S_Q, 1, S_Q, 1)
    dq = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)

    # Phase 2: walk over the key tiles these queries see (causal: up to the diagonal).
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # P = exp2(S - lse), S = Q K^T (queries x keys); exactly 0 outside the valid entries.
        k = _operand(k_ptr, k_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, False, MX_QK, DOT)
        s = _scores(q, k, MX_QK)
        valid = mask_m[:, None] & (offs_n < S_K)[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        # dP = dO V^T (along head_dim), then dS = (dP - delta) P, fp32.
        v = _operand(v_ptr, v_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, False, MX_PV, DOT)
        ds = (_scores(do, v, MX_PV) - delta[:, None]) * p
        # dQ += dS K: dS rounded along the keys, K along the keys.
        k_t = _operand(kt_ptr, kt_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, True, MX_QK, DOT)
        dq = _product(ds, k_t, dq, MX_QK, BLOCK_M, BLOCK_N, SCALE_BLOCK, GRAD_ELEM, SCALE_MODE, True, DOT, FP8_CVT_BF16)

    # Phase 3: store dQ (times the softmax scale).
    offsets = head * S_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptr + offsets, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask_m[:, None])
