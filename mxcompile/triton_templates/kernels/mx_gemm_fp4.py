"""FP4 GEMM kernel (MXFP4 and NVFP4): C = (A @ B) * (S_dec(A) * S_dec(B)), A (M, K) and B (K, N)
E2M1 codes packed two per byte along K. See `mxcompile/triton_templates/mx_gemm_fp4.py` for
the paths, the exactness argument and the reference."""

import triton
import triton.language as tl

from .mx_gemm import _program_tile
from .mx_tile import E8M0_NAN, E8M0_ONE, expansion_scale

# E2M1 code bits: sign (bit 3), then a 3-bit magnitude, exponent field (2 bits) and mantissa bit.
E2M1_SIGN: tl.constexpr = tl.constexpr(0x8)
E2M1_MAGNITUDE: tl.constexpr = tl.constexpr(0x7)
NIBBLE_BITS: tl.constexpr = tl.constexpr(4)
NIBBLE_MASK: tl.constexpr = tl.constexpr(0xF)
# E2M1's magnitude bits (exponent field, mantissa bit) shifted to bf16's (7 mantissa bits, the
# E2M1 mantissa bit on top) and its sign bit 3 to bf16's bit 15; the value those bits hold is
# the E2M1 value times 2**-126 (`e2m1_bf16`).
E2M1_BF16_SHIFT: tl.constexpr = tl.constexpr(6)
BF16_SIGN_SHIFT: tl.constexpr = tl.constexpr(12)
E2M1_BF16_UNIT: tl.constexpr = tl.constexpr(2.0**126)
# The E4M3 scale byte of 1.0 (masked lanes) and the E4M3 NaN magnitude (S.1111.111).
E4M3_ONE: tl.constexpr = tl.constexpr(0x38)
E4M3_NAN_MAGNITUDE: tl.constexpr = tl.constexpr(0x7F)


@triton.constexpr_function
def scale_one_byte(scale_format):
    """The scale byte of 1.0 in `scale_format` ("e8m0" or "e4m3")."""
    return E8M0_ONE if scale_format == "e8m0" else E4M3_ONE


@triton.jit
def e2m1_bf16(codes):
    """The bf16 values of E2M1 codes (the low nibble of each uint8), exact. The 3 magnitude bits
    placed at the bottom of bf16's exponent field and top of its mantissa are the bf16 value
    2**-126 times the E2M1 magnitude, subnormal 0.5 included (exponent field 0 is subnormal in
    both); one exact multiply by 2**126 gives the value."""
    c = codes.to(tl.int16)
    bits = ((c & E2M1_MAGNITUDE) << E2M1_BF16_SHIFT) | ((c & E2M1_SIGN) << BF16_SIGN_SHIFT)
    return bits.to(tl.bfloat16, bitcast=True) * E2M1_BF16_UNIT


@triton.jit
def unpack_rows(packed):
    """(R, C) bytes -> (R, 2C) codes: byte j's low nibble is element 2j, its high nibble 2j + 1."""
    pairs = tl.join(packed & NIBBLE_MASK, packed >> NIBBLE_BITS)
    return tl.reshape(pairs, (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def unpack_columns(packed):
    """(R, C) bytes packed along rows -> (2R, C) codes: row 2i from the low nibbles of row i."""
    pairs = tl.permute(tl.join(packed & NIBBLE_MASK, packed >> NIBBLE_BITS), (0, 2, 1))
    return tl.reshape(pairs, (2 * packed.shape[0], packed.shape[1]))


@triton.jit
def block_scale_bf16(scale_bytes, SCALE_FORMAT: tl.constexpr):
    """bf16 values of block scale bytes: E8M0 powers of two (`expansion_scale`; 255 gives +inf,
    the caller makes its rows NaN) or E4M3 values (exact in bf16; NaN stays NaN)."""
    if SCALE_FORMAT == "e8m0":
        return expansion_scale(scale_bytes, "bf16")
    else:
        return scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def nan_scale(scale_bytes, SCALE_FORMAT: tl.constexpr):
    """Whether each scale byte is NaN (E8M0 0xFF, E4M3 S.1111.111)."""
    if SCALE_FORMAT == "e8m0":
        return scale_bytes == E8M0_NAN
    else:
        return (scale_bytes & E4M3_NAN_MAGNITUDE) == E4M3_NAN_MAGNITUDE


@triton.jit
def _tile_rows_columns(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows and columns of C this program computes (`_program_tile`), and their masks."""
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def fp4_mm_kernel(
    # Pointers: packed E2M1 operands (uint8), their uint8 scale bytes, their 0-d fp32 tensor
    # decode scales S_dec; the output C.
    a_ptr, a_scale_ptr, a_decode_ptr, b_ptr, b_scale_ptr, b_decode_ptr, c_ptr,
    # Sizes, in elements (K: unpacked; a multiple of SCALE_BLOCK)
    M, N, K,
    # Strides (A and B: in bytes of the packed tensors; scales: in bytes)
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bk, stride_bn, stride_bsk, stride_bsn,
    stride_cm, stride_cn,
    # Meta-parameters
    SCALE_FORMAT: tl.constexpr,  # "e8m0" (MXFP4, SCALE_BLOCK 32) or "e4m3" (NVFP4, SCALE_BLOCK 16)
    SCALE_BLOCK: tl.constexpr,
    # "dot_scaled": tl.dot_scaled on e2m1 tiles per K tile; "expand_bf16": per scale block, the
    # codes unpacked and scaled exactly in bf16, one bf16 tl.dot
    MAIN_LOOP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of SCALE_BLOCK, in elements
    GROUP_M: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, mask_m, mask_n = _tile_rows_columns(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_bytes = K // 2
    k_blocks = K // SCALE_BLOCK
    # Masked lanes are whole scale blocks: codes 0 (+0) and a scale of 1.0, contributing 0.
    tl.static_assert(SCALE_FORMAT == "e8m0" or SCALE_FORMAT == "e4m3", "SCALE_FORMAT: e8m0 or e4m3")
    scale_one: tl.constexpr = scale_one_byte(SCALE_FORMAT)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    nan_rows = offs_m < 0
    nan_cols = offs_n < 0
    for k0 in range(0, K, BLOCK_K):
        if MAIN_LOOP == "dot_scaled":
            offs_kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            mask_kp = offs_kp < k_bytes
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_kp[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_kp[None, :], other=0)
            b = tl.load(b_ptr + offs_kp[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=mask_kp[:, None] & mask_n[None, :], other=0)
            offs_kb = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
            mask_kb = offs_kb < k_blocks
            a_scale = tl.load(a_scale_ptr + offs_m[:, None] * stride_asm + offs_kb[None, :] * stride_ask,
                              mask=mask_m[:, None] & mask_kb[None, :], other=scale_one)
            # dot_scaled takes B's scales as (BLOCK_N, BLOCK_K // SCALE_BLOCK).
            b_scale = tl.load(b_scale_ptr + offs_n[:, None] * stride_bsn + offs_kb[None, :] * stride_bsk,
                              mask=mask_n[:, None] & mask_kb[None, :], other=scale_one)
            if SCALE_FORMAT == "e4m3":
                a_scale = a_scale.to(tl.float8e4nv, bitcast=True)
                b_scale = b_scale.to(tl.float8e4nv, bitcast=True)
            acc = tl.dot_scaled(a, a_scale, "e2m1", b, b_scale, "e2m1", acc)
        else:
            tl.static_assert(MAIN_LOOP == "expand_bf16", "MAIN_LOOP: dot_scaled or expand_bf16")
            for kk in tl.static_range(0, BLOCK_K, SCALE_BLOCK):
                offs_kp = (k0 + kk) // 2 + tl.arange(0, SCALE_BLOCK // 2)
                mask_kp = offs_kp < k_bytes
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_kp[None, :] * stride_ak,
                            mask=mask_m[:, None] & mask_kp[None, :], other=0)
                b = tl.load(b_ptr + offs_kp[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                            mask=mask_kp[:, None] & mask_n[None, :], other=0)
                kb = (k0 + kk) // SCALE_BLOCK
                # The block index as vectors (the interpreter rejects a scalar term in a mask).
                kb_m = offs_m * 0 + kb
                kb_n = offs_n * 0 + kb
                a_scale = tl.load(a_scale_ptr + offs_m * stride_asm + kb_m * stride_ask,
                                  mask=mask_m & (kb_m < k_blocks), other=scale_one)
                b_scale = tl.load(b_scale_ptr + kb_n * stride_bsk + offs_n * stride_bsn,
                                  mask=mask_n & (kb_n < k_blocks), other=scale_one)
                nan_rows |= nan_scale(a_scale, SCALE_FORMAT)
                nan_cols |= nan_scale(b_scale, SCALE_FORMAT)
                # Block values q * s, exact in bf16 (mx_gemm_fp4's docstring); the MMA
                # accumulates their products in fp32 (wgmma on sm90).
                a16 = e2m1_bf16(unpack_rows(a)) * block_scale_bf16(a_scale, SCALE_FORMAT)[:, None]
                b16 = e2m1_bf16(unpack_columns(b)) * block_scale_bf16(b_scale, SCALE_FORMAT)[None, :]
                acc = tl.dot(a16, b16, acc, out_dtype=tl.float32)
    # The tensor scales, as the reference applies them: the fp32 product times
    # fp32(S_dec(A) * S_dec(B)) (1.0 for MXFP4).
    acc = acc * (tl.load(a_decode_ptr) * tl.load(b_decode_ptr))
    if MAIN_LOOP == "expand_bf16":
        # A NaN block makes its row (of A) or column (of B) of C NaN, as in the reference.
        acc = tl.where(nan_rows[:, None] | nan_cols[None, :], float("nan"), acc)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)
