"""mxcompile::grouped_mm: the grouped GEMM of MoE experts in any floating dtype.

    grouped_mm(a, b, offs) with offs (E,) the cumulative row count of each group (int32/int64):
      rows form         a (S, K), b (E, K, N) -> (S, N): rows offs[e-1]:offs[e] of a times b[e]
      contraction form  a (M, S), b (S, N) -> (E, M, N): a[:, group e] times b[group e, :]

The semantics of `aten._grouped_mm`, which accepts only bf16 operands under torch.compile (its
meta function checks the dtype). transformers computes its fp32 experts with a fallback op of
these semantics; gemm_rewrite replaces that op by this one so that the expert GEMMs can be MX
(passes/grouped_gemm). Rows past offs[-1] of the rows form are zero. The reference is a loop
over the groups (the group sizes are data); it serves every device.
"""

from __future__ import annotations

import torch


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


@torch.library.custom_op("mxcompile::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped product of a and b over the groups offs delimits (module docstring)."""
    if b.ndim == 3:  # rows form
        out = a.new_zeros(a.shape[0], b.shape[2])
        for group, (start, end) in enumerate(_group_bounds(offs)):
            if end > start:
                torch.mm(a[start:end], b[group], out=out[start:end])
        return out
    out = a.new_zeros(offs.shape[0], a.shape[0], b.shape[1])
    for group, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[group])
    return out


@grouped_mm_op.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.ndim != 2 or b.ndim not in (2, 3) or offs.ndim != 1:
        raise ValueError(f"mxcompile::grouped_mm takes a 2-D a, a 2-D or 3-D b and 1-D offsets; got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(offs.shape)}")
    if b.ndim == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


GROUPED_MM = torch.ops.mxcompile.grouped_mm.default
