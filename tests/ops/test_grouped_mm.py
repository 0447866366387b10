"""mxcompile::grouped_mm: both forms against per-group torch.mm written here, opcheck (fake
shapes and strides), and agreement with aten._grouped_mm where aten takes the dtype (bf16)."""

from __future__ import annotations

import pytest
import torch

from mxcompile.ops.grouped_mm import GROUPED_MM

OFFSETS = (5, 5, 17, 24)  # an empty group, and rows past the last offset in the rows form
S, K, N = 30, 16, 8


def _offsets() -> torch.Tensor:
    return torch.tensor(OFFSETS, dtype=torch.int32)


def test_rows_form_is_each_group_times_its_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(S, K, generator=g), torch.randn(len(OFFSETS), K, N, generator=g)
    out = GROUPED_MM(a, b, _offsets())
    start = 0
    for group, end in enumerate(OFFSETS):
        assert torch.equal(out[start:end], a[start:end] @ b[group]), group
        start = end
    assert torch.equal(out[OFFSETS[-1]:], torch.zeros(S - OFFSETS[-1], N))


def test_contraction_form_sums_each_groups_rows() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(K, S, generator=g), torch.randn(S, N, generator=g)
    out = GROUPED_MM(a, b, _offsets())
    assert out.shape == (len(OFFSETS), K, N)
    start = 0
    for group, end in enumerate(OFFSETS):
        assert torch.equal(out[group], a[:, start:end] @ b[start:end]), group
        start = end


@pytest.mark.parametrize("form", ["rows", "contraction"])
def test_opcheck(form: str) -> None:
    g = torch.Generator().manual_seed(2)
    if form == "rows":
        args = (torch.randn(S, K, generator=g), torch.randn(len(OFFSETS), K, N, generator=g), _offsets())
    else:
        args = (torch.randn(K, S, generator=g), torch.randn(S, N, generator=g), _offsets())
    torch.library.opcheck(torch.ops.mxcompile.grouped_mm, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_equals_aten_grouped_mm_in_bf16() -> None:
    g = torch.Generator().manual_seed(3)
    offs = torch.tensor((8, 8, 24, 32), dtype=torch.int32)
    a, b = torch.randn(32, K, generator=g).bfloat16(), torch.randn(4, K, N, generator=g).bfloat16()
    torch.testing.assert_close(GROUPED_MM(a, b, offs), torch._grouped_mm(a, b, offs=offs), rtol=1e-2, atol=1e-2)
