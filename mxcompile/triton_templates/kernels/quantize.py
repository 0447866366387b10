"""MX quantize kernel: one read of a 2-D high-precision tensor writes its row-wise (blocks along
the last axis) and/or column-wise (blocks along the first axis) MX copies."""

import triton
import triton.language as tl

from .mx_tile import quantize_blocks


@triton.jit
def mx_quantize_kernel(
    # Pointers: the input, then row-wise and column-wise outputs (contiguous, FP8 data as uint8).
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    # Sizes
    M, N,
    # Strides of the input (elements); the outputs are contiguous.
    stride_xm, stride_xn,
    # Meta-parameters
    ELEM: tl.constexpr,  # element format of both copies, "e4m3" or "e5m2"
    SCALE_MODE: tl.constexpr,  # a mxcompile.numerics.ScaleMode value
    CAST: tl.constexpr,  # fp32 -> FP8 cast: "software" or "hardware"
    X_BF16_BITS: tl.constexpr,  # x_ptr holds bf16 as int16 bit patterns
    ROWWISE: tl.constexpr,  # write data (M, N) and scales (M, N // SCALE_BLOCK)
    COLWISE: tl.constexpr,  # write data (M, N) and scales (M // SCALE_BLOCK, N)
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Phase 1: this program's tile; 64-bit offsets so tensors of >= 2**31 elements work.
    pid_m = tl.program_id(axis=0).to(tl.int64)
    pid_n = tl.program_id(axis=1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]

    # Phase 2: the one read of the input. Masked lanes read 0: the quantized axis is a multiple
    # of SCALE_BLOCK, so a block lies wholly inside or wholly outside the tensor.
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    x = tl.load(x_ptrs, mask=mask, other=0)
    if X_BF16_BITS:
        # bf16 -> fp32 is a 16-bit shift of the bits: exact for every value. (The Triton 3.9
        # interpreter's bf16 upcast mangles subnormals; on a GPU this is what cvt does.)
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    data_offsets = offs_m[:, None] * N + offs_n[None, :]

    # Phase 3: row-wise copy, blocks of SCALE_BLOCK consecutive columns.
    if ROWWISE:
        blocks = tl.reshape(x, (BLOCK_M, BLOCK_N // SCALE_BLOCK, SCALE_BLOCK))
        data, scale = quantize_blocks(blocks, 2, ELEM, SCALE_MODE, CAST)
        tl.store(row_data_ptr + data_offsets, tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask)
        offs_sn = pid_n * (BLOCK_N // SCALE_BLOCK) + tl.arange(0, BLOCK_N // SCALE_BLOCK)
        scale_ptrs = row_scale_ptr + offs_m[:, None] * (N // SCALE_BLOCK) + offs_sn[None, :]
        tl.store(scale_ptrs, scale, mask=mask_m[:, None] & (offs_sn < N // SCALE_BLOCK)[None, :])

    # Phase 4: column-wise copy, blocks of SCALE_BLOCK consecutive rows.
    if COLWISE:
        blocks = tl.reshape(x, (BLOCK_M // SCALE_BLOCK, SCALE_BLOCK, BLOCK_N))
        data, scale = quantize_blocks(blocks, 1, ELEM, SCALE_MODE, CAST)
        tl.store(col_data_ptr + data_offsets, tl.reshape(data, (BLOCK_M, BLOCK_N)), mask=mask)
        offs_sm = pid_m * (BLOCK_M // SCALE_BLOCK) + tl.arange(0, BLOCK_M // SCALE_BLOCK)
        scale_ptrs = col_scale_ptr + offs_sm[:, None] * N + offs_n[None, :]
        tl.store(scale_ptrs, scale, mask=(offs_sm < M // SCALE_BLOCK)[:, None] & mask_n[None, :])
