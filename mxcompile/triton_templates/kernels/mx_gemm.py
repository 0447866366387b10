"""MX GEMM kernel with fused epilogues: C = epilogue(A @ B), A (M, K) and B (K, N) MX-quantized
along K. See `mxcompile/triton_templates/mx_gemm.py` for the paths, the epilogue ops and the
reference."""

import triton
import triton.language as tl

from .mx_tile import E8M0_NAN, E8M0_ONE, expansion_scale, quantize_blocks, scale_fp32

# GELU constants: tanh form sqrt(2/pi) and its cubic coefficient; erf form 1/sqrt(2).
GELU_TANH_SCALE: tl.constexpr = tl.constexpr(0.7978845608028654)
GELU_TANH_CUBIC: tl.constexpr = tl.constexpr(0.044715)
SQRT1_2: tl.constexpr = tl.constexpr(0.7071067811865476)


# EPILOGUE is a comma-separated string (a plain string constexpr, which torch's triton_op
# tracing and Inductor's kernel calls carry as they are); these read it at specialisation.
@triton.constexpr_function
def epilogue_length(epilogue):
    return len(epilogue.split(",")) if epilogue else 0


@triton.constexpr_function
def epilogue_op(epilogue, index):
    return epilogue.split(",")[index]


@triton.jit
def _apply_epilogue_op(
    acc, OP: tl.constexpr, offs_m, offs_n, mask_m, mask_n,
    bias_ptr, stride_bias, mul_ptr, stride_mulm, stride_muln,
    residual_ptr, stride_resm, stride_resn,
):  # fmt: skip
    """One epilogue op on the fp32 tile `acc` (BLOCK_M, BLOCK_N)."""
    if OP == "bias":
        # Bias add (one value per output column).
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    elif OP == "gelu_tanh":
        # GELU, tanh approximation; 1 + tanh(u) = 2 / (1 + exp(-2u)).
        inner = GELU_TANH_SCALE * (acc + GELU_TANH_CUBIC * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * inner))
    elif OP == "gelu_erf":
        # GELU, exact form 0.5 * x * (1 + erf(x / sqrt(2))).
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * SQRT1_2))
    elif OP == "silu":
        # SiLU, x * sigmoid(x).
        acc = acc / (1.0 + tl.exp(-acc))
    elif OP == "mul":
        # Elementwise product with a second tensor (the SwiGLU gate product).
        mul_ptrs = mul_ptr + offs_m[:, None] * stride_mulm + offs_n[None, :] * stride_muln
        mask = mask_m[:, None] & mask_n[None, :]
        acc = acc * tl.load(mul_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        tl.static_assert(OP == "residual", "epilogue ops: see mx_gemm.EPILOGUE_OPS")
        # Residual add.
        res_ptrs = residual_ptr + offs_m[:, None] * stride_resm + offs_n[None, :] * stride_resn
        mask = mask_m[:, None] & mask_n[None, :]
        acc = acc + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of C for this program: the 1-D program id walks GROUP_M tile
    rows column by column, so that consecutive programs share A and B tiles in L2 (the Triton
    matmul tutorial's ordering)."""
    pid = tl.program_id(axis=0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = (first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group).to(tl.int64)
    pid_n = ((pid % (GROUP_M * tiles_n)) // rows_in_group).to(tl.int64)
    return pid_m, pid_n


@triton.jit
def _operand_tiles(
    a_ptr, b_ptr, offs_m, offs_n, offs_k, mask_m, mask_n, K,
    stride_am, stride_ak, stride_bk, stride_bn,
):  # fmt: skip
    """The A tile (rows offs_m, columns offs_k) and the B tile (rows offs_k, columns offs_n)
    by masked pointer loads; elements outside the operands read as 0."""
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
        mask=mask_m[:, None] & mask_k[None, :], other=0.0,
    )
    b = tl.load(
        b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
        mask=mask_k[:, None] & mask_n[None, :], other=0.0,
    )
    return a, b


@triton.jit
def expand_bf16(data, scale):
    """The bf16 values of FP8 `data` times bf16 powers of two `scale` (`expansion_scale(..., "bf16")`,
    broadcast against it), exact: an FP8 value is a bf16, and so is its product with a power of two,
    unless the product's last bit falls below bf16's smallest subnormal 2**-133 (scale bytes
    below 3 for e4m3, below 10 for e5m2) or it overflows, as the fp32 product would. One packed
    bf16 multiply per two elements on sm90 (the interpreter needs `interpreter_bf16_arithmetic`)."""
    return data.to(tl.bfloat16) * scale


@triton.jit
def mx_mm_kernel(
    # Pointers: FP8 operands and their uint8 E8M0 scales; the output C; epilogue operands;
    # the MX-quantized output (FP8 data as uint8, contiguous; uint8 scales, contiguous).
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    bias_ptr, mul_ptr, residual_ptr, q_data_ptr, q_scale_ptr,
    # With USE_TMA, tensor descriptors of the FP8 operands, read instead of a_ptr and b_ptr:
    # A (M, K) in (BLOCK_M, BLOCK_K) boxes; B (K, N) in (BLOCK_K, BLOCK_N) boxes, or, with
    # B_DESC_TRANSPOSED, B's memory as (N, K) (a linear layer's weight) in (BLOCK_N, BLOCK_K).
    a_desc, b_desc,
    # Sizes
    M, N, K,
    # Strides (elements)
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bk, stride_bn, stride_bsk, stride_bsn,
    stride_cm, stride_cn,
    stride_bias, stride_mulm, stride_muln, stride_resm, stride_resn,
    # Meta-parameters
    A_ELEM: tl.constexpr,  # element formats of A and B, "e4m3" or "e5m2"
    B_ELEM: tl.constexpr,
    EPILOGUE: tl.constexpr,  # ops applied in order, comma-separated ("" for none)
    OUT_ELEM: tl.constexpr,  # format, scale mode and cast of the MX-quantized output
    OUT_SCALE_MODE: tl.constexpr,
    CAST: tl.constexpr,
    # "dot_scaled": tl.dot_scaled per K tile; per scale block of K, "expand_bf16": the FP8 tiles
    # expanded exactly to bf16, one bf16 tl.dot; "fp8_per_block": one FP8 tl.dot, scaled in fp32
    MAIN_LOOP: tl.constexpr,
    USE_TMA: tl.constexpr,  # dot_scaled path: operand tiles through a_desc / b_desc (TMA)
    B_DESC_TRANSPOSED: tl.constexpr,
    STORE_C: tl.constexpr,  # store C in c_ptr's dtype
    QUANTIZE_OUT: tl.constexpr,  # store C MX-quantized along N (needs BLOCK_N % SCALE_BLOCK == 0)
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of SCALE_BLOCK
    GROUP_M: tl.constexpr,
):  # fmt: skip
    # Phase 1: this program's C tile.
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_blocks = K // SCALE_BLOCK

    # Phase 2: main loop over K; fp32 accumulator. K is a multiple of SCALE_BLOCK, so masked
    # lanes are whole scale blocks: data 0, scale byte E8M0_ONE (1.0), contributing exactly 0.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # expand_bf16: the rows of A and columns of B with a NaN block (scale byte 255).
    nan_rows = offs_m < 0
    nan_cols = offs_n < 0
    for k0 in range(0, K, BLOCK_K):
        if MAIN_LOOP == "dot_scaled":
            if USE_TMA:
                # Whole tiles copied by the tensor memory accelerator; elements outside the
                # operand read as 0, as the masked loads below give them.
                a = a_desc.load([(pid_m * BLOCK_M).to(tl.int32), k0])
                if B_DESC_TRANSPOSED:
                    b = b_desc.load([(pid_n * BLOCK_N).to(tl.int32), k0]).T
                else:
                    b = b_desc.load([k0, (pid_n * BLOCK_N).to(tl.int32)])
            else:
                a, b = _operand_tiles(
                    a_ptr, b_ptr, offs_m, offs_n, k0 + tl.arange(0, BLOCK_K), mask_m, mask_n, K,
                    stride_am, stride_ak, stride_bk, stride_bn,
                )  # fmt: skip
            offs_kb = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
            mask_kb = offs_kb < k_blocks
            a_scale = tl.load(
                a_scale_ptr + offs_m[:, None] * stride_asm + offs_kb[None, :] * stride_ask,
                mask=mask_m[:, None] & mask_kb[None, :], other=E8M0_ONE,
            )
            # dot_scaled takes B's scales as (BLOCK_N, BLOCK_K // 32): load them transposed.
            b_scale = tl.load(
                b_scale_ptr + offs_n[:, None] * stride_bsn + offs_kb[None, :] * stride_bsk,
                mask=mask_n[:, None] & mask_kb[None, :], other=E8M0_ONE,
            )
            acc = tl.dot_scaled(a, a_scale, A_ELEM, b, b_scale, B_ELEM, acc)
        else:
            tl.static_assert(MAIN_LOOP == "expand_bf16" or MAIN_LOOP == "fp8_per_block",
                             "MAIN_LOOP: dot_scaled, expand_bf16 or fp8_per_block")
            # One scale block of K at a time: A's scales are a column vector over its rows, B's
            # a row vector over its columns.
            for kk in tl.static_range(0, BLOCK_K, SCALE_BLOCK):
                a, b = _operand_tiles(
                    a_ptr, b_ptr, offs_m, offs_n, k0 + kk + tl.arange(0, SCALE_BLOCK), mask_m, mask_n, K,
                    stride_am, stride_ak, stride_bk, stride_bn,
                )  # fmt: skip
                kb = (k0 + kk) // SCALE_BLOCK
                # The block index as vectors (the interpreter rejects a scalar term in a mask).
                kb_m = offs_m * 0 + kb
                kb_n = offs_n * 0 + kb
                a_scale = tl.load(
                    a_scale_ptr + offs_m * stride_asm + kb_m * stride_ask,
                    mask=mask_m & (kb_m < k_blocks), other=E8M0_ONE,
                )
                b_scale = tl.load(
                    b_scale_ptr + kb_n * stride_bsk + offs_n * stride_bsn,
                    mask=mask_n & (kb_n < k_blocks), other=E8M0_ONE,
                )
                if MAIN_LOOP == "expand_bf16":
                    # Hopper has no MX tensor cores: the block's exact bf16 values, multiplied
                    # by a bf16 MMA (wgmma on sm90) that accumulates in fp32. A scale byte 255
                    # (NaN) expands to +inf: its rows and columns are made NaN after the loop
                    # (a select per scale would be repeated for every element the scale
                    # multiplies: compiled for sm90, 16% of the K loop).
                    nan_rows |= a_scale == E8M0_NAN
                    nan_cols |= b_scale == E8M0_NAN
                    a16 = expand_bf16(a, expansion_scale(a_scale, "bf16")[:, None])
                    b16 = expand_bf16(b, expansion_scale(b_scale, "bf16")[None, :])
                    acc = tl.dot(a16, b16, acc, out_dtype=tl.float32)
                else:
                    partial = tl.dot(a, b, out_dtype=tl.float32)
                    acc += (partial * scale_fp32(a_scale)[:, None]) * scale_fp32(b_scale)[None, :]

    if MAIN_LOOP == "expand_bf16":
        # A NaN block makes its row (of A) or column (of B) of C NaN, as in the reference.
        acc = tl.where(nan_rows[:, None] | nan_cols[None, :], float("nan"), acc)

    # Phase 3: fused epilogue, in fp32, the ops in the order EPILOGUE lists them.
    for i in tl.static_range(epilogue_length(EPILOGUE)):
        acc = _apply_epilogue_op(
            acc, epilogue_op(EPILOGUE, i), offs_m, offs_n, mask_m, mask_n,
            bias_ptr, stride_bias, mul_ptr, stride_mulm, stride_muln,
            residual_ptr, stride_resm, stride_resn,
        )  # fmt: skip

    # Phase 4: cast to C's dtype and store C and/or its MX-quantized copy.
    out = acc.to(c_ptr.dtype.element_ty)
    mask = mask_m[:, None] & mask_n[None, :]
    if STORE_C:
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, out, mask=mask)
    if QUANTIZE_OUT:
        blocks = tl.reshape(out.to(tl.float32), (BLOCK_M, BLOCK_N // SCALE_BLOCK, SCALE_BLOCK))
        data, scale = quantize_blocks(blocks, 2, OUT_ELEM, OUT_SCALE_MODE, CAST)
        tl.store(
            q_data_ptr + offs_m[:, None] * N + offs_n[None, :],
            tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask,
        )
        offs_sn = pid_n * (BLOCK_N // SCALE_BLOCK) + tl.arange(0, BLOCK_N // SCALE_BLOCK)
        tl.store(
            q_scale_ptr + offs_m[:, None] * (N // SCALE_BLOCK) + offs_sn[None, :], scale,
            mask=mask_m[:, None] & (offs_sn < N // SCALE_BLOCK)[None, :],
        )


@triton.jit
def bf16_mm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """C = A @ B of bf16 operands, one `tl.dot` per K tile with fp32 accumulation: the plain bf16
    GEMM the MX GEMM's compiled code is compared with (`kernel_static.py`), same tiles and
    tile order, not used by the backend."""
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, b = _operand_tiles(
            a_ptr, b_ptr, offs_m, offs_n, k0 + tl.arange(0, BLOCK_K), mask_m, mask_n, K,
            stride_am, stride_ak, stride_bk, stride_bn,
        )  # fmt: skip
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    mask = mask_m[:, None] & mask_n[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
