"""The MX attention forward kernel (under the interpreter) against the CPU op's torch
implementation, `mxcompile.ops.attention_reference.attention_forward_impl` (the definition):
bit for bit, output and logsumexp, with the kernel's BLOCK_N equal to the op's key_tile and the
interpreter's exp2, log2, row sums and fp32 dots made torch's (`attention_exactness`).

Q and K are quantized along head_dim and V along the keys outside the kernel (the numerics
core); the kernel expands them and rounds P in registers. Cases: sequences 64-256, head_dim 64
and 128, causal and not, sequences that are not a multiple of the tiles, E5M2 with floor
scales (the saturating clamp of P's rounding)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import triton
import triton.language as tl

from attention_exactness import octave_operands, quantized, torch_primitives  # noqa: F401
from mxcompile.ops.attention_reference import AttentionOptions, attention_forward_impl
from mxcompile.numerics import dequantize_along
from mxcompile.triton_templates import mx_attention_triton
from mxcompile.triton_templates.attention import (
    DIRECT_FP8_CVT_CAPABILITY,
    SCALE_ALIGNMENT,
    aligned_scales,
    direct_fp8_cvt,
)
from mxcompile.triton_templates.loader import kernel_module

_TILE = None  # the interpreted `kernels/mx_tile.py`, which `_round_tile` calls (set by its test)


@pytest.mark.parametrize(
    "seq,head_dim,causal,key_tile,block_m,elem,scale_mode",
    [
        (64, 64, False, 32, 32, "e4m3", "rceil"),
        (96, 128, True, 64, 32, "e4m3", "rceil"),
        (160, 64, True, 64, 64, "e4m3", "rceil"),
        (256, 128, False, 128, 64, "e4m3", "rceil"),
        (96, 64, True, 64, 64, "e5m2", "floor"),
    ],
    ids=["s64-d64", "s96-d128-causal", "s160-d64-causal", "s256-d128", "s96-e5m2-floor-causal"],
)
def test_forward_bit_identical_to_the_cpu_op(
    torch_primitives, seq: int, head_dim: int, causal: bool, key_tile: int, block_m: int, elem: str,
    scale_mode: str,
) -> None:  # fmt: skip
    q, k, v, _ = octave_operands(1, 2, seq, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    options = AttentionOptions(causal, scale, "both", elem, scale_mode, 32, key_tile)
    ref_out, ref_lse = attention_forward_impl(q, k, v, None, options)
    operands = [*quantized(q, -1, elem, scale_mode), *quantized(k, -1, elem, scale_mode),
                *quantized(v, -2, elem, scale_mode)]  # fmt: skip
    out, lse = mx_attention_triton(
        *operands, sm_scale=scale, causal=causal, out_dtype=torch.float32, p_elem=elem,
        p_scale_mode=scale_mode, tiles={"BLOCK_M": block_m, "BLOCK_N": key_tile}, return_lse=True,
    )  # fmt: skip
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_attention_errors() -> None:
    q, qs = quantized(torch.randn(1, 32, 32), -1)
    k, ks = quantized(torch.randn(1, 64, 32), -1)
    v, vs = quantized(torch.randn(1, 64, 32), -2)
    with pytest.raises(ValueError, match="causal=True needs"):
        mx_attention_triton(q, qs, k, ks, v, vs, causal=True)
    with pytest.raises(ValueError, match="v_scale must be"):
        mx_attention_triton(q, qs, k, ks, v, ks, causal=False)


def _round_tile(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, ELEM: tl.constexpr,
                SCALE_MODE: tl.constexpr, SIGNED: tl.constexpr):  # fmt: skip
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, _TILE.mx_round(x, ROWS, COLS, 32, ELEM, SCALE_MODE, SIGNED, "fp32", False))


def _edge_rows(signed: bool) -> torch.Tensor:
    """Blocks of 32 (one row each): octave-spread values, tiny blocks whose scale byte is 0-8
    (results in fp32's subnormal range), a block at the top of fp32, zeros, an Inf block, a
    NaN block, and values just above the format's max times a power of two."""
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(4, 32, generator=g) * torch.logspace(-20, 20, 32, base=2.0)
    tiny = torch.rand(3, 32, generator=g) * torch.tensor([2.0**-120, 2.0**-126, 2.0**-133])[:, None]
    huge = torch.rand(1, 32, generator=g) * 2.0**127
    special = torch.zeros(3, 32)
    special[1, 5], special[2, 7] = float("inf"), float("nan")
    edge = torch.full((1, 32), 448.0 * 2.0**-3) * (1 + torch.arange(32) * 2.0**-9)
    rows = torch.cat([spread, tiny, huge, special, edge])
    return rows if signed else rows.abs()


@pytest.mark.parametrize("elem,scale_mode,signed", [("e4m3", "rceil", False), ("e4m3", "rceil", True),
                                                    ("e4m3", "floor", True), ("e5m2", "even", True)])
def test_mx_round_in_registers_matches_the_numerics_core(elem: str, scale_mode: str, signed: bool) -> None:
    """`mx_round` (P and dS rounded in registers) against the quantizer's dequantized values,
    bit for bit, NaN where they are NaN: one block per row, a 2 x 32 tile of blocks per launch."""
    global _TILE
    _TILE = kernel_module("mx_tile", interpret=True)
    kernel = triton.jit(_round_tile)
    x = _edge_rows(signed)
    x = torch.cat([x, torch.zeros(16 - x.shape[0], 32)]).reshape(8, 64)  # rows of two blocks
    out = torch.empty_like(x)
    kernel[(1,)](x, out, ROWS=8, COLS=64, ELEM=elem, SCALE_MODE=scale_mode, SIGNED=signed)
    ref = dequantize_along(*quantized(x, -1, elem, scale_mode), 1, 32, torch.float32)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_gpu_rounding_moves_the_fp8_value_under_bf16s_exponent_exactly(elem: str) -> None:
    """The integer step of `mx_round`'s GPU path for P (`_round_unsigned_asm`, which the CPU
    cannot run): a non-negative FP8 value converted to f16 (the asm's cvt.rn.f16x2, exact),
    two of them in one 32-bit word whose bits are shifted right by the asm's shift, each half
    read as bf16, times bf16 2**(scale - F16_EXPONENT_BIAS) equals the element's value times
    2**scale rounded to bf16 (what the signed path's conversion and multiply give), for every
    byte and every scale byte up to 127 + F16_EXPONENT_BIAS (P's are below 127). ~0.1 s."""
    tile = kernel_module("mx_tile", interpret=True)
    asm = tile._round_unsigned_asm(elem)
    assert f"cvt.rn.f16x2.{elem}x2" in asm
    shift = int(re.search(r"shr\.b32 w, w, (\d+);", asm).group(1))
    fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem]
    bias = int(tile.F16_EXPONENT_BIAS)
    values = torch.arange(128, dtype=torch.uint8).view(fp8).float()
    finite = values.isfinite()
    # Each value in the low half of a word beside another value in the high half (its own
    # bits would cross into the low half's top bits if they were not 0), shifted as one int32.
    halves = values.nan_to_num().half().view(torch.int16).to(torch.int32) & 0xFFFF
    words = halves | (halves.flip(0) << 16)
    low = (words >> shift) & 0xFFFF
    high = (words >> (16 + shift)) & 0xFFFF
    shifted = torch.stack([low, high.flip(0)]).to(torch.int16).view(torch.bfloat16)
    scales = torch.arange(0, 128 + bias)
    factor = torch.pow(2.0, (scales - bias).double()).to(torch.bfloat16)
    want = (values[None, :] * torch.pow(2.0, (scales - 127).double()).float()[:, None]).to(torch.bfloat16)
    for half in shifted:
        got = half[None, :] * factor[:, None]
        assert torch.equal(got[:, finite].view(torch.int16), want[:, finite].view(torch.int16))


def test_the_direct_fp8_conversion_is_taken_from_the_target() -> None:
    """`direct_fp8_cvt` (the kernels' FP8_CVT_BF16): a compile target's capability when given,
    sm100 and later; without one, False off CUDA (meta tensors, the CPU). ~0.01 s."""
    meta = torch.device("meta")
    assert direct_fp8_cvt(meta, DIRECT_FP8_CVT_CAPABILITY)
    assert not direct_fp8_cvt(meta, 90)
    assert not direct_fp8_cvt(meta, None) and not direct_fp8_cvt(torch.device("cpu"), None)


def test_scales_at_an_odd_address_are_copied_to_an_aligned_one() -> None:
    """`aligned_scales`: the kernels read scales along the rows two bytes at a time on a GPU;
    a view at an odd offset is copied, an aligned tensor passed as it is. ~0.01 s."""
    buffer = torch.arange(65, dtype=torch.uint8)
    odd = buffer[1:]
    assert odd.data_ptr() % SCALE_ALIGNMENT
    copied = aligned_scales(odd)
    assert copied.data_ptr() % SCALE_ALIGNMENT == 0 and torch.equal(copied, odd)
    assert aligned_scales(buffer) is buffer


def _column_pairs_tile(ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, VALID_ROWS: tl.constexpr):
    offs_rows = tl.arange(0, ROWS)
    even, odd = _TILE.load_column_pairs(ptr, offs_rows, (offs_rows < VALID_ROWS)[:, None], COLS)
    offsets = offs_rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + offsets, _TILE.join_column_pairs(even, odd))


def test_scales_along_the_rows_read_in_column_pairs_keep_their_columns() -> None:
    """How the GPU path of `load_mx_tile` reads scales along the rows (two bytes per 16-bit
    load, the factors of the even and odd columns joined back): every byte, 0-255 included,
    lands in its own column, masked rows read 0. The interpreter runs these helpers (not the
    inline assembly between them). ~0.5 s."""
    global _TILE
    _TILE = kernel_module("mx_tile", interpret=True)
    kernel = triton.jit(_column_pairs_tile)
    scales = torch.arange(4 * 128, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(4, 128)
    out = torch.empty(4, 128, dtype=torch.int32)
    kernel[(1,)](scales, out, ROWS=4, COLS=128, VALID_ROWS=3)
    assert torch.equal(out[:3], scales[:3].to(torch.int32))
    assert not out[3].any()


@pytest.mark.slow  # ~7 s on 2 cores with a cold Triton cache (one compile for sm100)
def test_the_sm100_forward_turns_p_back_into_bf16_in_one_conversion() -> None:
    """Compiled ahead of time for sm100, the forward's P rounding takes that target's path
    (FP8_CVT_BF16, from the compile target): the one-instruction FP8 -> bf16 conversion and
    packed fp32 multiplies, not sm90's f16 conversion and 3-bit shift (`_round_unsigned_asm`,
    which the sm90 compiles of tests/triton_templates/test_attention_spills.py take)."""
    from mxcompile.triton_templates.aot import compile_launch
    from mxcompile.triton_templates.kernel_static import launchers

    capability = DIRECT_FP8_CVT_CAPABILITY
    name, launch = launchers(64, causal=False, capability=capability)["mx_attention_fwd"]
    (kernel,) = compile_launch(lambda wrap: launch({"BLOCK_M": 128, "BLOCK_N": 64}, wrap), capability,
                               num_warps=8, num_stages=3, only=name)  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "mul.rn.f32x2" in ptx and "cvt.rn.bf16x2.e4m3x2" in ptx
    assert "shr.b32 w, w, 3" not in ptx
