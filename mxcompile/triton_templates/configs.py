"""Autotune configurations of the Triton kernels: every config list comes from here.

Origins:
  * GEMM: the eight entries under "Good config for fp8 inputs" in the Triton matmul tutorial
    (python/tutorials/03-matrix-multiplication.py, `get_cuda_autotune_config`); each has a
    BLOCK_K that is a multiple of the 32-element MX scale block.
  * Attention: after the shapes of the Triton fused-attention tutorial
    (python/tutorials/06-fused-attention.py): BLOCK_M 64/128, BLOCK_N 64/128, 3 stages, 4-8 warps,
    plus larger tiles (`ATTENTION_SHAPES`); each kept for the head_dims at which it spills nothing.
  * Quantize: chosen here, not taken from a tutorial: a memory-bound kernel wants tiles of 4-32 K
    elements and 4-8 warps; both tile sides are multiples of the 32-element scale block so that a
    tile holds whole row-wise and column-wise blocks. Untimed so far (no GPU was available).

Under TRITON_INTERPRET=1 the launchers do not autotune (there is no device to time): they use
`interpreter_*_config`, large tiles because the interpreter runs each program as numpy code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton


def autotuned(kernel: Any, configs: list[triton.Config], key: list[str]) -> Any:
    """`triton.autotune` over `configs`, keyed by the argument and meta-parameter names `key`,
    with its timings cached on disk (`cache_results=True`): a new process takes the best config
    of a key it has seen before instead of timing every config again. Autotuning is part of the
    first step's time: on the H200 (2026-12-04) the mxfp8 GPT's first step took 191 s against
    Inductor's 12 s in bf16, autotuning included (the saving from the cache is not measured yet).
    Under TRITON_INTERPRET=1 Triton caches nothing."""
    return triton.autotune(configs=configs, key=key, cache_results=True)(kernel)


def quantize_autotune_configs() -> list[triton.Config]:
    """Tile configs of the quantize kernel (BLOCK_M, BLOCK_N multiples of 32)."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=1)
        for bm, bn, w in [
            (32, 128, 4),
            (64, 64, 4),
            (64, 128, 4),
            (128, 64, 4),
            (128, 128, 8),
            (64, 256, 8),
        ]
    ]


def tma_boxes(block_m: int, block_n: int, block_k: int, b_transposed: bool) -> tuple[list[int], list[int]]:
    """The MX GEMM's TMA boxes for its tiles: A's (BLOCK_M, BLOCK_K), and B's (BLOCK_K, BLOCK_N),
    or (BLOCK_N, BLOCK_K) when its descriptor covers B's memory as (N, K)."""
    return [block_m, block_k], ([block_n, block_k] if b_transposed else [block_k, block_n])


def set_tma_boxes(nargs: dict[str, Any]) -> None:
    """Autotune pre-hook of the MX GEMM's TMA variant: a host-side tensor descriptor's box is
    fixed when the launcher builds it, before the autotuner picks a config, so each config
    resizes the boxes to its tiles before it runs."""
    a_box, b_box = tma_boxes(nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"], nargs["B_DESC_TRANSPOSED"])
    nargs["a_desc"].block_shape = a_box
    nargs["b_desc"].block_shape = b_box


# The largest BLOCK_M of the expand_bf16 main loop's configs: compiled for sm90 (2026-12-07,
# `gpu_kernels.py --pipelining 90`), its two 256-row tiles spill registers (8 and 32 bytes per
# thread), the other six nothing.
EXPAND_BF16_MAX_BLOCK_M = 128


def mx_mm_autotune_configs(tma: bool = False, path: str = "dot_scaled") -> list[triton.Config]:
    """Tile configs of the MX GEMM kernel's main loop `path` (the Triton matmul tutorial's FP8
    list; for expand_bf16 without the tiles over EXPAND_BF16_MAX_BLOCK_M rows); for the TMA
    variant each with the pre-hook that sizes its boxes (`set_tma_boxes`). Only there: Triton
    does not cache the timings of configs with a pre-hook on disk (it cannot serialize them),
    so the TMA variant is timed again in every process. Compiled for sm100 without a GPU, the
    configs with BLOCK_M 128 or 256 lower tl.dot_scaled to the block-scaled MMA
    (`tcgen05.mma ... kind::mxf8f6f4.block_scale.block32`); the two with BLOCK_M 64 upcast the
    operands to bf16 (`kind::f16`) as on sm90 (seen 2026-12-07, Triton 3.9)."""
    shapes = [
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (256, 64, 128, 4, 4),
        (64, 256, 128, 4, 4),
        (128, 128, 128, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 32, 64, 4, 4),
    ]
    if path == "expand_bf16":
        shapes = [shape for shape in shapes if shape[0] <= EXPAND_BF16_MAX_BLOCK_M]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w,
            pre_hook=set_tma_boxes if tma else None,
        )
        for bm, bn, bk, s, w in shapes
    ]


@dataclass(frozen=True)
class AttentionShape:
    """One autotune config of an MX attention kernel: tiles, stages, warps, and the head_dims
    (of SPILL_CHECKED_HEAD_DIMS) at which it compiles without register spills for both sm90
    and sm100, causal and not (`benchmarks/kernel_static.py`, whose results file
    tests/triton_templates/test_attention_spills.py checks this against). Not necessarily monotone:
    dQ 128 x 64 with 8 warps spilled 8 bytes at head_dim 64 (sm100, causal) and none at 128 in
    the report of 2026-12-07."""

    block_m: int
    block_n: int
    num_stages: int
    num_warps: int
    spill_free_head_dims: tuple[int, ...]

    def config(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}, num_stages=self.num_stages,
                             num_warps=self.num_warps)


# The head_dims the static report compiles every attention shape at.
SPILL_CHECKED_HEAD_DIMS = (64, 128)

# The MX attention kernels' shapes. Forward: the Triton fused-attention tutorial's (BLOCK_M
# 64/128, BLOCK_N 64, 3 stages, 4-8 warps) and 256-row tiles, which halve the K and V tile
# expansion per score. Backward ("dkdv": BLOCK_N keys per program, BLOCK_M queries per step;
# "dq": the reverse): after the tutorial's backward (dK/dV 32 x 128, dQ 128 x 32), square
# 64-tiles, the narrow shapes with 8 warps, and dQ over 256 queries. spill_free_head_dims from
# the static report of 2026-12-08 (sm90 and sm100, causal and not). Dropped, as they spill at
# head_dim 64 and 128: forward 128 x 128 with 8 warps (8 bytes per thread on sm90 at 64,
# causal; 2026-12-07), forward 64 x 128 with 4 warps (8 bytes on sm90 at 64, causal;
# 2026-12-08) and dK/dV 32 x 128 with 4 warps (96 bytes, sm90; 2026-12-07). Untimed (no GPU
# was available): on a GPU the autotuner picks among the shapes listed for the head_dim by time.
_BOTH = SPILL_CHECKED_HEAD_DIMS
_D64 = SPILL_CHECKED_HEAD_DIMS[:1]
ATTENTION_SHAPES: dict[str, tuple[AttentionShape, ...]] = {
    "fwd": (
        AttentionShape(64, 64, 3, 4, _BOTH), AttentionShape(128, 64, 3, 8, _BOTH),
        AttentionShape(256, 64, 3, 8, _D64), AttentionShape(256, 32, 3, 8, _D64),
    ),
    "dkdv": (
        AttentionShape(64, 64, 3, 4, _D64), AttentionShape(64, 128, 3, 8, _D64),
        AttentionShape(32, 64, 3, 4, _BOTH), AttentionShape(32, 128, 3, 8, _BOTH),
    ),
    "dq": (
        AttentionShape(128, 32, 3, 4, _D64), AttentionShape(64, 64, 3, 4, _BOTH),
        AttentionShape(128, 64, 3, 8, _BOTH), AttentionShape(64, 32, 3, 4, _BOTH),
        AttentionShape(128, 32, 3, 8, _BOTH), AttentionShape(256, 32, 3, 8, _D64),
    ),
}  # fmt: skip


def attention_shapes(kernel: str, head_dim: int | None = None) -> tuple[AttentionShape, ...]:
    """The shapes of MX attention kernel `kernel` ("fwd", "dkdv", "dq") for `head_dim` (None:
    all, what the static report compiles): those spill-free at the smallest checked head_dim
    at least head_dim (above the largest, at the largest: not compiled at head_dim itself)."""
    shapes = ATTENTION_SHAPES[kernel]
    if head_dim is None:
        return shapes
    checked = min([h for h in SPILL_CHECKED_HEAD_DIMS if h >= head_dim] or [SPILL_CHECKED_HEAD_DIMS[-1]])
    return tuple(s for s in shapes if checked in s.spill_free_head_dims)


def attention_autotune_configs(head_dim: int | None = None) -> list[triton.Config]:
    """Tile configs of the MX attention forward kernel for `head_dim` (`attention_shapes`)."""
    return [shape.config() for shape in attention_shapes("fwd", head_dim)]


def attention_backward_autotune_configs(kernel: str, head_dim: int | None = None) -> list[triton.Config]:
    """Tile configs of the MX attention backward kernel `kernel` ("dkdv", "dq") for `head_dim`
    (`attention_shapes`)."""
    return [shape.config() for shape in attention_shapes(kernel, head_dim)]


def interpreter_quantize_config() -> dict[str, int]:
    return {"BLOCK_M": 64, "BLOCK_N": 64}


def interpreter_mx_mm_config() -> dict[str, int]:
    return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}


def interpreter_attention_config() -> dict[str, int]:
    return {"BLOCK_M": 32, "BLOCK_N": 32}


def interpreter_attention_backward_config() -> dict[str, int]:
    return {"BLOCK_M": 64, "BLOCK_N": 64}  # ~3x faster than 32 x 32 under the interpreter


# FP4 GEMM (`mx_gemm_fp4`): BLOCK_K in elements (half as many packed bytes per row). The first
# shape of each list is the static choice (`kernel_static.static_choice`: no spills, then the
# fewest main-loop instructions per product; 2026-12-07, 4096^3, MXFP4 and NVFP4 alike), the one
# the AOT tests compile (tests/triton_templates/test_fp4_gemm_kernel.py). Untimed on a GPU.
# dot_scaled: BLOCK_M >= 128, as sm100 lowers tl.dot_scaled to the block-scaled MMA only there
# (with BLOCK_M 64 it upcasts, `mx_mm_autotune_configs`); expand_bf16: BLOCK_M <= 128, as the
# FP8 expand_bf16 loop (EXPAND_BF16_MAX_BLOCK_M).
FP4_GEMM_SHAPES: dict[str, list[tuple[int, int, int, int, int]]] = {
    "dot_scaled": [(256, 128, 256, 3, 8), (128, 256, 256, 3, 8), (128, 128, 256, 3, 4), (128, 128, 128, 4, 4)],
    "expand_bf16": [(128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)],
}


def fp4_mm_autotune_configs(path: str) -> list[triton.Config]:
    """Tile configs of the FP4 GEMM kernel's main loop `path` (FP4_GEMM_SHAPES)."""
    if path not in FP4_GEMM_SHAPES:
        raise ValueError(f"path={path!r}: the FP4 GEMM's main loops are {sorted(FP4_GEMM_SHAPES)}")
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in FP4_GEMM_SHAPES[path]
    ]


def interpreter_fp4_mm_config() -> dict[str, int]:
    return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
