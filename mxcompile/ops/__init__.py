"""Every `torch.library` op of mxcompile, one module per op family:

    quantize   mxcompile::quantize, mxcompile::dequantize, mxcompile::fake_quantize
               (CPU kernels: native, C++ built once per machine; else cpu_kernels, their
               Inductor forms compiled once, dynamic sizes)
               mxcompile::quantize_fp4, dequantize_fp4, fake_quantize_fp4 (the FP4 formats,
               the block format row a parameter; torch references only)
    mx_mm      mxcompile::mx_mm, mxcompile::mx_mm_fp4
    attention  mxcompile::attention, mxcompile::attention_backward
               (reference: attention_reference; eligibility: attention_checks)
    offload    mxcompile::offload, mxcompile::reload
    grouped_mm mxcompile::grouped_mm (MoE experts in dtypes aten._grouped_mm rejects)

Each module holds the op's schema, its torch reference (built on `mxcompile.numerics`), its
fake, its autograd where it has one, and its CUDA kernel, registered with
`register_kernel("cuda")` (the Triton launchers of `mxcompile.triton_templates`, with the torch
reference as the fallback); the quantize ops' CPU kernels are in `native` and `cpu_kernels`. The module
constants (`QUANTIZE`, `MX_MM`, `ATTENTION`, ...) are the overloads the graph passes insert;
passes import them from here. `DECOMPOSITIONS` holds the Inductor forms the lowering decomposes
the ops into where they are not kept opaque; `CUDA_KERNEL_OPS` the ops the CUDA lowering keeps
opaque because their CUDA kernel is a Triton one (except the MXFP8 GEMMs that
`mxcompile.lowering.runs_triton_mx_gemm` sends to cuBLAS on dequantized operands instead, their
quantize nodes then Inductor's fp8 casts); `CPU_KERNEL_OPS` those the CPU lowering keeps
opaque, their CPU kernels being native code or compiled graphs. The FP4 ops have no Inductor form and stay opaque on every device: in
a CUDA graph `mx_mm_fp4` runs its CUDA kernel, the Triton FP4 GEMM, unless
`runs_triton_mx_gemm(..., fp4=True)` (gemm_kernel "dequantized"; every CPU graph) has
`lowering.lower_fp4_gemms` replace it by the fp32 GEMM of its operands' block values.
"""

from __future__ import annotations

from . import attention, cpu_kernels, grouped_mm, offload
from .mx_mm import MX_MM, MX_MM_FP4, gemm_operand_dtype, mx_mm_peak_bytes
from .mx_mm import DECOMPOSITIONS as _MX_MM_DECOMPOSITIONS
from .quantize import (
    DEQUANTIZE,
    DEQUANTIZE_FP4,
    FAKE_QUANTIZE,
    FAKE_QUANTIZE_FP4,
    QUANTIZE,
    QUANTIZE_FP4,
    QUANTIZE_SLICE_ELEMENTS,
    quantize_scratch_bytes,
)
from .quantize import DECOMPOSITIONS as _QUANTIZE_DECOMPOSITIONS

DECOMPOSITIONS: dict = {**_QUANTIZE_DECOMPOSITIONS, **_MX_MM_DECOMPOSITIONS}
CUDA_KERNEL_OPS = frozenset({QUANTIZE, MX_MM})
CPU_KERNEL_OPS = frozenset({QUANTIZE, DEQUANTIZE, FAKE_QUANTIZE})

__all__ = [
    "CPU_KERNEL_OPS",
    "CUDA_KERNEL_OPS",
    "DECOMPOSITIONS",
    "DEQUANTIZE",
    "DEQUANTIZE_FP4",
    "FAKE_QUANTIZE",
    "FAKE_QUANTIZE_FP4",
    "MX_MM",
    "MX_MM_FP4",
    "QUANTIZE",
    "QUANTIZE_FP4",
    "QUANTIZE_SLICE_ELEMENTS",
    "attention",
    "cpu_kernels",
    "gemm_operand_dtype",
    "grouped_mm",
    "mx_mm_peak_bytes",
    "offload",
    "quantize_scratch_bytes",
]
