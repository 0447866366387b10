"""Forward+backward time and peak memory of MX attention against torch SDPA on CPU.

    python benchmarks/attention.py            # seq 512, 1024, 2048, 4096; B=1, H=4, d=64, causal
    python benchmarks/attention.py --quick    # seq 256 only, one timed repeat: a smoke test
    python benchmarks/attention.py --threads 1   # on a shared, busy machine

On a machine busier than its core count, torch's OpenMP threads spin-wait for each other at
every op; MX attention runs many small eager ops per tile and suffers most (10x slower at 2
threads than at 1 under a load of 7 on 2 cores), so use --threads 1 there.

Variants:
    sdpa      F.scaled_dot_product_attention in fp32 (aten's CPU flash kernel)
    mx        mxcompile.attention.mx_attention, MXFP8 (every GEMM MX, key-tiled, fp32 softmax)
    mx_fp32   the same tiled code with attention_mode="off": separates the cost of MX quantization from
              the cost of running the tiles as eager PyTorch ops
    math      softmax(Q·Kᵀ·s + M)·V materialized (the eager form), for the O(T²) memory line

Time: the fastest of --repeats fwd+bwd calls after one warm-up (the least disturbed by other
load on a shared machine; the load average is printed). Peak memory: each (variant, seq) runs
in a fresh subprocess that samples its resident set size every 0.5 ms during one fwd+bwd call
and reports the peak above the resident size before the call (inputs already allocated), so
allocator caches of other variants do not leak into it. Prints one table with ratios to sdpa.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F

from mxcompile.attention import mx_attention
from mxcompile.ops.cpu_kernels import COMPILE_MIN_NUMEL

VARIANTS = ("sdpa", "mx", "mx_fp32", "math")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _math_attention(q, k, v, is_causal):
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        seq = q.shape[-2]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attention_fn(variant: str) -> Callable:
    if variant == "sdpa":
        return lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)
    if variant == "mx":
        return lambda q, k, v, c: mx_attention(q, k, v, is_causal=c)
    if variant == "mx_fp32":
        return lambda q, k, v, c: mx_attention(q, k, v, is_causal=c, attention_mode="off")
    if variant == "math":
        return _math_attention
    raise ValueError(f"variant={variant!r}; accepted: {list(VARIANTS)}")


def make_inputs(batch: int, heads: int, seq: int, width: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, width, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(batch, heads, seq, width, generator=g)
    return q, k, v, do


def fwd_bwd(fn: Callable, q, k, v, do, causal: bool) -> None:
    out = fn(q, k, v, causal)
    torch.autograd.grad(out, (q, k, v), do)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def measure_peak(variant: str, batch: int, heads: int, seq: int, width: int, causal: bool) -> int:
    """Peak resident bytes above the pre-call level during one fwd+bwd (run in a subprocess)."""
    fn = attention_fn(variant)
    q, k, v, do = make_inputs(batch, heads, seq, width)
    small = make_inputs(1, 1, 64, width)
    fwd_bwd(fn, *small, causal)  # first-call costs (lazy init, kernels) outside the measurement
    if variant == "mx":
        # MX attention rounds large CPU operands with a compiled graph (dynamic sizes, so one
        # graph serves every length), compiled by the first operand of COMPILE_MIN_NUMEL
        # elements: compile it here, on one head just that large, so that compile memory stays
        # out of the measurement.
        warm_len = max(64, COMPILE_MIN_NUMEL // width)
        fwd_bwd(fn, *make_inputs(1, 1, warm_len, width), causal)
    baseline = _rss()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fwd_bwd(fn, q, k, v, do, causal)
    done.set()
    sampler.join()
    return max(peak, _rss()) - baseline


def peak_in_subprocess(variant: str, args: argparse.Namespace, seq: int) -> int:
    command = [sys.executable, __file__, "--_peak", variant, "--seqs", str(seq), "--batch", str(args.batch),
               "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if not args.causal:
        command.append("--non-causal")
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(json.loads(result.stdout.strip().splitlines()[-1])["peak_bytes"])


def time_variant(variant: str, args: argparse.Namespace, seq: int) -> float:
    fn = attention_fn(variant)
    q, k, v, do = make_inputs(args.batch, args.heads, seq, args.head_dim)
    fwd_bwd(fn, q, k, v, do, args.causal)  # warm-up
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        fwd_bwd(fn, q, k, v, do, args.causal)
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--non-causal", dest="causal", action="store_false")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (1 avoids OpenMP spin-waits on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="seq 256, one repeat")
    parser.add_argument("--_peak", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._peak:
        peak = measure_peak(args._peak, args.batch, args.heads, seqs[0], args.head_dim, args.causal)
        print(json.dumps({"peak_bytes": peak}))
        return
    if args.quick:
        seqs, args.repeats = [256], 1
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        attention_fn(variant)  # validates the name
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={args.batch} "
          f"H={args.heads} d={args.head_dim} {'causal' if args.causal else 'non-causal'} fp32, fwd+bwd; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = f"{'seq':>6} {'variant':>8} {'time ms':>10} {'x sdpa':>7} {'peak MiB':>9} {'x sdpa':>7}"
    print(header)
    rows = []
    for seq in seqs:
        base_time = base_peak = None
        for variant in variants:
            seconds = time_variant(variant, args, seq)
            peak = peak_in_subprocess(variant, args, seq)
            if variant == "sdpa":
                base_time, base_peak = seconds, peak
            time_ratio = f"{seconds / base_time:7.2f}" if base_time else f"{'-':>7}"
            peak_ratio = f"{peak / base_peak:7.2f}" if base_peak else f"{'-':>7}"
            print(f"{seq:>6} {variant:>8} {seconds * 1e3:>10.1f} {time_ratio} {peak / 2**20:>9.1f} {peak_ratio}",
                  flush=True)
            rows.append({"seq": seq, "variant": variant, "seconds": seconds, "peak_bytes": peak})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
