"""The FP4 lines of `mxcompile doctor` (issue 48): whether the FP4 recipes' ops run here, and what
the GPU offers them.

- "FP4 ops (CPU)": an NVFP4 and an MXFP4 GEMM of two small operands, run as `backend="nvfp4"` /
  `"mxfp4"` graphs run them on the CPU (`mxcompile::fake_quantize_fp4`, then the fp32 product of
  the block values times the tensor scales: `lowering.lower_fp4_gemms`), equal bit for bit to the
  packed form (`quantize_fp4`: two E2M1 codes per byte, then `mx_mm_fp4`). Required: without it
  the FP4 backends cannot run.
- "FP4 tensor cores": whether the GPU multiplies FP4 in hardware (sm100+: block-scaled
  `tcgen05.mma`, which Triton reaches through `tl.dot_scaled` with `e2m1` operands), and what
  compiled FP4 GEMMs run here, as `lowering.runs_triton_mx_gemm(..., fp4=True)` and
  `triton_templates.mx_gemm_fp4.resolve_fp4_gemm_path` decide it: on the CPU the fp32 GEMM of
  the exactly dequantized block values (`lowering.lower_fp4_gemms`); on a CUDA GPU the Triton
  FP4 GEMM, `mx_mm_fp4`'s CUDA kernel (block-scaled `tcgen05.mma` on sm100+, the E2M1 tiles
  expanded exactly to bf16 for bf16 tensor-core MMA below, "expand_bf16"), unless
  gemm_kernel="dequantized" asks for the dequantized GEMM there too. Optional.
"""

from __future__ import annotations

import torch

from ..config import GemmKernel, Recipe, RECIPES
from ..numerics import ScaleMode
from ..numerics.fp4_operand import fp4_gemm
from .doctor import Check
from .errors import one_line

# The check's operands: M x K activations times a K x N weight, K a multiple of both FP4 blocks
# (16, 32) and N of NVFP4's 16x16 weight tile.
CHECK_M, CHECK_K, CHECK_N = 8, 64, 32
CHECK_SEED = 0
FP4_TENSOR_CORE_CAPABILITY = (10, 0)  # Blackwell: block-scaled FP4 MMA (tcgen05.mma kind::mxf4nvf4)
FP4_OPS_FIX = ("reinstall mxcompile (`pip install .` in its repository); if it persists, report this line: "
               "backend='nvfp4' and 'mxfp4' need these ops")
NO_FP4_TENSOR_CORES_FIX = ("none needed for correctness (the expand_bf16 loop gives the same products); "
                           "FP4 tensor cores need a Blackwell GPU (sm100)")
DEQUANTIZED_GEMMS = "fp32 GEMMs of the exactly dequantized block values (lowering.lower_fp4_gemms)"
CPU_PATH = f"compiled FP4 GEMMs run on the CPU as {DEQUANTIZED_GEMMS}"
# The Triton FP4 GEMM's main loops (triton_templates.mx_gemm_fp4.FP4_GEMM_PATHS), as the doctor names them.
FP4_GEMM_LOOPS = {
    "dot_scaled": "tl.dot_scaled with e2m1 operands, block-scaled tcgen05.mma",
    "expand_bf16": "E2M1 tiles expanded exactly to bf16 for bf16 tensor-core MMA",
}
DEQUANTIZED_OPTION = f"gemm_kernel='dequantized' runs them as {DEQUANTIZED_GEMMS} instead"


def _fp4_products(recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """One GEMM of the recipe's block format through the packed ops and through the fake-quantize
    form compiled graphs use; the weight in 16x16 blocks where the recipe has them."""
    from ..ops.mx_mm import MX_MM_FP4
    from ..ops.quantize import FAKE_QUANTIZE_FP4, QUANTIZE_FP4

    fmt = RECIPES[recipe].block_format.name
    weight_2d = bool(RECIPES[recipe].weight_2d)
    generator = torch.Generator().manual_seed(CHECK_SEED)
    x = torch.randn(CHECK_M, CHECK_K, generator=generator)
    w = torch.randn(CHECK_K, CHECK_N, generator=generator)
    mode = ScaleMode.RCEIL.value
    operands = ((x, 1, False), (w, 0, weight_2d))
    packed = [QUANTIZE_FP4(t, axis, fmt, mode, block_2d, False, CHECK_SEED, None) for t, axis, block_2d in operands]
    product = MX_MM_FP4(*packed[0], *packed[1], fmt, torch.float32)
    fakes = [FAKE_QUANTIZE_FP4(t, axis, fmt, mode, block_2d, False, CHECK_SEED, None, torch.float32)
             for t, axis, block_2d in operands]
    return product, fp4_gemm(*fakes[0], *fakes[1], torch.float32)


def fp4_ops_check() -> Check:
    """The "FP4 ops (CPU)" line."""
    recipes = (Recipe.NVFP4, Recipe.MXFP4)
    try:
        results = {recipe: _fp4_products(recipe) for recipe in recipes}
    except (RuntimeError, ValueError, TypeError, AttributeError) as err:
        return Check("FP4 ops (CPU)", False, f"an FP4 GEMM failed: {one_line(err)}", FP4_OPS_FIX)
    differing = [r.value for r, (packed, fake) in results.items() if not torch.equal(packed, fake)]
    if differing:
        return Check("FP4 ops (CPU)", False, f"packed and fake-quantized FP4 GEMMs differ for {differing}",
                     FP4_OPS_FIX)
    return Check("FP4 ops (CPU)", True,
                 f"nvfp4 and mxfp4 {CHECK_M}x{CHECK_K} @ {CHECK_K}x{CHECK_N} GEMMs: the packed ops and the form "
                 "compiled graphs run agree bit for bit (torch reference ops, fp32 products of the E2M1 block values)")


def compiled_fp4_gemm_path(capability: tuple[int, int]) -> str:
    """What compiled FP4 GEMMs run on a CUDA GPU of compute `capability` under gemm_kernel
    "auto", as the lowering and the kernel's launcher decide it."""
    from ..lowering import runs_triton_mx_gemm
    from ..triton_templates.mx_gemm_fp4 import resolve_fp4_gemm_path

    if not runs_triton_mx_gemm(GemmKernel.AUTO, torch.device("cuda"), fp4=True):
        return f"compiled FP4 GEMMs run as {DEQUANTIZED_GEMMS}"
    loop = resolve_fp4_gemm_path("auto", capability)
    return (f"compiled FP4 GEMMs run the Triton FP4 GEMM ({loop}: {FP4_GEMM_LOOPS[loop]}); "
            f"{DEQUANTIZED_OPTION}")


def fp4_tensor_core_check(name: str | None, capability: tuple[int, int] | None) -> Check:
    """The "FP4 tensor cores" line for the GPU `name` of compute `capability` (None: no CUDA GPU)."""
    if name is None or capability is None:
        return Check("FP4 tensor cores", False, f"no CUDA GPU: {CPU_PATH}", "see the CUDA line", required=False)
    sm = f"sm{capability[0]}{capability[1]}"
    path = compiled_fp4_gemm_path(capability)
    if capability >= FP4_TENSOR_CORE_CAPABILITY:
        return Check("FP4 tensor cores", True, f"{name}, {sm}: block-scaled FP4 MMA in hardware; {path}",
                     required=False)
    return Check("FP4 tensor cores", False, f"{name}, {sm}: no FP4 tensor cores below sm100; {path}",
                 NO_FP4_TENSOR_CORES_FIX, required=False)
