"""FP4 GEMM kernel (MXFP4, NVFP4): C = (A @ B) * fp32(S_dec(A) * S_dec(B)), cast to C's dtype,
where A (M, K) and B (K, N) hold E2M1 codes packed two per byte along K (element 2i in the low
nibble: `numerics.e2m1.pack_e2m1`, torch.float4_e2m1fn_x2 and tl.dot_scaled's e2m1 agree),
with one scale byte per block of K: E8M0 per 32 (MXFP4) or E4M3 per 16 (NVFP4), and the 0-d
fp32 tensor decode scales S_dec (1.0 for MXFP4), as `mxcompile::quantize_fp4` stores them.

Two main-loop paths (`FP4_GEMM_PATHS`, the kernel's MAIN_LOOP):
  * "dot_scaled", for sm100+: `tl.dot_scaled(a, a_scale, "e2m1", b, b_scale, "e2m1")` on the
    packed tiles, with the E8M0 scale bytes or the E4M3 ones bitcast to float8e4nv. Triton 3.9
    takes both: its `deduce_scale_factor` (triton/language/semantic.py) reads the group size
    from the scale tile's shape, and compiled for sm100 (BLOCK_M >= 128) MXFP4 lowers to
    `tcgen05.mma ... kind::mxf4.block_scale.block32` and NVFP4 to
    `kind::mxf4nvf4.block_scale.block16` (seen 2026-12-07, the AOT tests). The tensor decode
    scales multiply the fp32 accumulator afterwards, as the block-scaled MMA's alpha would.
  * "expand_bf16", for sm90 (no FP4 tensor cores): per scale block of K, the codes are
    unpacked, decoded to bf16 from their bits and multiplied by the block scale in bf16; one
    bf16 `tl.dot` (wgmma) accumulates in fp32.

Exactness (both paths equal `ops.mx_mm.mx_mm_fp4_op`'s reference, `numerics.fp4_operand.fp4_gemm`,
up to the fp32 summation order). A block value q * s is exact in bf16: q in E2M1 has at most 2
significant bits, an E4M3 scale at most 4, so their product has at most 6 (bf16 keeps 8);
an E8M0 scale is a power of two 2**(b - 127) and the smallest nonzero product, 0.5 * 2**-127,
with its 2 bits down to 2**-128, stays above bf16's smallest subnormal 2**-133; products with
E4M3 scales lie in [2**-10, 2688]. Large E8M0 scales overflow bf16 exactly where they overflow
fp32 (same exponent range). The MMA's products of two bf16 values are exact in fp32, and the
tensor scales are applied as the reference applies them: the fp32 accumulator times
fp32(S_dec(A) * S_dec(B)), one rounding. NaN scale bytes (E8M0 0xFF, E4M3 S.1111.111) make
their rows (A) and columns (B) of C NaN, as in the reference.

Under TRITON_INTERPRET=1: Triton 3.9's interpreter reads every dot_scaled scale as E8M0 (its
`_dot_scaled_scale_to_f32` shifts the byte into fp32's exponent), so NVFP4 on the dot_scaled
path runs there with `interpreter_e4m3_scales`, which decodes float8e4nv scales as E4M3; the
expand_bf16 path needs `interpreter_bf16_arithmetic` (bf16 arithmetic on raw bits otherwise).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..numerics.formats import BlockFormat, ScaleFormat
from ..numerics.formats import block_format as block_format_named
from .configs import autotuned, fp4_mm_autotune_configs, interpreter_fp4_mm_config
from .loader import kernel_module
from .mx_gemm import interpreter_bf16_arithmetic

FP4_GEMM_PATHS: tuple[str, ...] = ("dot_scaled", "expand_bf16")
# tcgen05's block-scaled MMA (sm100+) runs FP4 natively; below it, expand_bf16.
NATIVE_FP4_MAJOR = 10
SCALE_FORMAT_NAMES = {ScaleFormat.E8M0: "e8m0", ScaleFormat.E4M3: "e4m3"}


def fp4_block_format(block_format: str | BlockFormat) -> BlockFormat:
    """The FP4 block format named `block_format` ("mxfp4" or "nvfp4")."""
    fmt = block_format_named(block_format)
    if fmt.scale_format not in SCALE_FORMAT_NAMES or fmt.elem.name != "e2m1":
        raise ValueError(f"block_format={fmt.name!r} is not an FP4 block format; accepted: mxfp4, nvfp4")
    return fmt


def resolve_fp4_gemm_path(path: str, capability: tuple[int, int] | None) -> str:
    """The FP4 GEMM main loop for `path` ("auto" or one of FP4_GEMM_PATHS) on a GPU of compute
    `capability` (None: the interpreter): "auto" is dot_scaled on sm100+ and under the
    interpreter, expand_bf16 below sm100."""
    if path == "auto":
        if capability is not None and capability[0] < NATIVE_FP4_MAJOR:
            return "expand_bf16"
        return "dot_scaled"
    if path not in FP4_GEMM_PATHS:
        raise ValueError(f"path={path!r} is not accepted; use 'auto' or one of {list(FP4_GEMM_PATHS)}")
    return path


@contextlib.contextmanager
def interpreter_e4m3_scales() -> Iterator[None]:
    """Within it, the Triton interpreter's tl.dot_scaled reads float8e4nv scales as E4M3 values
    (Triton 3.9 reads every scale byte as E8M0); uint8 scales stay E8M0."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    e8m0_scales = interpreter._dot_scaled_scale_to_f32

    def scales(scale_handle: Any, compute_type: Any) -> Any:
        if scale_handle.dtype != tl.float8e4nv:
            return e8m0_scales(scale_handle, compute_type)
        raw = torch.from_numpy(np.ascontiguousarray(scale_handle.data).view(np.uint8))
        return raw.view(torch.float8_e4m3fn).to(torch.float32).numpy()

    interpreter._dot_scaled_scale_to_f32 = scales
    try:
        yield
    finally:
        interpreter._dot_scaled_scale_to_f32 = e8m0_scales


@functools.cache
def _autotuned(path: str) -> Any:
    kernel = kernel_module("mx_gemm_fp4", interpret=False).fp4_mm_kernel
    return autotuned(kernel, fp4_mm_autotune_configs(path), ["M", "N", "K", "SCALE_FORMAT", "MAIN_LOOP"])


def fp4_mm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_decode: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_decode: torch.Tensor,
    *,
    block_format: str | BlockFormat,
    out_dtype: torch.dtype,
    path: str,
    tiles: dict[str, int] | None = None,
    interpret: bool,
    wrap: Any = None,
) -> torch.Tensor:
    """Thin launcher of `fp4_mm_kernel`: a (M, K / 2) and b (K / 2, N) packed uint8, a_scale
    (M, K / block) and b_scale (K / block, N) uint8, a_decode and b_decode 0-d fp32. Checks the
    shapes and dtypes; `tiles` fixed, else the interpreter's config or the autotuner's."""
    import triton

    fmt = fp4_block_format(block_format)
    if path not in FP4_GEMM_PATHS:
        raise ValueError(f"path={path!r}: the FP4 GEMM's main loops are {list(FP4_GEMM_PATHS)}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K/2) and b (K/2, N) must be 2-D and agree on K/2; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} has dtype {t.dtype}: pass the uint8 bytes of mxcompile::quantize_fp4")
    m, n, k = a.shape[0], b.shape[1], 2 * a.shape[1]
    if k % fmt.block_size or a_scale.shape != (m, k // fmt.block_size) or b_scale.shape != (k // fmt.block_size, n):
        raise ValueError(f"{fmt.name}: K={k} must be a multiple of {fmt.block_size} and the scales "
                         f"(M, K/{fmt.block_size}) and (K/{fmt.block_size}, N); got {tuple(a_scale.shape)}, "
                         f"{tuple(b_scale.shape)}")
    if a_decode.numel() != 1 or b_decode.numel() != 1 or a_decode.dtype != torch.float32 or b_decode.dtype != torch.float32:
        raise ValueError("a_decode and b_decode must be one-element fp32 tensors (the tensor decode scales)")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:  # nothing to compute; Triton rejects an empty grid
        return c
    fixed_tiles = None if tiles is None and not interpret else {"GROUP_M": 8, **(tiles or interpreter_fp4_mm_config())}
    if fixed_tiles is not None and fixed_tiles["BLOCK_K"] % fmt.block_size:
        raise ValueError(f"tiles BLOCK_K={fixed_tiles['BLOCK_K']} must be a multiple of {fmt.block_size}")
    meta: dict[str, Any] = {
        "SCALE_FORMAT": SCALE_FORMAT_NAMES[fmt.scale_format],
        "SCALE_BLOCK": fmt.block_size,
        "MAIN_LOOP": path,
    }
    if fixed_tiles is None:
        kernel = _autotuned(path)
    else:
        kernel = kernel_module("mx_gemm_fp4", interpret=interpret).fp4_mm_kernel
        meta.update(fixed_tiles)
    if wrap is not None:
        kernel = wrap(kernel)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    with contextlib.ExitStack() as interpreter_fixes:
        if interpret and path == "expand_bf16":
            interpreter_fixes.enter_context(interpreter_bf16_arithmetic())
        if interpret and path == "dot_scaled":
            interpreter_fixes.enter_context(interpreter_e4m3_scales())
        kernel[grid](
            a, a_scale, a_decode.reshape(()), b, b_scale, b_decode.reshape(()), c,
            m, n, k,
            *a.stride(), *a_scale.stride(), *b.stride(), *b_scale.stride(), *c.stride(),
            **meta,
        )  # fmt: skip
    return c
