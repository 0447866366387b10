"""The FP4 GEMM kernel (`mx_gemm_fp4`: MXFP4 and NVFP4, paths dot_scaled and expand_bf16) under
the Triton interpreter, against `mxcompile::mx_mm_fp4`'s CPU implementation (numerics-core
dequantize of the packed bytes, fp32 matmul, times fp32(S_dec(a) * S_dec(b))).

Bit-identical on operands whose products and partial sums are all exact in fp32 (module
`_exact_operands`), so that no summation order can change a bit: a wrong nibble order, scale
index, scale decoding, bf16 rounding or tensor-scale order shows as a mismatch. Compared with
`torch.equal` (so +0 and -0 are equal: a sum of zeros may take either sign) and NaN positions.
"""

from __future__ import annotations

import re

import pytest
import torch

from mxcompile.numerics.e2m1 import E2M1_VALUES, pack_e2m1
from mxcompile.numerics.formats import block_format
from mxcompile.ops.mx_mm import MX_MM_FP4, mx_mm_fp4_cuda
from mxcompile.triton_templates.mx_gemm_fp4 import FP4_GEMM_PATHS, fp4_mm_launch

TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
FORMATS = ["mxfp4", "nvfp4"]
E2M1_ONE_CODE = 0b0010
# E4M3 scale bytes with at most 3 significant bits: 0.5, 0.75, 1, 1.25, 1.5, 2 (multiples of 2**-2).
E4M3_EXACT_SCALES = (0x30, 0x34, 0x38, 0x3A, 0x3C, 0x40)
E8M0_EXACT_SCALES = (125, 126, 127, 128, 129)  # 2**-2 .. 2**2
NVFP4_TENSOR_DECODES = (0.0123, 3.7)  # arbitrary fp32: their product rounds once, as in the reference


def _scales(shape: tuple[int, int], fmt: str, g: torch.Generator) -> torch.Tensor:
    table = torch.tensor(E8M0_EXACT_SCALES if fmt == "mxfp4" else E4M3_EXACT_SCALES, dtype=torch.uint8)
    return table[torch.randint(0, len(table), shape, generator=g)]


def _decodes(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    values = NVFP4_TENSOR_DECODES if fmt == "nvfp4" else (1.0, 1.0)
    return tuple(torch.tensor(v, dtype=torch.float32) for v in values)  # type: ignore[return-value]


def _exact_operands(m: int, n: int, k: int, fmt: str, seed: int):
    """Packed operands whose products and sums are exact in fp32: every E2M1 code (both zeros
    included), scales from E8M0_EXACT_SCALES / E4M3_EXACT_SCALES varying along rows, columns and
    K. Block values are multiples of 2**-3 of magnitude <= 24, products multiples of 2**-6 of
    magnitude <= 576: sums over K <= 256 stay below 2**24 units of 2**-6."""
    block = block_format(fmt).block_size
    g = torch.Generator().manual_seed(seed)
    a_codes = torch.randint(0, 16, (m, k), generator=g, dtype=torch.uint8)
    b_codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.uint8)
    a_scale = _scales((m, k // block), fmt, g)
    b_scale = _scales((k // block, n), fmt, g)
    a_decode, b_decode = _decodes(fmt)
    return pack_e2m1(a_codes, axis=1), a_scale, a_decode, pack_e2m1(b_codes, axis=0), b_scale, b_decode


def _kernel(operands, fmt: str, path: str, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    a, sa, da, b, sb, db = operands
    return fp4_mm_launch(a, sa, da, b, sb, db, block_format=fmt, out_dtype=out_dtype, path=path, tiles=TILES,
                         interpret=True)


def _assert_same(c: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(c.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(c), torch.nan_to_num(ref))


@pytest.mark.parametrize("path", FP4_GEMM_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_identical_to_the_reference(fmt: str, path: str) -> None:
    """M, N not multiples of the 32x32 tile; K=80 (NVFP4) or 96 (MXFP4) not a multiple of
    BLOCK_K=64: the last K tile holds whole blocks and masked ones (codes 0, scale 1)."""
    k = 96 if fmt == "mxfp4" else 80
    operands = _exact_operands(40, 72, k, fmt, seed=k)
    c = _kernel(operands, fmt, path)
    ref = MX_MM_FP4(*operands, fmt, torch.float32)
    assert c.shape == (40, 72) and (ref != 0).float().mean() > 0.9
    _assert_same(c, ref)


@pytest.mark.parametrize("path", FP4_GEMM_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_smallest_and_nan_scales_as_the_reference(fmt: str, path: str) -> None:
    """A NaN scale byte (E8M0 0xFF; E4M3 0x7F) makes its row of A / column of B NaN; the
    smallest scale (E8M0 byte 0, 2**-127: a bf16 subnormal on the expand_bf16 path; E4M3 0x01,
    2**-9) gives the reference's bits."""
    nan_byte, smallest = (0xFF, 0x00) if fmt == "mxfp4" else (0x7F, 0x01)
    a, sa, da, b, sb, db = _exact_operands(40, 72, 64, fmt, seed=5)
    sa[5, :] = smallest
    sa[7, 1] = nan_byte
    sb[0, 9] = nan_byte
    c = _kernel((a, sa, da, b, sb, db), fmt, path)
    ref = MX_MM_FP4(a, sa, da, b, sb, db, fmt, torch.float32)
    assert ref[7].isnan().all() and ref[:, 9].isnan().all() and ref.isnan().sum() == 72 + 40 - 1
    tiny, other = torch.nan_to_num(ref[5]).abs(), torch.nan_to_num(ref[6]).abs()
    assert (tiny != 0).sum() > 60 and tiny.max() < other.max() * 2.0**-5
    _assert_same(c, ref)


@pytest.mark.parametrize("path", FP4_GEMM_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_loads_unpack_the_nibbles_in_order(fmt: str, path: str) -> None:
    """One-hot GEMMs read each operand's codes back from its packed bytes, from the E2M1 table:
    I @ B = B and A @ I = A with unit scales, so a swapped nibble, a K index off by one byte or
    a wrong sign bit shows at its element. Every output is one block value, exact in bf16: C is
    stored in bf16 too."""
    k = 64
    g = torch.Generator().manual_seed(11)
    one = {"mxfp4": 127, "nvfp4": 0x38}[fmt]
    block = block_format(fmt).block_size
    unit = torch.tensor(1.0)
    identity = torch.diag(torch.full((k,), E2M1_ONE_CODE, dtype=torch.uint8))
    codes = torch.randint(0, 16, (k, k), generator=g, dtype=torch.uint8)
    values = torch.tensor(E2M1_VALUES)[codes.long()]
    scales = torch.full((k, k // block), one, dtype=torch.uint8)
    for out_dtype in (torch.float32, torch.bfloat16):
        # B = codes packed along K (rows): I @ B.
        ib = _kernel((pack_e2m1(identity, axis=1), scales, unit, pack_e2m1(codes, axis=0), scales.t(), unit), fmt,
                     path, out_dtype)
        # A = codes packed along K (columns): A @ I.
        ai = _kernel((pack_e2m1(codes, axis=1), scales, unit, pack_e2m1(identity, axis=0), scales.t(), unit), fmt,
                     path, out_dtype)
        assert torch.equal(ib.float(), values) and torch.equal(ai.float(), values)


def test_cuda_kernel_of_mx_mm_fp4_is_the_triton_gemm() -> None:
    """`mx_mm_fp4`'s registered CUDA kernel (run on CPU tensors under the interpreter) gives
    the op's reference bits, batched A included; a 3-D B takes the reference."""
    operands = list(_exact_operands(64, 32, 64, "nvfp4", seed=2))
    operands[0] = operands[0].reshape(2, 32, 32)
    operands[1] = operands[1].reshape(2, 32, 4)
    got = mx_mm_fp4_cuda(*operands, "nvfp4", torch.float32)
    assert got.shape == (2, 32, 32)
    _assert_same(got, MX_MM_FP4(*operands, "nvfp4", torch.float32))


# Ahead-of-time compiles (no GPU): the chosen config of each path (`configs.FP4_GEMM_SHAPES`,
# first entry), through the launcher's own argument list on meta tensors.


@pytest.fixture
def _compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _compile_chosen(fmt: str, path: str, capability: int):
    from mxcompile.triton_templates.aot import compile_launch
    from mxcompile.triton_templates.configs import fp4_mm_autotune_configs

    m = n = k = 4096
    block = block_format(fmt).block_size
    meta = torch.device("meta")
    a, b = torch.empty(m, k // 2, dtype=torch.uint8, device=meta), torch.empty(k // 2, n, dtype=torch.uint8, device=meta)
    sa = torch.empty(m, k // block, dtype=torch.uint8, device=meta)
    sb = torch.empty(k // block, n, dtype=torch.uint8, device=meta)
    decode = torch.empty((), dtype=torch.float32, device=meta)
    config = fp4_mm_autotune_configs(path)[0]
    (kernel,) = compile_launch(
        lambda wrap: fp4_mm_launch(a, sa, decode, b, sb, decode, block_format=fmt, out_dtype=torch.bfloat16,
                                   path=path, tiles=config.kwargs, interpret=False, wrap=wrap),
        capability, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return kernel


@pytest.mark.slow  # 1.4-2.2 s each with a cold Triton cache
@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("fmt,kind", [("mxfp4", "kind::mxf4.block_scale.block32"),
                                      ("nvfp4", "kind::mxf4nvf4.block_scale.block16")])
def test_sm100_fp4_gemm_is_block_scaled_tcgen05_without_spills(fmt: str, kind: str) -> None:
    """sm100: tl.dot_scaled on e2m1 tiles lowers to Blackwell's block-scaled MMA with E2M1
    operands and the format's scales (E8M0 per 32; E4M3 per 16), in a pipelined K loop, with
    no register spills; no MMA of another kind (no upcast to bf16)."""
    from mxcompile.triton_templates.aot import pipeline_report

    kernel = _compile_chosen(fmt, "dot_scaled", 100)
    mma = set(re.findall(r"tcgen05\.mma\.[^\s;]*", kernel.asm["ptx"]))
    assert mma == {f"tcgen05.mma.cta_group::1.{kind}"}, mma
    report = pipeline_report(kernel)
    assert report.pipelined and report.stack_bytes == 0, report


@pytest.mark.slow  # 7.5-11 s each with a cold Triton cache (compile, then nvdisasm)
@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("fmt", FORMATS)
def test_sm90_fp4_gemm_is_bf16_wgmma_without_spills(fmt: str) -> None:
    """sm90 (no FP4 tensor cores): the expand_bf16 loop's tensor-core instructions are all bf16
    wgmma accumulating in fp32 (SASS HGMMA ... F32.BF16), its bf16 multiplies are packed
    (HMUL2.BF16: PTX mul.bf16x2, no flush of subnormals), the packed tiles are copied
    asynchronously into multi-buffered shared memory, and nothing spills."""
    from mxcompile.triton_templates.aot import pipeline_report
    from mxcompile.triton_templates.kernel_static import class_counts, main_loop, sass

    kernel = _compile_chosen(fmt, "expand_bf16", 90)
    loop = main_loop(sass(kernel))
    mma = [op for op in loop if op.split(".", 1)[0].endswith("MMA")]
    assert mma and all(op.startswith("HGMMA.") and op.endswith(".F32.BF16") for op in mma), sorted(set(mma))
    assert "mul.bf16x2" in kernel.asm["ptx"] and ".ftz.bf16" not in kernel.asm["ptx"]
    assert class_counts(loop)["local"] == 0
    report = pipeline_report(kernel)
    assert report.pipelined and report.buffers >= 2 and report.async_copies > 0, report
    assert report.stack_bytes == 0, report


@pytest.mark.parametrize("fmt", FORMATS)
def test_operands_from_quantize_fp4(fmt: str) -> None:
    """Operands as the recipes store them (`mxcompile::quantize_fp4` of data spanning several
    octaves along rows, columns and K; NVFP4's weight in 2-D 16x16 blocks) through the op's
    CUDA kernel. Bit for bit on this data under the interpreter (its fp32 sums per K tile give
    the reference's bits here; not guaranteed for every input, nor for a GPU's MMA order: the
    exact-sum tests above are the proof of the kernel's arithmetic)."""
    from mxcompile.ops.quantize import QUANTIZE_FP4

    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 96, generator=g) * torch.logspace(-3, 3, 48, base=2.0)[:, None]
    x = x * torch.logspace(-4, 4, 96, base=2.0)[None, :]
    w = torch.randn(96, 40, generator=g) * torch.logspace(3, -3, 40, base=2.0)[None, :]
    a = QUANTIZE_FP4(x, 1, fmt, "rceil", False, False, 0, None)
    b = QUANTIZE_FP4(w, 0, fmt, "rceil", fmt == "nvfp4", False, 0, None)
    c = mx_mm_fp4_cuda(*a, *b, fmt, torch.float32)
    ref = MX_MM_FP4(*a, *b, fmt, torch.float32)
    assert ref.abs().max() > 0 and torch.equal(c, ref)
