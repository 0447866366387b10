"""Large outputs of the native kernels advised MADV_HUGEPAGE (mxcompile/ops/native/huge_pages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mxcompile.numerics import elem_format, scale_mode_named
from mxcompile.ops import native
from mxcompile.ops.native import huge_pages

MIB = 1 << 20
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and all(c in "0123456789abcdef-" for c in fields[0]):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "VmFlags:":
            return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(
    ("address", "nbytes", "expected"),
    [
        (0, 4 * MIB, (0, 4 * MIB)),  # aligned both ends
        (64, 4 * MIB, (2 * MIB, 2 * MIB)),  # start rounds up, end down
        (2 * MIB - 16, 2 * MIB + 32, (2 * MIB, 2 * MIB)),
        (64, 2 * MIB, None),  # no whole huge page inside
        (0, 2 * MIB - 1, None),
    ],
)
def test_huge_page_range_is_the_whole_huge_pages_inside(address, nbytes, expected):
    assert huge_pages.huge_page_range(address, nbytes) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP_SYSFS.exists(),
                    reason="transparent huge pages are a Linux feature")
def test_a_large_output_is_advised_and_a_small_one_is_a_plain_allocation():
    large = huge_pages.empty([huge_pages.ADVISED_MIN_BYTES // 2 + MIB, 2], torch.uint8)
    assert large.shape == (huge_pages.ADVISED_MIN_BYTES // 2 + MIB, 2) and large.dtype == torch.uint8
    assert "hg" in _vm_flags(large.data_ptr() + huge_pages.HUGE_PAGE_BYTES)  # MADV_HUGEPAGE's flag
    small = huge_pages.empty([4, 8], torch.bfloat16)
    assert small.shape == (4, 8) and small.dtype == torch.bfloat16


def test_a_failing_madvise_leaves_a_plain_allocation(monkeypatch):
    calls = []

    def failing_madvise(start, length, advice):
        calls.append((start, length, advice))
        return -1

    monkeypatch.setattr(huge_pages, "_madvise", lambda: failing_madvise)
    out = huge_pages.empty([huge_pages.ADVISED_MIN_BYTES], torch.uint8)
    assert out.numel() == huge_pages.ADVISED_MIN_BYTES
    assert len(calls) == 1 and calls[0][2] == huge_pages.MADV_HUGEPAGE


def test_the_quantize_op_on_an_advised_output_equals_the_numerics_core(monkeypatch):
    """The advice is about pages only: an output advised at any size holds the same bytes."""
    if not native.available():
        pytest.skip("native kernels not built")
    monkeypatch.setattr(huge_pages, "ADVISED_MIN_BYTES", 0)
    from mxcompile.numerics import quantize_along

    x = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    fmt, mode = elem_format("e4m3"), scale_mode_named("rceil")
    data, scales = native.quantize(x, 1, fmt, mode, 32)
    want_data, want_scales = quantize_along(x, 1, fmt, mode, 32)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scales.view(-1), want_scales.view(torch.uint8).reshape(-1))
