"""Benchmark: the quantize ops on CPU with their large outputs advised MADV_HUGEPAGE, and without.

The native kernels allocate outputs of `huge_pages.ADVISED_MIN_BYTES` (32 MiB) or more with
`mxcompile.ops.native.huge_pages.empty`, which advises transparent huge pages before the kernel
writes them (see that module). This script times `mxcompile::quantize`, `fake_quantize` (bf16
out) and `dequantize` (bf16 out) along the last axis of square bf16 operands with the advice on
and off, interleaved call by call in one process (the order alternating between repeats), and
prints the medians side by side. Off, every such output is a fresh mmap paid for with a page
fault per 4 KiB on first write.

    python benchmarks/huge_pages.py                  # 4096^2, 6144^2, 8192^2, 12 repeats
    python benchmarks/huge_pages.py --sizes 2048 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from mxcompile.ops import native
from mxcompile.ops.native import huge_pages
from mxcompile.ops.quantize import DEQUANTIZE, FAKE_QUANTIZE, QUANTIZE

ADVICE_OFF = 1 << 62  # an ADVISED_MIN_BYTES no output reaches


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of fn with the advice on and off, interleaved."""
    advised = huge_pages.ADVISED_MIN_BYTES
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for repeat in range(repeats):
            for on in (True, False) if repeat % 2 else (False, True):
                huge_pages.ADVISED_MIN_BYTES = advised if on else ADVICE_OFF
                times[on].append(_timed(fn))
    finally:
        huge_pages.ADVISED_MIN_BYTES = advised
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 6144, 8192])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    if not native.available():
        print("the native kernels are not built here (mxcompile doctor says why): nothing to compare")
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 in, last axis, e4m3 rceil, "
          f"median of {args.repeats} per case, advised from {huge_pages.ADVISED_MIN_BYTES >> 20} MiB")
    print(f"  {'size':>6} {'op':<14} {'output MiB':>10} {'advised ms':>11} {'plain ms':>9} {'plain/advised':>14}")
    for n in args.sizes:
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        data, scales = QUANTIZE(x, 1, "e4m3", "rceil", 32)
        for name, fn, out_bytes in (
            ("quantize", lambda: QUANTIZE(x, 1, "e4m3", "rceil", 32), n * n),
            ("fake_quantize", lambda: FAKE_QUANTIZE(x, 1, "e4m3", "rceil", 32, torch.bfloat16), 2 * n * n),
            ("dequantize", lambda: DEQUANTIZE(data, scales, 1, 32, torch.bfloat16), 2 * n * n),
        ):
            on, off = compare(fn, args.repeats)
            print(f"  {n:>6} {name:<14} {out_bytes / 2**20:>10.0f} {on * 1e3:>11.2f} {off * 1e3:>9.2f} {off / on:>13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
