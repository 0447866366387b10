"""Large outputs of the native kernels, allocated so that their first write faults in 2 MiB pages.

glibc serves an allocation of 32 MiB or more (its largest mmap threshold on 64-bit Linux) from
a fresh mmap and unmaps it on free, so every call's output of that size is new memory, and the
kernel's first write to each 4 KiB page faults. On the 2-core VM that costs about 0.2 ms per
MiB, more than the quantization itself. Advised MADV_HUGEPAGE before the first write, the
region faults in transparent huge pages where the kernel has them: the quantize op at 8192²
(a 64 MiB fp8 output) took 15.4 ms advised against 37.6 ms plain (`benchmarks/huge_pages.py`,
interleaved, median of 12). The memory is still torch's, freed as before; nothing is
cached. Smaller outputs are left alone: they may lie in glibc's heap, where the advice would
outlive them and reach whatever the heap holds next.

Linux only. Where the advice is unavailable (another OS, a libc without madvise, a kernel
without transparent huge pages: madvise fails) the allocation is a plain `torch.empty`; where
transparent huge pages are disabled ("never") the advice is accepted and changes nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

_log = logging.getLogger(__name__)

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 * 1024 * 1024 * sizeof(long)): allocations
# of at least this size are always fresh mmaps (unless the process set M_MMAP_THRESHOLD).
ADVISED_MIN_BYTES = 32 << 20
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    """libc's madvise, or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError) as error:
        _log.debug("no madvise (%s): large native outputs use 4 KiB pages", error)
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def huge_page_range(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole huge pages inside [address, address + nbytes): (start, length), or None."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (start, end - start) if end > start else None


def empty(shape: list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on CPU, advised MADV_HUGEPAGE when it has at least
    ADVISED_MIN_BYTES (see the module docstring)."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= ADVISED_MIN_BYTES else None
    pages = huge_page_range(out.data_ptr(), nbytes) if madvise is not None else None
    if pages is not None and madvise(pages[0], pages[1], MADV_HUGEPAGE) != 0:
        _log.debug("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KiB pages", ctypes.get_errno())
    return out
