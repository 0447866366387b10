"""MX flash attention forward kernel. See `mxcompile/triton_templates/attention.py` for the
algorithm (base-2 online softmax with an integer running maximum, P quantized per key tile),
the shapes and the references."""

import triton
import triton.language as tl

from .mx_tile import E8M0_ONE, LN2, key_tiles_end, load_rows, mx_lhs, online_softmax_step


@triton.jit
def mx_attention_fwd_kernel(
    # Pointers: FP8 Q, K, V with their uint8 E8M0 scales; the output O; the fp32 logsumexp
    # (natural log, one per query row; written only when STORE_LSE).
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, v_ptr, v_scale_ptr, o_ptr, lse_ptr,
    # Sizes; the softmax scale times log2(e) (scores in base-2 units)
    S_Q, S_K, qk_scale,
    # Strides (elements): head, row, column of each tensor
    stride_qh, stride_qm, stride_qd, stride_qsh, stride_qsm, stride_qsd,
    stride_kh, stride_kn, stride_kd, stride_ksh, stride_ksn, stride_ksd,
    stride_vh, stride_vn, stride_vd, stride_vsh, stride_vsn, stride_vsd,
    stride_oh, stride_om, stride_od, stride_lh, stride_lm,
    # Meta-parameters
    Q_ELEM: tl.constexpr,  # element formats of Q, K, V ("e4m3" or "e5m2")
    K_ELEM: tl.constexpr,
    V_ELEM: tl.constexpr,
    P_ELEM: tl.constexpr,  # format, scale mode and cast of the in-kernel quantization of P
    P_SCALE_MODE: tl.constexpr,
    CAST: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,  # also write logsumexp = m + log(l), what the backward needs
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's query tile and head; 64-bit offsets.
    pid_m = tl.program_id(axis=0).to(tl.int64)
    head = tl.program_id(axis=1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_ds = tl.arange(0, HEAD_DIM // SCALE_BLOCK)
    mask_m = offs_m < S_Q

    # Phase 2: load the Q tile and its scales once.
    q = load_rows(q_ptr + head * stride_qh, offs_m, stride_qm, offs_d, stride_qd, mask_m, 0.0)
    q_scale = load_rows(
        q_scale_ptr + head * stride_qsh, offs_m, stride_qsm, offs_ds, stride_qsd, mask_m, E8M0_ONE
    )

    # Phase 3: online softmax over key tiles, in base 2 (running integer max exponent m_i,
    # denominator l_i, fp32 acc).
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < S_K
        # S = Q K^T: K^T tile (HEAD_DIM, BLOCK_N); K's scales (BLOCK_N, HEAD_DIM // 32) are
        # already in the layout dot_scaled wants for its right operand.
        k = load_rows(k_ptr + head * stride_kh, offs_n, stride_kn, offs_d, stride_kd, mask_n, 0.0)
        k_scale = load_rows(
            k_scale_ptr + head * stride_ksh, offs_n, stride_ksn, offs_ds, stride_ksd, mask_n,
            E8M0_ONE,
        )  # fmt: skip
        s = tl.dot_scaled(q, q_scale, Q_ELEM, tl.trans(k), k_scale, K_ELEM) * qk_scale
        valid = mask_n[None, :] & mask_m[:, None]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        # Softmax statistics with an integer running maximum: every rescale is an exact power
        # of two and P's largest value lies in (1/2, 1], so its MX rounding does not depend on
        # BLOCK_N.
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i, True)
        # P quantized along the key axis, in blocks of SCALE_BLOCK keys.
        p_data, p_scale = mx_lhs(p, BLOCK_M, BLOCK_N, SCALE_BLOCK, P_ELEM, P_SCALE_MODE, CAST)
        # O += P V: V tile (BLOCK_N, HEAD_DIM); its scales (BLOCK_N // 32, HEAD_DIM) transposed,
        # (HEAD_DIM, BLOCK_N // 32), as dot_scaled wants for its right operand.
        v = load_rows(v_ptr + head * stride_vh, offs_n, stride_vn, offs_d, stride_vd, mask_n, 0.0)
        offs_nb = n0 // SCALE_BLOCK + tl.arange(0, BLOCK_N // SCALE_BLOCK)
        v_scale = load_rows(
            v_scale_ptr + head * stride_vsh, offs_nb, stride_vsn, offs_d, stride_vsd,
            offs_nb < S_K // SCALE_BLOCK, E8M0_ONE,
        )  # fmt: skip
        acc = acc * alpha[:, None]
        acc = tl.dot_scaled(p_data, p_scale, P_ELEM, v, tl.trans(v_scale), V_ELEM, acc)
        m_i = m_new

    # Phase 4: normalise and store (a row that attended to no key gets 0, as in the CPU op).
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    o_ptrs = o_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])
    if STORE_LSE:
        # A row that attended to no key gets +inf (the backward then gives it P = 0).
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) * LN2, float("inf"))
        tl.store(lse_ptr + head * stride_lh + offs_m * stride_lm, lse, mask=mask_m)
