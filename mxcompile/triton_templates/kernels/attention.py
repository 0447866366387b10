"""MX flash attention forward kernel. See `mxcompile/triton_templates/attention.py` for the
algorithm (base-2 online softmax with an integer running maximum, P rounded to MX per key tile),
the layouts and the references.

Q and K (along head_dim) and V (along the keys) arrive quantized: FP8 tiles and E8M0 scales,
expanded exactly to the MMA's dtype (`load_mx_tile`); P is rounded to MX along the keys in
registers (`mx_round`). Both products are bf16 MMAs with fp32 accumulation on a GPU.
"""

import triton
import triton.language as tl

from .mx_tile import LN2, key_tiles_end, load_mx_tile, mx_round, online_softmax_step, program_rows


@triton.jit
def mx_attention_fwd_kernel(
    # Pointers: FP8 Q, K, V with their uint8 E8M0 scales (contiguous: data (heads, S, HEAD_DIM);
    # scales of Q, K (heads, S, HEAD_DIM / 32), of V (heads, ceil(S_K / 32), HEAD_DIM)); the
    # output O (heads, S_Q, HEAD_DIM) and the fp32 logsumexp (heads, S_Q), natural log, written
    # only when STORE_LSE; both contiguous.
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, v_ptr, v_scale_ptr, o_ptr, lse_ptr,
    # Sizes; the softmax scale times log2(e) (scores in base-2 units)
    S_Q, S_K, qk_scale,
    # Meta-parameters
    P_ELEM: tl.constexpr,  # element format and scale mode of P's rounding
    SCALE_MODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,  # also write logsumexp = m + log(l), what the backward needs
    DOT: tl.constexpr,  # MMA operand dtype: "bf16" ("fp32" under the interpreter)
    FP8_CVT_BF16: tl.constexpr,  # the target converts FP8 to bf16 in one instruction (sm100+)
    HEAD_DIM: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of SCALE_BLOCK
):  # fmt: skip
    # Phase 1: this program's query tile and head; the Q tile, expanded once.
    pid_m, head, offs_m, offs_d, mask_m = program_rows(S_Q, BLOCK_M, HEAD_DIM)
    q = load_mx_tile(q_ptr, q_scale_ptr, head, pid_m * BLOCK_M, S_Q, BLOCK_M, HEAD_DIM, SCALE_BLOCK, False, DOT)

    # Phase 2: online softmax over key tiles, in base 2 (running integer max exponent m_i,
    # denominator l_i, fp32 acc).
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    for n0 in range(0, key_tiles_end(S_K, pid_m, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # S = Q K^T, both along head_dim.
        k = load_mx_tile(k_ptr, k_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, False, DOT)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        # Keys past S_K are masked; rows past S_Q need not be (Q reads 0 there, and their
        # output and statistics are not stored): on sm100 ptxas selected each score twice when
        # they were (head_dim 128: 592 -> 560 loop instructions).
        valid = (offs_n < S_K)[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        # Softmax statistics with an integer running maximum: every rescale is an exact power
        # of two and P's largest value lies in (1/2, 1], so its MX rounding does not depend on
        # BLOCK_N.
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, True)
        # O = O * alpha + P V: P rounded along the keys, V along the keys.
        v = load_mx_tile(v_ptr, v_scale_ptr, head, n0, S_K, BLOCK_N, HEAD_DIM, SCALE_BLOCK, True, DOT)
        p = mx_round(p, BLOCK_M, BLOCK_N, SCALE_BLOCK, P_ELEM, SCALE_MODE, False, DOT, FP8_CVT_BF16)
        acc = tl.dot(p, v, acc * alpha[:, None])

    # Phase 3: normalise and store (a row that attended to no key gets 0, as in the CPU op).
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    o_ptrs = o_ptr + head * S_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])
    if STORE_LSE:
        # A row that attended to no key gets +inf (the backward then gives it P = 0).
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) * LN2, float("inf"))
        tl.store(lse_ptr + head * S_Q + offs_m, lse, mask=mask_m)
