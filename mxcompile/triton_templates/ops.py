"""The generated kernels as `torch.library.triton_op` operators, and a graph hook that swaps the
pure-PyTorch MX ops for them on CUDA.

    mxcompile::triton_quantize(x, axis, elem, scale_mode, block_size) -> (data, scale_u8)
    mxcompile::triton_mx_mm(a, a_scale, b, b_scale, block_size, out_dtype) -> c

Their schemas are those of `mxcompile::quantize` and `mxcompile::mx_mm` (mxcompile/ops.py), so
they are drop-in replacements. Because they are `triton_op`s, `torch.compile` / AOTAutograd
trace into them and Inductor sees `triton_kernel_wrapper_functional` nodes holding the
generated `JITFunction`s (or their autotuners). Importing this module needs no GPU: decorating
a kernel is pure Python; only launching one needs a device (or TRITON_INTERPRET=1 for CPU
tensors).

`use_triton_kernels(gm)` is the lowering hook: it rewrites the `mxcompile::quantize` and
`mxcompile::mx_mm` nodes of an FX graph whose tensors are on CUDA into the Triton ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import triton_op, wrap_triton

from .. import ops as _reference_ops  # noqa: F401  (registers mxcompile::quantize / mx_mm)
from ..numerics.formats import elem_format, scale_mode
from . import _interpreting, _operand_elem, resolve_gemm_path

__all__ = ["TRITON_REPLACEMENTS", "triton_mx_mm", "triton_quantize", "use_triton_kernels"]


def _interpret_for(t: torch.Tensor) -> bool:
    """Interpreter kernels only for real CPU tensors under TRITON_INTERPRET=1. CUDA tensors and
    fake tensors (tracing) get real JITFunctions: wrap_triton traces only those, and decorating
    one needs no GPU."""
    from torch._subclasses.fake_tensor import is_fake

    return _interpreting() and t.device.type == "cpu" and not is_fake(t)


@triton_op("mxcompile::triton_quantize", mutates_args=())
def triton_quantize(
    x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize x along axis with the generated Triton kernel (contiguous outputs)."""
    from .quantize import quantize_launch

    fmt = elem_format(elem)
    mode = _scale_mode(scale_mode)
    axis = axis % x.ndim
    interpret = _interpret_for(x)
    if axis == x.ndim - 1 or (x.ndim == 2 and axis == 0):
        rowwise = axis == x.ndim - 1
        x2 = x.reshape(-1, x.shape[-1]) if rowwise else x
        row_d, row_s, col_d, col_s = quantize_launch(
            x2, rowwise=rowwise, colwise=not rowwise, fmt=fmt, mode=mode,
            block_size=block_size, interpret=interpret, wrap=wrap_triton,
        )  # fmt: skip
        if rowwise:
            scale_shape = (*x.shape[:-1], x.shape[-1] // block_size)
            return row_d.reshape(x.shape), row_s.reshape(scale_shape)
        return col_d, col_s
    # Any other axis: move it last (a copy), quantize row-wise, move it back (a copy).
    moved = x.movedim(axis, -1).contiguous()
    row_d, row_s, _, _ = quantize_launch(
        moved.reshape(-1, moved.shape[-1]), rowwise=True, colwise=False, fmt=fmt, mode=mode,
        block_size=block_size, interpret=interpret, wrap=wrap_triton,
    )  # fmt: skip
    data = row_d.reshape(moved.shape).movedim(-1, axis).contiguous()
    scale = row_s.reshape(*moved.shape[:-1], -1).movedim(-1, axis).contiguous()
    return data, scale


@triton_op("mxcompile::triton_mx_mm", mutates_args=())
def triton_mx_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """MX GEMM with the generated Triton kernel: a (..., M, K) along K times b (K, N) along K."""
    from .mx_gemm import MXMMKey, mx_mm_launch

    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    a_scale2 = a_scale.reshape(-1, a_scale.shape[-1])
    key = MXMMKey(_operand_elem(a, "a"), _operand_elem(b, "b"))
    c, _, _ = mx_mm_launch(
        a2, a_scale2, b, b_scale, block_size=block_size, out_dtype=out_dtype, key=key,
        use_dot_scaled=resolve_gemm_path("auto", a.device, block_size),
        interpret=_interpret_for(a), wrap=wrap_triton,
    )  # fmt: skip
    assert c is not None
    return c.reshape(*lead, b.shape[-1])


_scale_mode = scale_mode

# Reference op -> Triton op with the same schema.
TRITON_REPLACEMENTS: dict[Any, Any] = {
    torch.ops.mxcompile.quantize.default: torch.ops.mxcompile.triton_quantize.default,
    torch.ops.mxcompile.mx_mm.default: torch.ops.mxcompile.triton_mx_mm.default,
}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _replaceable(node: torch.fx.Node) -> bool:
    """Whether a reference-op node can run as the Triton op: CUDA tensors, supported args."""
    from . import triton_available

    if node.target is torch.ops.mxcompile.quantize.default:
        x, _axis, elem, _mode, block_size = node.args
        val = _val(x)
        device_ok = val is not None and val.device.type == "cuda"
        return device_ok and triton_available(val.device, elem=elem, block_size=block_size)[0]
    if node.target is torch.ops.mxcompile.mx_mm.default:
        a, _sa, b, _sb, block_size, _dtype = node.args
        va, vb = _val(a), _val(b)
        if va is None or vb is None or va.device.type != "cuda" or vb.ndim != 2:
            return False
        return triton_available(va.device, block_size=block_size)[0]
    return False


def use_triton_kernels(gm: torch.fx.GraphModule, *, check_device: bool = True) -> int:
    """Retarget the graph's `mxcompile::quantize` / `mxcompile::mx_mm` nodes whose tensors are
    on CUDA (per `meta["val"]`) to the Triton ops; returns how many nodes were changed.

    `check_device=False` skips `triton_available` (for tracing with fake CUDA tensors on a
    machine without a GPU) but still requires CUDA tensors and a 2-D B for the GEMM.
    """
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in TRITON_REPLACEMENTS:
            continue
        if check_device:
            ok = _replaceable(node)
        else:
            vals = [_val(arg) for arg in node.args if isinstance(arg, torch.fx.Node)]
            ok = bool(vals) and all(v is not None and v.device.type == "cuda" for v in vals)
            if node.target is torch.ops.mxcompile.mx_mm.default:
                ok = ok and vals[2].ndim == 2
        if ok:
            node.target = TRITON_REPLACEMENTS[node.target]
            changed += 1
    if changed:
        gm.recompile()
    return changed
