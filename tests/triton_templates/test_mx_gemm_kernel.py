"""The MX GEMM kernel (its three main-loop paths, fused epilogues, MX-quantized output) against
the torch reference: numerics-core dequantize, fp32 matmul, torch epilogue.

Bit-identical: on operands whose products and partial sums are all exact in fp32 (small
integer elements, scales within a few octaves), every summation order gives the same bits, so
each path must equal the reference exactly; a wrong scale index, a bf16 rounding of the
expanded operands or a bf16 accumulation shows as a mismatch.

Tolerances. fp32 output: max|c - ref| <= 1e-5 * max|ref| (only the fp32 summation order and
the epilogue's exp/erf differ; measured <= 9.6e-8, and 91-94% of elements bit-equal).
bf16 output: compared with the fp32 reference rounded to bf16, within 1 bf16 ulp (the Triton
3.9 interpreter truncates fp32 -> bf16 instead of rounding to nearest even, so about half the
elements sit 1 ulp below; measured max 0.99 ulp; a GPU rounds). MX-quantized output: bit-exact
against `quantize_along` of the C the same launch stored.
"""

from __future__ import annotations

import pytest
import torch

from mxcompile.numerics import E4M3, E5M2, ScaleMode, dequantize_along, elem_format, quantize_along
from mxcompile.triton_templates import mx_mm_triton
from mxcompile.triton_templates.mx_gemm import mx_mm_reference

SMALL_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
PATHS = ["dot_scaled", "expand_bf16", "fp8_per_block"]


def _operands(
    m: int,
    n: int,
    k: int,
    *,
    a_elem: str = "e4m3",
    b_elem: str = "e4m3",
    block: int = 32,
    seed: int = 0,
):
    g = torch.Generator().manual_seed(seed)
    # Several octaves along rows of A, columns of B and along K, so wrong scale indexing shows.
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m, base=2.0)[:, None]
    x = x * torch.logspace(-4, 4, k, base=2.0)[None, :]
    w = torch.randn(k, n, generator=g) * torch.logspace(3, -3, n, base=2.0)[None, :]
    a, sa = quantize_along(x, 1, elem_format(a_elem), ScaleMode.RCEIL, block)
    b, sb = quantize_along(w, 0, elem_format(b_elem), ScaleMode.RCEIL, block)
    return a, sa, b, sb, g


def _check(c: torch.Tensor, ref32: torch.Tensor, out_dtype: torch.dtype) -> float:
    """Assert the tolerance of the module docstring; return the error measured."""
    if out_dtype == torch.float32:
        err = (c - ref32).abs().max().item() / ref32.abs().max().item()
        assert err <= 1e-5, f"max|c - ref| / max|ref| = {err:.3g}"
        return err
    ref = ref32.to(out_dtype).float()
    ulp = torch.finfo(out_dtype).eps * ref.abs().clamp_min(torch.finfo(out_dtype).tiny)
    err = ((c.float() - ref).abs() / ulp).max().item()
    assert err <= 1.0, f"max error {err:.3g} ulp of {out_dtype}"
    return err


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_plain_gemm_64x64x128(path: str, out_dtype: torch.dtype) -> None:
    a, sa, b, sb, _ = _operands(64, 64, 128)
    c = mx_mm_triton(a, sa, b, sb, 32, out_dtype, path=path)
    assert c.shape == (64, 64) and c.dtype == out_dtype
    _check(c, mx_mm_reference(a, sa, b, sb, 32, torch.float32), out_dtype)


def _exact_operands(m: int, n: int, k: int, seed: int):
    """FP8 operands whose every product and partial sum is exact in fp32: elements integers in
    [-4, 4] (exact in E4M3), scale bytes 127 +- 2 varying along rows of A, columns of B and
    along K. Every product is a multiple of 2**-4 of magnitude <= 2**8, so sums over K <= 2**11
    stay below 2**24 units of 2**-4."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-4, 5, (m, k), generator=g).to(torch.float8_e4m3fn)
    b = torch.randint(-4, 5, (k, n), generator=g).to(torch.float8_e4m3fn)
    sa = torch.randint(125, 130, (m, k // 32), generator=g, dtype=torch.uint8)
    sb = torch.randint(125, 130, (k // 32, n), generator=g, dtype=torch.uint8)
    return a, sa, b, sb


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(40, 72, 96), (64, 64, 128)], ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_the_reference(path: str, shape: tuple[int, int, int]) -> None:
    """M, N not multiples of the 32x32 tile and K=96 not a multiple of BLOCK_K=64 (partial K
    tiles, whose missing blocks read as 0 with scale 1), and whole tiles."""
    a, sa, b, sb = _exact_operands(*shape, seed=sum(shape))
    c = mx_mm_triton(a, sa, b, sb, 32, torch.float32, path=path, tiles=SMALL_TILES)
    ref = mx_mm_reference(a, sa, b, sb, 32, torch.float32)
    assert torch.equal(c, ref)


@pytest.mark.parametrize("path", PATHS)
def test_scale_bytes_0_and_255_as_the_reference(path: str) -> None:
    """Scale byte 0 (2**-127: expanded to a bf16 subnormal) gives the reference's bits; byte
    255 (NaN) over finite data makes its row of A / column of B NaN, as the reference does."""
    a, sa, b, sb = _exact_operands(40, 72, 96, seed=3)
    sa[5, :] = 0
    sa[7, 1] = 0xFF
    sb[1, 9] = 0xFF
    c = mx_mm_triton(a, sa, b, sb, 32, torch.float32, path=path, tiles=SMALL_TILES)
    ref = mx_mm_reference(a, sa, b, sb, 32, torch.float32)
    assert torch.equal(c.isnan(), ref.isnan()) and ref[7].isnan().all() and ref[:, 9].isnan().all()
    assert torch.equal(torch.nan_to_num(c), torch.nan_to_num(ref)) and (ref[5] != 0).any()


def test_the_exact_operands_tell_fp32_from_bf16_accumulation() -> None:
    """The bit-identity test's data can fail: the same products summed in bf16 differ."""
    a, sa, b, sb = _exact_operands(64, 64, 128, seed=1)
    a_hp, b_hp = dequantize_along(a, sa, 1, 32, torch.float32), dequantize_along(b, sb, 0, 32, torch.float32)
    bf16_sums = torch.zeros(64, 64, dtype=torch.bfloat16)
    for i in range(128):
        bf16_sums += a_hp[:, i : i + 1] * b_hp[i : i + 1, :]
    ref = mx_mm_reference(a, sa, b, sb, 32, torch.float32)
    assert not torch.equal(bf16_sums.float(), ref)


@pytest.mark.parametrize("path", PATHS)
def test_ragged_m_n_k_tiles(path: str) -> None:
    # M, N not multiples of the 32x32 tile, K=96 not a multiple of BLOCK_K=64.
    a, sa, b, sb, _ = _operands(40, 72, 96)
    c = mx_mm_triton(a, sa, b, sb, 32, torch.float32, path=path, tiles=SMALL_TILES)
    _check(c, mx_mm_reference(a, sa, b, sb, 32, torch.float32), torch.float32)


@pytest.mark.parametrize("b_layout", ["(K, N)", "(N, K)"])
def test_tma_operand_tiles_give_the_pointer_loads_bits(b_layout: str) -> None:
    """The dot_scaled path reading A and B through TMA descriptors (boxes of the tiles, zero
    fill past the edges) computes the same bits as its masked pointer loads: M, N not multiples
    of the tile, K of BLOCK_K; B row-major or the transpose of a row-major (N, K) weight."""
    a, sa, b, sb, _ = _operands(40, 80, 96)
    if b_layout == "(N, K)":
        b = b.t().contiguous().t()
    kwargs = {"path": "dot_scaled", "tiles": SMALL_TILES, "epilogue": ("silu",)}
    c_tma = mx_mm_triton(a, sa, b, sb, 32, torch.float32, tma=True, **kwargs)
    c_ptr = mx_mm_triton(a, sa, b, sb, 32, torch.float32, tma=False, **kwargs)
    assert torch.equal(c_tma, c_ptr)
    ref = mx_mm_reference(a, sa, b, sb, 32, torch.float32, ("silu",))
    _check(c_tma, ref, torch.float32)


@pytest.mark.parametrize("b_transposed", [False, True])
def test_only_the_tma_variant_autotunes_with_a_pre_hook(b_transposed: bool) -> None:
    """Triton keeps autotune timings on disk only for configs without a pre-hook: the
    pointer-load variant's configs have none; the TMA variant's pre-hook sizes the boxes of
    the descriptors the launcher built to each config's tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mxcompile.triton_templates.configs import mx_mm_autotune_configs

    assert all(config.pre_hook is None for config in mx_mm_autotune_configs())
    operand = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    for config in mx_mm_autotune_configs(tma=True):
        descriptors = {name: TensorDescriptor.from_tensor(operand, [32, 32]) for name in ("a_desc", "b_desc")}
        config.pre_hook({**descriptors, "B_DESC_TRANSPOSED": b_transposed, **config.kwargs})
        bm, bn, bk = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        assert descriptors["a_desc"].block_shape == [bm, bk]
        assert descriptors["b_desc"].block_shape == ([bn, bk] if b_transposed else [bk, bn])


def test_tma_refusals_name_the_cause() -> None:
    a, sa, b, sb, _ = _operands(32, 72, 64)
    for path in ("expand_bf16", "fp8_per_block"):
        with pytest.raises(ValueError, match="dot_scaled path only"):
            mx_mm_triton(a, sa, b, sb, path=path, tma=True)
    with pytest.raises(ValueError, match="72 elements.*16 bytes"):  # B's rows: 72 bytes apart
        mx_mm_triton(a, sa, b, sb, tma=True)


EPILOGUES = [
    ("bias",),
    ("gelu_tanh",),
    ("gelu_erf",),
    ("silu", "mul"),  # SwiGLU: silu(x Wg) * (x Wu)
    ("bias", "gelu_tanh", "residual"),
    ("residual", "silu"),  # order is honoured
]


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: "+".join(e))
def test_epilogues(epilogue: tuple[str, ...]) -> None:
    a, sa, b, sb, g = _operands(48, 64, 64, seed=3)
    extra = {
        "bias": torch.randn(64, generator=g),
        "mul": torch.randn(48, 64, generator=g).to(torch.bfloat16),
        "residual": torch.randn(48, 64, generator=g),
    }
    extra = {k: v for k, v in extra.items() if k in epilogue}
    c = mx_mm_triton(
        a, sa, b, sb, 32, torch.float32, epilogue, path="dot_scaled", tiles=SMALL_TILES, **extra
    )
    _check(c, mx_mm_reference(a, sa, b, sb, 32, torch.float32, epilogue, **extra), torch.float32)


@pytest.mark.parametrize("path", ["expand_bf16", "fp8_per_block"])
def test_epilogue_on_per_block_paths_bf16_out(path: str) -> None:
    a, sa, b, sb, g = _operands(64, 64, 128, seed=4)
    bias, res = torch.randn(64, generator=g), torch.randn(64, 64, generator=g)
    ops = ("bias", "gelu_erf", "residual")
    c = mx_mm_triton(a, sa, b, sb, 32, torch.bfloat16, ops, bias=bias, residual=res, path=path)
    _check(
        c,
        mx_mm_reference(a, sa, b, sb, 32, torch.float32, ops, bias=bias, residual=res),
        torch.bfloat16,
    )


@pytest.mark.parametrize("out_elem", ["e4m3", "e5m2"])
def test_quantized_output_is_bit_exact(out_elem: str) -> None:
    a, sa, b, sb, _ = _operands(40, 64, 96, seed=5)
    c, data, scale = mx_mm_triton(
        a, sa, b, sb, 32, torch.bfloat16, quantize_output=out_elem, output_scale_mode="floor",
        keep_output=True, tiles=SMALL_TILES,
    )  # fmt: skip
    ref_data, ref_scale = quantize_along(c, 1, elem_format(out_elem), ScaleMode.FLOOR, 32)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    only = mx_mm_triton(
        a,
        sa,
        b,
        sb,
        32,
        torch.bfloat16,
        quantize_output=out_elem,
        output_scale_mode="floor",
        tiles=SMALL_TILES,
    )
    assert torch.equal(only[1], scale) and torch.equal(
        only[0].view(torch.uint8), data.view(torch.uint8)
    )


@pytest.mark.parametrize("path", ["expand_bf16", "fp8_per_block"])
def test_mixed_formats_block_64_and_nan_blocks(path: str) -> None:
    a, sa, b, sb, _ = _operands(32, 64, 128, a_elem="e4m3", b_elem="e5m2", block=64)
    sa[3, 1] = 0xFF  # a NaN block of A: row 3 of C is NaN
    sb[0, 5] = 0xFF  # a NaN block of B: column 5 of C is NaN
    c = mx_mm_triton(
        a,
        sa,
        b,
        sb,
        64,
        torch.float32,
        path=path,
        tiles={"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1},
    )
    ref = mx_mm_reference(a, sa, b, sb, 64, torch.float32)
    assert torch.equal(c.isnan(), ref.isnan()) and c[3].isnan().all() and c[:, 5].isnan().all()
    keep = ~ref.isnan()
    _check(torch.where(keep, c, 0), torch.where(keep, ref, 0), torch.float32)
    assert a.dtype == E4M3.dtype and b.dtype == E5M2.dtype


def test_clear_errors() -> None:
    a, sa, b, sb, _ = _operands(32, 32, 64)
    with pytest.raises(ValueError, match="FP8 tensor"):
        mx_mm_triton(a.float(), sa, b, sb)
    with pytest.raises(ValueError, match="b_scale has shape"):
        mx_mm_triton(a, sa, b, sb.t().contiguous())
    with pytest.raises(ValueError, match="pass `bias` exactly"):
        mx_mm_triton(a, sa, b, sb, epilogue=("bias",))
    with pytest.raises(ValueError, match="not supported"):
        mx_mm_triton(a, sa, b, sb, epilogue=("relu",))
    a64, sa64, b64, sb64, _ = _operands(32, 32, 64, block=64)
    with pytest.raises(ValueError, match="needs block_size=32"):
        mx_mm_triton(a64, sa64, b64, sb64, 64, path="dot_scaled")
    with pytest.raises(ValueError, match="multiple of block_size"):
        mx_mm_triton(*_operands(32, 40, 64)[:4], quantize_output="e4m3")


def test_auto_path_rule() -> None:
    """"auto": dot_scaled for MX's 32-element blocks (sm100's block-scaled MMA, and the
    interpreter), expand_bf16 on sm90 (the static comparison: see resolve_gemm_path), the FP8
    per-block loop for other block sizes; explicit paths as given."""
    from mxcompile.triton_templates import resolve_gemm_path

    assert resolve_gemm_path("auto", 32, (9, 0)) == "expand_bf16"
    assert resolve_gemm_path("auto", 32, (10, 0)) == "dot_scaled"
    assert resolve_gemm_path("auto", 32, None) == "dot_scaled"
    assert resolve_gemm_path("auto", 64, (9, 0)) == "fp8_per_block"
    assert resolve_gemm_path("expand_bf16", 64, (10, 0)) == "expand_bf16"
    with pytest.raises(ValueError, match="block_size=32"):
        resolve_gemm_path("dot_scaled", 64)
    with pytest.raises(ValueError, match="'hopper' is not accepted"):
        resolve_gemm_path("hopper", 32)


def test_the_bf16_reference_gemm_is_exact() -> None:
    """The plain bf16 GEMM of the static comparison, under the interpreter (whose bf16 tl.dot
    `interpreter_bf16_arithmetic` corrects), on values whose sums are exact in bf16 (the interpreter
    truncates fp32 -> bf16 where a GPU rounds); ragged tiles."""
    from mxcompile.triton_templates.mx_gemm import bf16_mm_launch

    g = torch.Generator().manual_seed(7)
    a = torch.randint(-1, 2, (40, 96), generator=g).to(torch.bfloat16)
    b = torch.randint(-1, 2, (96, 72), generator=g).to(torch.bfloat16)
    c = bf16_mm_launch(a, b, tiles=SMALL_TILES, interpret=True)
    assert torch.equal(c, (a.float() @ b.float()).to(torch.bfloat16))
