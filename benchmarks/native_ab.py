"""Benchmark: two builds of the native quantize kernels (`mxcompile/ops/native/quantize.cpp`)
side by side, calls interleaved in one process, so that the machine's drift between runs
(10-20% here, sometimes 2x) falls on both alike.

The baseline is the source at a git revision (`--base`), the candidate the working tree's (or
`--candidate-rev`). Both are compiled with the flags of `ops.native.build` by the C++ compiler
Inductor uses; each case calls the op's native entry point (`ops.native.quantize`,
`fake_quantize`, `dequantize`) with one build's kernels, then the other's, `--repeats` times,
and prints the medians and their ratio (B/A < 1: the candidate is faster) with whether both
builds gave the same bits. Outputs are allocated once per case and reused (`huge_pages.empty`
is replaced), so page faults of fresh allocations stay out of the kernels' comparison.

    python benchmarks/native_ab.py --base 8059671              # before bf16 bit rounding
    python benchmarks/native_ab.py --base HEAD --shapes 64x64 --repeats 2 --threads 1   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from mxcompile.numerics import ELEM_FORMATS, ScaleMode
from mxcompile.ops import native
from mxcompile.ops.native import build

REPO = Path(__file__).resolve().parents[1]
SOURCE_IN_REPO = build.SOURCE.relative_to(REPO).as_posix()


def _source_copy(revision: str | None, directory: Path, label: str) -> Path:
    """quantize.cpp as it is at `revision` (None: the working tree's), copied into `directory`
    (its build is written beside it, never into the repository)."""
    if revision is None:
        text = build.SOURCE.read_text()
    else:
        shown = subprocess.run(["git", "show", f"{revision}:{SOURCE_IN_REPO}"], cwd=REPO,
                               capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"native_ab.py: no {SOURCE_IN_REPO} at revision {revision!r} "
                             f"({shown.stderr.strip()}); give a commit of this repository that has it, "
                             "e.g. --base HEAD")
        text = shown.stdout
    path = directory / f"quantize-{label}.cpp"
    path.write_text(text)
    return path


def _built(source: Path) -> dict[str, ctypes._CFuncPtr]:
    from torch._inductor.cpp_builder import get_cpp_compiler

    library = source.with_suffix(".so")
    command = [get_cpp_compiler(), *build.FLAGS, build.OPENMP_FLAG, str(source), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return native.bind_kernels(ctypes.CDLL(str(library)))


@contextlib.contextmanager
def _kernels(kernels: dict[str, ctypes._CFuncPtr]) -> Iterator[None]:
    """The native entry points run this build's kernels inside the block."""
    saved = native._kernels
    native._kernels = lambda: kernels
    try:
        yield
    finally:
        native._kernels = saved


@contextlib.contextmanager
def _reused_outputs() -> Iterator[None]:
    saved = native.huge_pages.empty
    outputs: dict[tuple, torch.Tensor] = {}
    native.huge_pages.empty = lambda shape, dtype: outputs.setdefault((tuple(shape), dtype), saved(shape, dtype))
    try:
        yield
    finally:
        native.huge_pages.empty = saved


def _bits(t: torch.Tensor | tuple) -> list[torch.Tensor]:
    tensors = t if isinstance(t, tuple) else (t,)
    return [x.view(torch.uint8).clone() for x in tensors]


BLOCK_SIZE = 32


def _shape(text: str) -> tuple[int, int]:
    """--shapes' ROWSxCOLUMNS, both positive multiples of the block size (both axes are quantized)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give ROWSxCOLUMNS, e.g. 4096x4096")
    rows, columns = int(parts[0]), int(parts[1])
    if not rows or not columns or rows % BLOCK_SIZE or columns % BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and columns must be positive multiples of the block size "
                                         f"{BLOCK_SIZE} (the cases quantize along both)")
    return rows, columns


def _cases(shape: tuple[int, int], elem: str) -> list[tuple[str, Callable[[], object]]]:
    fmt, rceil, floor = ELEM_FORMATS[elem], ScaleMode.RCEIL, ScaleMode.FLOOR
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data, scales = native.quantize(x, 1, fmt, rceil, BLOCK_SIZE)
    return [
        ("quantize rows", lambda: native.quantize(x, 1, fmt, rceil, BLOCK_SIZE)),
        ("quantize columns", lambda: native.quantize(x, 0, fmt, rceil, BLOCK_SIZE)),
        ("quantize rows, floor", lambda: native.quantize(x, 1, fmt, floor, BLOCK_SIZE)),
        ("fake quantize rows", lambda: native.fake_quantize(x, 1, fmt, rceil, BLOCK_SIZE, torch.bfloat16)),
        ("fake quantize columns", lambda: native.fake_quantize(x, 0, fmt, rceil, BLOCK_SIZE, torch.bfloat16)),
        ("fake quantize rows, floor", lambda: native.fake_quantize(x, 1, fmt, floor, BLOCK_SIZE, torch.bfloat16)),
        ("dequantize rows", lambda: native.dequantize(data, scales, 1, BLOCK_SIZE, torch.bfloat16)),
    ]


def compare(a: dict, b: dict, fn: Callable[[], object], repeats: int) -> tuple[float, float, bool]:
    """Medians of A and B over `repeats` interleaved calls (after two each), and whether their
    outputs have the same bits."""
    outputs = []
    for kernels in (a, b):
        with _kernels(kernels):
            outputs.append(_bits(fn()))
            fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for kernels, timed in zip((a, b), times):
            with _kernels(kernels):
                start = time.perf_counter()
                fn()
                timed.append(time.perf_counter() - start)
    same = all(torch.equal(x, y) for x, y in zip(*outputs))
    return statistics.median(times[0]), statistics.median(times[1]), same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of the baseline's quantize.cpp (A)")
    parser.add_argument("--candidate-rev", help="git revision of the candidate (B; default: the working tree)")
    parser.add_argument("--shapes", nargs="+", type=_shape, default=[(1024, 1024), (4096, 1024), (4096, 4096)],
                        help="ROWSxCOLUMNS, multiples of 32")
    parser.add_argument("--elem", default="e4m3", choices=sorted(ELEM_FORMATS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        a = _built(_source_copy(args.base, Path(directory), "a"))
        b = _built(_source_copy(args.candidate_rev, Path(directory), "b"))
        print(f"A: quantize.cpp at {args.base}; B: {args.candidate_rev or 'the working tree'}; "
              f"bf16 inputs, {args.elem}, median of {args.repeats} interleaved calls")
        print(f"  {'case':<26} {'shape':>10} {'threads':>7} {'A ms':>8} {'B ms':>8} {'B/A':>6}  same bits")
        different = 0
        with _reused_outputs():
            for shape in args.shapes:
                shape_text = "x".join(map(str, shape))
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for name, fn in _cases(shape, args.elem):
                        time_a, time_b, same = compare(a, b, fn, args.repeats)
                        different += not same
                        print(f"  {name:<26} {shape_text:>10} {threads:>7} {time_a * 1e3:>8.3f} {time_b * 1e3:>8.3f} "
                              f"{time_b / time_a:>6.2f}  {same}", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
