"""Benchmark: MX quantization of bf16 tensors on CPU against memory-copy baselines.

For each size it times (median of several runs, after warm-up):
  * the `mxcompile::quantize` op as compiled graphs run it on CPU (its CPU kernel: the native
    kernels of `mxcompile.ops.native`) along the last axis, along the first axis, and along
    both (two calls, two reads of the input); `mxcompile::fake_quantize` (bf16 out) and
    `mxcompile::dequantize` along the last axis;
  * beside each, the kernel the ops ran before the native ones and still run where those cannot
    be built: the Inductor form compiled once with dynamic sizes (`ops.cpu_kernels`), called
    directly ("compiled graph");
  * x.clone() and copy_ into a preallocated buffer (the memory-traffic baselines);
  * torchao's `to_mx` in eager mode and compiled (in torchao 0.18 on CPU only the rceil mode
    compiles; floor is tried too and its failure printed as 'fails: <reason>').

Effective GB/s counts the bytes read once plus the bytes written (data and scales). The ratio
is to x.clone(). Fresh allocations of 32 MiB and more are mmap'ed by glibc and pay a page fault
per 4 KiB page on first touch (about 0.23 ms per MiB on the 2-core VM): clone pays it on every
call at both sizes; the quantizer's fp8 output (16 MiB at 4096^2) is recycled from the heap,
and its outputs of 32 MiB or more (8192^2; the bf16 outputs of fake quantize and dequantize at
4096^2) are advised onto transparent huge pages (`ops.native.huge_pages`), which fault per 2 MiB
(`benchmarks/huge_pages.py` compares). `copy_` into a preallocated buffer shows the pure memory
traffic. Each case runs at least 2 s (`--warmup-seconds`) before it is timed: on the 2-core VM
(whose kernel hands free memory back to the host in 8 MiB blocks: `page_reporting_order=11` on
its command line) a process's first large allocations, and some later ones, fault in memory the
host must supply again (an 8192^2 quantize's first 4-6 calls took 250-330 ms each, nearly all
system time by getrusage, and 15-20 ms after; a dequantize's output 500 ms, then 15-20 ms).
Such outliers still occur in timed calls now and then: the median keeps them out of the figure.

    python benchmarks/quantize.py            # 4096^2 and 8192^2
    python benchmarks/quantize.py --quick    # small sizes, for a smoke test

Targets on the 2-core CPU (issue 15): last axis <= 0.5x clone, both axes <= 1.0x clone.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mxcompile.numerics import ELEM_FORMATS, ScaleMode, scale_mode_named
from mxcompile.ops.cpu_kernels import BlockLayout, compiled_dequantize, compiled_quantize, compiled_rounding
from mxcompile.ops.quantize import DEQUANTIZE, FAKE_QUANTIZE, QUANTIZE

TARGETS = {"quantize last axis": 0.5, "quantize first axis": 0.6, "quantize both axes": 1.0}
# Issue 15: the last-axis quantizer should move bytes at least at this share of copy_'s rate.
MIN_COPY_BANDWIDTH_SHARE = {"quantize last axis": 0.5}


@dataclass
class Row:
    name: str
    seconds: float | None  # None: the case failed
    bytes_moved: int
    note: str = ""


def _time(fn: Callable[[], object], repeats: int, warmup: int = 2, warmup_seconds: float = 0.0) -> float:
    """Median wall time of `repeats` calls after `warmup` calls and at least `warmup_seconds`."""
    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < warmup_seconds:
        fn()
        calls += 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:160]


def bench_size(n: int, elem: str, scale_mode: str, block_size: int, repeats: int,
               warmup_seconds: float = 0.0) -> list[Row]:
    fmt = ELEM_FORMATS[elem]
    x = torch.randn(n, n, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    numel = x.numel()

    def timed(fn: Callable[[], object]) -> float:
        return _time(fn, repeats, warmup_seconds=warmup_seconds)

    in_bytes = numel * x.element_size()
    q_bytes = numel + numel // block_size  # fp8 data + one uint8 scale per block

    def last(t: torch.Tensor):
        return QUANTIZE(t, 1, elem, scale_mode, block_size)

    def first(t: torch.Tensor):
        return QUANTIZE(t, 0, elem, scale_mode, block_size)

    def both(t: torch.Tensor):
        return last(t), first(t)

    mode = scale_mode_named(scale_mode)
    graph_last = compiled_quantize(fmt, mode, block_size, BlockLayout.ROWS)
    graph_first = compiled_quantize(fmt, mode, block_size, BlockLayout.COLUMNS)
    graph_fake = compiled_rounding(fmt, mode, block_size, BlockLayout.ROWS, torch.bfloat16)
    graph_dequantize = compiled_dequantize(block_size, BlockLayout.ROWS, torch.bfloat16)
    data, scales = last(x)

    rows: list[Row] = []
    for name, fn, moved in (
        ("quantize last axis", last, in_bytes + q_bytes),
        ("  compiled graph", graph_last, in_bytes + q_bytes),
        ("quantize first axis", first, in_bytes + q_bytes),
        ("  compiled graph", lambda t: graph_first(t.view(1, n, n)), in_bytes + q_bytes),
        ("quantize both axes", both, in_bytes + 2 * q_bytes),
        ("fake quantize last axis", lambda t: FAKE_QUANTIZE(t, 1, elem, scale_mode, block_size, t.dtype),
         2 * in_bytes),
        ("  compiled graph", graph_fake, 2 * in_bytes),
        ("dequantize last axis", lambda t: DEQUANTIZE(data, scales, 1, block_size, t.dtype), in_bytes + q_bytes),
        ("  compiled graph", lambda t: graph_dequantize(data, scales), in_bytes + q_bytes),
    ):
        if fn(x) is None:  # a compiled graph declines operands under its compile threshold
            rows.append(Row(name, None, 0, "no graph at this size (cpu_kernels.COMPILE_MIN_NUMEL)"))
            continue
        rows.append(Row(name, timed(lambda: fn(x)), moved))  # the first call compiles or loads

    rows.append(Row("x.clone()", timed(lambda: x.clone()), 2 * in_bytes))
    buffer = torch.empty_like(x)
    rows.append(Row("copy_ into preallocated", timed(lambda: buffer.copy_(x)), 2 * in_bytes))

    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # torchao missing or broken: report, don't fail the benchmark
        rows.append(Row("torchao to_mx eager", None, 0, f"unavailable: {_first_line(exc)}"))
        rows.append(Row("torchao to_mx compiled", None, 0, f"unavailable: {_first_line(exc)}"))
        return rows

    def ao_fn(ao_mode: str) -> Callable[[torch.Tensor], object]:
        calc = ScaleCalculationMode(ao_mode)
        return lambda t: to_mx(t, fmt.dtype, block_size, calc)

    rows.append(Row("torchao to_mx eager", timed(lambda: ao_fn(scale_mode)(x)), in_bytes + q_bytes))
    # Compiled: in torchao 0.18 on CPU only rceil compiles; floor / ceil / even view uint8 as
    # float8_e8m0fnu inside the graph, which Inductor's C++ backend cannot generate.
    for ao_mode in dict.fromkeys([scale_mode, "floor"]):
        name = f"torchao to_mx compiled ({ao_mode})"
        compiled = torch.compile(ao_fn(ao_mode), dynamic=False)
        quiet = logging.getLogger("torch._inductor")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL + 1)  # the failure logs the whole IR node at CRITICAL
        try:
            rows.append(Row(name, timed(lambda: compiled(x)), in_bytes + q_bytes))
        except Exception as exc:
            rows.append(Row(name, None, 0, f"fails: {_first_line(exc)}"))
        finally:
            quiet.setLevel(level)
    return rows


def format_table(n: int, rows: list[Row]) -> str:
    clone = next(r.seconds for r in rows if r.name == "x.clone()")
    copy = next(r for r in rows if r.name == "copy_ into preallocated")
    copy_gbps = copy.bytes_moved / copy.seconds / 1e9
    lines = [
        f"bf16 {n}x{n}",
        f"  {'case':<31} {'time ms':>9} {'GB/s':>8} {'x clone':>8}  note",
    ]
    for r in rows:
        if r.seconds is None:
            lines.append(f"  {r.name:<31} {'-':>9} {'-':>8} {'-':>8}  {r.note}")
            continue
        ratio = r.seconds / clone if clone else float("nan")
        note = r.note
        if r.name in TARGETS:
            target = TARGETS[r.name]
            note = f"target <= {target:.1f}x: {'met' if ratio <= target else 'MISSED'}"
        gbps = r.bytes_moved / r.seconds / 1e9
        if r.name in MIN_COPY_BANDWIDTH_SHARE:
            share, wanted = gbps / copy_gbps, MIN_COPY_BANDWIDTH_SHARE[r.name]
            note += f" | {share:.0%} of copy_'s GB/s (target >= {wanted:.0%}: {'met' if share >= wanted else 'MISSED'})"
        lines.append(f"  {r.name:<31} {r.seconds * 1e3:>9.2f} {gbps:>8.1f} {ratio:>8.2f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke test)")
    parser.add_argument("--sizes", type=int, nargs="+", help="square sizes (default 4096 8192)")
    parser.add_argument("--repeats", type=int, help="timed runs per case (median reported)")
    parser.add_argument("--elem", default="e4m3", choices=sorted(ELEM_FORMATS))
    parser.add_argument("--scale-mode", default="rceil", choices=[m.value for m in ScaleMode])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--warmup-seconds", type=float, help="each case runs at least this long before it is "
                        "timed (default 2, --quick 0): see the module docstring")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    sizes = args.sizes or ([256] if args.quick else [4096, 8192])
    repeats = args.repeats or (3 if args.quick else 11)
    warmup_seconds = args.warmup_seconds if args.warmup_seconds is not None else (0.0 if args.quick else 2.0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, elem={args.elem}, "
        f"scale_mode={args.scale_mode}, block_size={args.block_size}, median of {repeats}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for n in sizes:
        rows = bench_size(n, args.elem, args.scale_mode, args.block_size, repeats, warmup_seconds)
        print(format_table(n, rows), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f} (timings are noisy when it exceeds the core count)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
