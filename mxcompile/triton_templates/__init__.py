"""Triton kernels for MX: quantize (row-wise and/or column-wise in one read), MX GEMM with fused
epilogues, and MX attention forward and backward.

Modules:
  kernels/            the `@triton.jit` kernels as plain Triton files (`kernels/mx_tile.py`
                      holds the shared helpers: MX quantization of a tile, dot_scaled operand
                      layouts, row-masked loads, named constants)
  loader              imports `kernels/` once per mode (interpreter / compiled)
  quantize, mx_gemm, attention, attention_backward
                      thin launchers, the constexpr specialisation of each kernel, and the torch
                      reference beside it, built from `mxcompile.numerics`
  configs             every autotune config list, with its origin
  common              triton-free tables (dot_scaled formats, cast strategies)
  ops                 `torch.library.triton_op` registrations and the `use_triton_kernels` hook
  aot                 compile a launch for sm90/sm100 without a GPU

Every variation of a kernel (element formats, scale mode, cast, epilogue ops, tiles) is a
`tl.constexpr` meta-parameter: Triton specialises and caches a compiled kernel per value.

Direct use (the public `kernel=` switch of mxcompile is wired by the caller):
    triton_available(device, elem=..., block_size=...) -> (ok, reason)
    quantize_mx_triton(x, axis, elem, scale_mode, block_size) -> (fp8 data, uint8 scales)
    quantize_mx_triton_rowcol(x, ...) -> (row data, row scales, col data, col scales)
    mx_mm_triton(a, a_scale, b, b_scale, block_size, out_dtype, epilogue=..., ...)
    mx_attention_triton(q, q_scale, k, k_scale, v, v_scale, ..., return_lse=...)
    mx_attention_backward_triton(operands, out, grad_out, lse, ...) -> (dq, dk, dv)
Each raises RuntimeError("the MX Triton kernels cannot run: <reason>") when triton_available
says no, and ValueError for bad arguments, before anything reaches Triton.

Running on the CPU needs TRITON_INTERPRET=1. Triton 3.9 reads it when a function is decorated:
for our kernels when `loader` imports them, so setting it in-process before the first call is
enough (the kernels avoid triton.language.standard's `@jit` helpers, which are decorated at
`import triton`). The interpreter is slow, and its bf16 conversions are inexact (fp32->bf16
truncates; bf16 subnormals are mangled on upcast), which the kernels and tests account for.
Importing this package needs neither triton nor a GPU (triton is imported on first use).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..numerics.formats import ElemFormat, ScaleMode, elem_format, scale_mode_named
from ..numerics.quantize import check_quantizable
from .loader import loaded_kernel_sources

__all__ = [
    "mx_attention_backward_triton",
    "mx_attention_triton",
    "mx_mm_triton",
    "quantize_mx_triton",
    "quantize_mx_triton_rowcol",
    "triton_available",
    "loaded_kernel_sources",
]

# Triton's fp8 types: E4M3 needs sm89+ (Ada/Hopper); tl.dot_scaled is native on sm100+ (Triton
# emulates it below, upcasting the operands to bf16).
MIN_CUDA_CAPABILITY = (8, 9)
NATIVE_DOT_SCALED_CAPABILITY = (10, 0)
TRITON_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPE_TO_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def has_mx_tensor_cores(device: torch.device) -> bool:
    """Whether `device` is a GPU whose tensor cores multiply MX operands (sm100+), where
    tl.dot_scaled is native rather than emulated through bf16."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():  # fake CUDA tensors on a GPU-less machine
        return False
    return torch.cuda.get_device_capability(device) >= NATIVE_DOT_SCALED_CAPABILITY


def _interpreting() -> bool:
    from .loader import interpreter_enabled

    return interpreter_enabled()


def triton_available(
    device: torch.device | str | None = None,
    *,
    elem: str | ElemFormat | None = None,
    block_size: int | None = None,
) -> tuple[bool, str]:
    """Whether the Triton kernels can run for tensors on `device` (None: the current CUDA
    device), and why not. Never raises: the reason says what is missing."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton cannot be imported ({type(exc).__name__}: {exc})"
    if elem is not None:
        try:
            elem_format(elem)
        except ValueError as exc:
            return False, f"unsupported element format: {exc}"
    if block_size is not None:
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size < 16
            or block_size & (block_size - 1)
        ):
            return False, (
                f"block_size={block_size!r}: the Triton kernels need a power of two >= 16 "
                f"(tl.arange sizes are powers of two; FP8 tl.dot needs K >= 16); MX uses 32"
            )
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if _interpreting():
        return True, f"Triton interpreter (TRITON_INTERPRET=1), tensors on {dev}; slow"
    if dev.type != "cuda":
        return False, (
            f"tensors are on {dev.type!r}: the Triton kernels need a CUDA GPU, or "
            "TRITON_INTERPRET=1 in the environment to run them on the CPU under the interpreter"
        )
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is available (torch.cuda.is_available() is False)"
    if torch.version.hip is not None:
        return False, "ROCm GPUs: the MX Triton kernels are untested there (FP8 types differ)"
    capability = torch.cuda.get_device_capability(dev)
    if capability < MIN_CUDA_CAPABILITY:
        return False, (
            f"GPU compute capability {capability} < {MIN_CUDA_CAPABILITY}: Triton's FP8 types "
            "need Ada, Hopper or newer"
        )
    return True, f"CUDA GPU sm{capability[0]}{capability[1]}"


def _require(
    device: torch.device, *, elem: str | None = None, block_size: int | None = None
) -> None:
    ok, reason = triton_available(device, elem=elem, block_size=block_size)
    if not ok:
        raise RuntimeError(f"the MX Triton kernels cannot run: {reason}")



def _check_tiles(tiles: dict[str, int] | None, needs: dict[str, int]) -> None:
    if tiles is None:
        return
    for name, multiple in needs.items():
        value = tiles.get(name)
        if not isinstance(value, int) or value <= 0 or value & (value - 1) or value % multiple:
            raise ValueError(
                f"tiles[{name!r}]={value!r}: use a power of two that is a multiple of {multiple}"
            )


def quantize_mx_triton(
    x: torch.Tensor,
    axis: int = -1,
    elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = 32,
    *,
    cast: str = "software",
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize `x` along `axis` with the Triton kernel: (FP8 data of x's shape, uint8 scale
    bytes with `axis` divided by block_size), bit-identical to `mxcompile.numerics.quantize_along`.

    Supported: the last axis of any tensor (leading dimensions are flattened), and axis 0 of a
    2-D tensor. `tiles` ({"BLOCK_M", "BLOCK_N"}) overrides the autotuned tile sizes.
    """
    fmt = elem_format(elem)
    scale_mode = scale_mode_named(scale_mode)
    axis = check_quantizable(x, axis, block_size)
    _require(x.device, elem=fmt.name, block_size=block_size)
    if axis == x.ndim - 1:
        x2 = x.reshape(-1, x.shape[-1])
        rowwise = True
    elif x.ndim == 2 and axis == 0:
        x2 = x
        rowwise = False
    else:
        raise ValueError(
            f"axis={axis} of a {x.ndim}-d tensor: the Triton quantize kernel supports the last "
            "axis, or axis 0 of a 2-D tensor; move the axis first (x.movedim) or use kernel='torch'"
        )
    return _quantize_2d(x2, rowwise, fmt, scale_mode, block_size, cast, tiles, out_shape=x.shape)


def _quantize_2d(
    x2: torch.Tensor,
    rowwise: bool,
    fmt: ElemFormat,
    scale_mode: ScaleMode,
    block_size: int,
    cast: str,
    tiles: dict[str, int] | None,
    out_shape: torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .quantize import quantize_launch

    _check_tiles(tiles, {"BLOCK_N": block_size} if rowwise else {"BLOCK_M": block_size})
    row_d, row_s, col_d, col_s = quantize_launch(
        x2, rowwise=rowwise, colwise=not rowwise, fmt=fmt, scale_mode=scale_mode, block_size=block_size,
        cast=cast, tiles=tiles, interpret=_interpreting(),
    )  # fmt: skip
    if rowwise:
        scale_shape = (*out_shape[:-1], out_shape[-1] // block_size)
        return row_d.reshape(out_shape), row_s.reshape(scale_shape)
    return col_d, col_s


def quantize_mx_triton_rowcol(
    x: torch.Tensor,
    elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = 32,
    *,
    cast: str = "software",
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One read of 2-D `x` writes both MX copies: (row data, row scales (M, N/bs), col data,
    col scales (M/bs, N)), as `quantize_along(x, 1, ...)` and `quantize_along(x, 0, ...)`."""
    from .quantize import quantize_launch

    fmt = elem_format(elem)
    scale_mode = scale_mode_named(scale_mode)
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError("quantize_mx_triton_rowcol needs a 2-D tensor")
    check_quantizable(x, 0, block_size)
    check_quantizable(x, 1, block_size)
    _require(x.device, elem=fmt.name, block_size=block_size)
    _check_tiles(tiles, {"BLOCK_M": block_size, "BLOCK_N": block_size})
    return quantize_launch(  # type: ignore[return-value]
        x, rowwise=True, colwise=True, fmt=fmt, scale_mode=scale_mode, block_size=block_size, cast=cast,
        tiles=tiles, interpret=_interpreting(),
    )  # fmt: skip


def _operand_elem(t: torch.Tensor, name: str) -> str:
    if not isinstance(t, torch.Tensor) or t.dtype not in _FP8_DTYPE_TO_ELEM:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an FP8 tensor ({list(_FP8_DTYPE_TO_ELEM)}), got {got}")
    return _FP8_DTYPE_TO_ELEM[t.dtype]


def _scale_u8(t: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise ValueError(f"{name} must be uint8 (or float8_e8m0fnu) E8M0 scale bytes")
    return t


# The GPU generation on which "auto" takes the expand_bf16 main loop: Hopper (sm90). See
# `resolve_gemm_path` for the comparison that decided it.
EXPAND_BF16_CAPABILITY = (9, 0)


def resolve_gemm_path(path: str, block_size: int, capability: tuple[int, int] | None = None) -> str:
    """The MX GEMM main loop (`mx_gemm.GEMM_PATHS`) for `path` ("auto" or one of them) on a GPU
    of compute `capability` (None: the interpreter, or no GPU).

    "auto": "fp8_per_block" for blocks other than tl.dot_scaled's MX group of 32; else
    "expand_bf16" on sm90 and "dot_scaled" elsewhere (sm100+: block-scaled tensor-core MMA).
    The sm90 rule is a static comparison, decided without a GPU (`benchmarks/kernel_static.py`,
    `targets.sm90.gemm_comparison` in benchmarks/results/kernel_static.json, 2026-12-07):
    compiled for sm90 with the same autotune configs and each path's static choice (fewest
    spills, then fewest instructions), the expand_bf16 loop issues 0.52x the instructions per
    product of dot_scaled's (Triton's own upcast of the operands to bf16, whose larger tiles
    spill) and spills nothing; both load the same FP8 bytes. Untimed on a GPU so far
    (`benchmarks/gpu_session.sh` times both). Before it, "auto" took tl.dot_scaled on sm90
    too: on an H200 (2026-12-04) it ran at 193-194 TFLOP/s against fp8_per_block's 120."""
    if path == "auto":
        if block_size != 32:
            return "fp8_per_block"
        if capability is not None and capability[0] == EXPAND_BF16_CAPABILITY[0]:
            return "expand_bf16"
        return "dot_scaled"
    from .mx_gemm import GEMM_PATHS

    if path not in GEMM_PATHS:
        raise ValueError(f"path={path!r} is not accepted; use 'auto' or one of {list(GEMM_PATHS)}")
    if path == "dot_scaled" and block_size != 32:
        raise ValueError("path='dot_scaled' needs block_size=32 (tl.dot_scaled's MX group)")
    return path


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA `device` with a GPU behind it, else None."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def check_tma(a: torch.Tensor, b: torch.Tensor, path: str) -> None:
    """Raise ValueError naming what keeps the MX GEMM from reading these FP8 operands through
    TMA descriptors (`mx_gemm`'s USE_TMA): the fp8_per_block path, a layout a descriptor cannot
    describe (`mx_gemm.tma_unsupported`), a GPU before sm90. The interpreter runs it.

    Opt-in (`mx_mm_triton(tma=True)`), not the default on sm100 yet: it is not timed on a GPU,
    and compiled for sm100 without one (`benchmarks/gpu_kernels.py --pipelining 100`) the K
    loop copies the operand tiles with `cp.async.bulk.tensor` but, in 5 of the 8 autotune
    configs, loads the scales synchronously (a tile's scale rows are 2-4 bytes, under
    `cp.async`'s and TMA's minimums), which may stall it. `gpu_kernels.py` times both."""
    from .mx_gemm import TMA_PATHS, tma_unsupported

    reason = None if path in TMA_PATHS else f"TMA serves the {', '.join(TMA_PATHS)} path only (path={path!r} loads per scale block)"
    reason = reason or tma_unsupported(a, b)
    if reason is None and a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) < (9, 0):
        reason = f"TMA needs sm90+, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(a.device)))}"
    if reason is not None:
        raise ValueError(f"tma=True: {reason}")


def mx_mm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
    epilogue: Sequence[str] | str | None = (),
    *,
    bias: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    quantize_output: str | None = None,
    output_scale_mode: str = "rceil",
    keep_output: bool = False,
    path: str = "auto",
    tma: bool = False,
    cast: str = "software",
    tiles: dict[str, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """MX GEMM `epilogue(a @ b)` with the Triton kernel.

    a: (M, K) FP8 quantized along K, a_scale: (M, K/bs) uint8; b: (K, N) FP8 quantized along K,
    b_scale: (K/bs, N) uint8 (e.g. from `quantize_along(w, 0, ...)`). `epilogue` lists ops from
    `mx_gemm.EPILOGUE_OPS` in the order to apply them (bias, gelu_tanh, gelu_erf, silu, mul,
    residual), with their tensors given as `bias` (N,), `mul` (M, N), `residual` (M, N).

    Returns C (M, N) in out_dtype; with `quantize_output="e4m3"|"e5m2"` returns the MX copy of C
    along its last axis, (data, scales (M, N/bs)), and with `keep_output=True` (C, data, scales).
    `path`: "auto" (see `resolve_gemm_path`), "dot_scaled", "expand_bf16", "fp8_per_block"
    (`mx_gemm.GEMM_PATHS`). `tma=True`: read the FP8 operands through TMA descriptors (see
    `check_tma`). `tiles` ({"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}) overrides autotuning.
    """
    from .mx_gemm import MXMMKey, check_epilogue, mx_mm_launch

    a_elem = _operand_elem(a, "a")
    b_elem = _operand_elem(b, "b")
    a_scale = _scale_u8(a_scale, "a_scale")
    b_scale = _scale_u8(b_scale, "b_scale")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"contraction lengths differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if k % block_size:
        raise ValueError(f"K={k} is not a multiple of block_size={block_size}")
    if tuple(a_scale.shape) != (m, k // block_size):
        expected = (m, k // block_size)
        raise ValueError(f"a_scale has shape {tuple(a_scale.shape)}, expected {expected}")
    if tuple(b_scale.shape) != (k // block_size, n):
        expected = (k // block_size, n)
        raise ValueError(f"b_scale has shape {tuple(b_scale.shape)}, expected {expected}")
    if out_dtype not in TRITON_OUT_DTYPES:
        raise ValueError(
            f"out_dtype={out_dtype} is not accepted; use one of {list(TRITON_OUT_DTYPES)}"
        )
    ops = check_epilogue(epilogue)
    tensors = {"bias": (bias, (n,)), "mul": (mul, (m, n)), "residual": (residual, (m, n))}
    for name, (t, shape) in tensors.items():
        if (name in ops) != (t is not None):
            raise ValueError(
                f"epilogue {list(ops)} and the {name!r} tensor disagree: pass `{name}` exactly "
                f"when the epilogue lists {name!r}"
            )
        if t is not None and (tuple(t.shape) != shape or not t.dtype.is_floating_point):
            raise ValueError(f"{name} must be a floating-point tensor of shape {shape}")
    for name, t in (("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("bias", bias),
                    ("mul", mul), ("residual", residual)):  # fmt: skip
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a is on {a.device}")
    out_elem = "e4m3"
    if quantize_output is not None:
        out_elem = elem_format(quantize_output, argument="quantize_output").name
        if n % block_size:
            raise ValueError(f"quantize_output needs N={n} to be a multiple of block_size")
    scale_mode_named(output_scale_mode, argument="output_scale_mode")
    _require(a.device, block_size=block_size)
    main_loop = resolve_gemm_path(path, block_size, device_capability(a.device))
    if tma:
        check_tma(a, b, main_loop)
    _check_tiles(
        tiles,
        {
            "BLOCK_K": block_size,
            "BLOCK_M": 16,
            "BLOCK_N": max(16, block_size) if quantize_output is not None else 16,
        },
    )
    key = MXMMKey(a_elem, b_elem, ops, out_elem, output_scale_mode, cast)
    c, q_data, q_scale = mx_mm_launch(
        a, a_scale, b, b_scale, block_size=block_size, out_dtype=out_dtype, key=key,
        path=main_loop, use_tma=tma, store_c=quantize_output is None or keep_output,
        quantize_out=quantize_output is not None, bias=bias, mul=mul, residual=residual,
        tiles=tiles, interpret=_interpreting(),
    )  # fmt: skip
    if quantize_output is None:
        return c  # type: ignore[return-value]
    if keep_output:
        return c, q_data, q_scale  # type: ignore[return-value]
    return q_data, q_scale  # type: ignore[return-value]


def mx_attention_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """MX attention forward; see `attention.mx_attention_triton`."""
    from .attention import mx_attention_triton as _impl

    return _impl(*args, **kwargs)


def mx_attention_backward_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    """MX attention backward; see `attention_backward.mx_attention_backward_triton`."""
    from .attention_backward import mx_attention_backward_triton as _impl

    return _impl(*args, **kwargs)
