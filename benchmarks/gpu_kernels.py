"""Benchmark (and check) the MX Triton kernels.

On a GPU:
    python benchmarks/gpu_kernels.py            # quantize GB/s vs a copy; MX GEMM TFLOP/s (each
                                                # main loop) vs torch.mm bf16 and torch._scaled_mm
                                                # rowwise FP8; mx_attention vs SDPA (bf16),
                                                # forward and forward+backward
    python benchmarks/gpu_kernels.py --check    # correctness against mxcompile.numerics first
    python benchmarks/gpu_kernels.py --sizes 4096 8192
    python benchmarks/gpu_kernels.py --json OUT.json   # also write every figure as JSON
On the CPU, under the Triton interpreter, at tiny shapes (a smoke test of this script):
    python benchmarks/gpu_kernels.py --tiny
No GPU needed: compile every kernel and autotune config for sm90 and sm100 with a real launch's
argument specialisation and report whether its main loop is software-pipelined (async copies or
TMA into two or more shared-memory buffers), and its registers and spilled bytes per thread:
    python benchmarks/gpu_kernels.py --pipelining [90 100]

Quantize traffic counts what a kernel must move: the input read once plus each written copy
(FP8 data and uint8 scales). The copy baseline is `dst.copy_(src)` of the bf16 input (read +
write). GEMM FLOPs are 2*M*N*K; attention FLOPs 4*B*H*S*S*D (halved when causal), forward +
backward 3.5 times that (the FlashAttention-2 convention: the backward's 5 GEMMs; the MX backward
also recomputes S and dP in its dQ kernel, which is not counted). Attention is timed through
`mxcompile.attention.mx_attention`, its quantizations included, as a training step runs it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The MX GEMM variants timed: column label -> (mx_mm_triton path, TMA).
GEMM_COLUMNS = {
    "dot_scaled": ("dot_scaled", False),
    "dot_scaled TMA": ("dot_scaled", True),
    "expand_bf16": ("expand_bf16", False),
    "fp8_per_block": ("fp8_per_block", False),
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--check", action="store_true", help="check results against the numerics core")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192],
                   help="attention sequence lengths (GPU)")
    p.add_argument("--gemm-paths", nargs="+", default=list(GEMM_COLUMNS), choices=list(GEMM_COLUMNS),
                   help="MX GEMM variants to time (each is autotuned per size)")
    p.add_argument("--skip", nargs="*", default=[], choices=["quantize", "gemm", "attention"])
    p.add_argument("--json", type=Path, help="write the results here as JSON (rewritten after each part)")
    p.add_argument("--pipelining", type=int, nargs="*", metavar="SM",
                   help="no GPU: main-loop pipelining, registers and spills per kernel and config "
                        "(default: 90 100)")
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.tiny:
    # Must precede the first import of triton (triton.language's own @jit helpers read it).
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    # The interpreter evaluates masked lanes too (numpy warns on exp overflow, 0/0 there).
    warnings.filterwarnings("ignore", category=RuntimeWarning)

import torch  # noqa: E402

from mxcompile.numerics import E4M3, ScaleMode, quantize_along  # noqa: E402
from mxcompile.triton_templates import (  # noqa: E402
    mx_attention_backward_triton,
    mx_attention_triton,
    mx_mm_triton,
    quantize_mx_triton,
    quantize_mx_triton_rowcol,
    triton_available,
)
from mxcompile.triton_templates.attention import mx_attention_reference  # noqa: E402
from mxcompile.triton_templates.attention_backward import (  # noqa: E402
    mx_attention_backward_reference,
    quantize_backward_operands,
)
from mxcompile.triton_templates.mx_gemm import mx_mm_reference  # noqa: E402


def _rate(x: float, width: int) -> str:
    """A throughput, 4 significant digits (tiny CPU runs give tiny numbers)."""
    return f"{x:>{width}.4g}"


def bench(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up (loads and compiles the kernel)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _q(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_along(x, axis, E4M3, ScaleMode.RCEIL, 32)


def check(device: torch.device) -> bool:
    """Correctness of every kernel against the numerics core at small, ragged shapes."""
    ok = True

    def report(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= passed
        print(f"  [{'ok' if passed else 'FAIL'}] {name} {detail}")

    g = torch.Generator().manual_seed(0)
    base = torch.randn(96, 160, generator=g) * torch.logspace(-4, 4, 160)[None, :]
    base = base * torch.logspace(-3, 3, 96)[:, None]
    base[0, :7] = torch.tensor(
        [0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 480.0, -448.0]
    )
    x = base.to(device=device, dtype=torch.bfloat16)
    casts = ["software", "hardware"] if device.type == "cuda" else ["software"]
    for cast in casts:
        for scale_mode in ("rceil", "floor", "ceil", "even"):
            ref = [quantize_along(x.cpu(), a, E4M3, ScaleMode(scale_mode), 32) for a in (1, 0)]
            rd, rs, cd, cs = quantize_mx_triton_rowcol(x, scale_mode=scale_mode, cast=cast)
            got = [(rd, rs), (cd, cs)]
            exact = all(
                torch.equal(d.cpu().view(torch.uint8), rd_.view(torch.uint8))
                and torch.equal(s.cpu(), rs_)
                for (d, s), (rd_, rs_) in zip(got, ref, strict=True)
            )
            report(f"quantize rowcol {scale_mode:5s} cast={cast}", exact, "bit-exact" if exact else "")
    m, n, k = 80, 96, 160
    a, sa = _q(torch.randn(m, k, generator=g), 1)
    b, sb = _q(torch.randn(k, n, generator=g), 0)
    bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    ref = mx_mm_reference(
        a, sa, b, sb, 32, torch.float32, ("bias", "gelu_tanh", "residual"), bias=bias, residual=res
    )
    dev = [t.to(device) for t in (a, sa, b, sb, bias, res)]
    # The TMA variant (operand tiles through tensor descriptors) where the GPU has TMA (sm90+)
    # and under the interpreter, with B both row-major and as a transposed row-major (N, K)
    # tensor (a linear layer's weight).
    has_tma = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)
    b_nk = dev[2].t().contiguous().t()
    variants = [("dot_scaled", False, dev[2]), ("expand_bf16", False, dev[2]), ("fp8_per_block", False, dev[2])]
    variants += [("dot_scaled", True, dev[2]), ("dot_scaled", True, b_nk)] if has_tma else []
    for path, tma, b_dev in variants:
        c = mx_mm_triton(
            dev[0], dev[1], b_dev, dev[3], 32, torch.float32, ("bias", "gelu_tanh", "residual"),
            bias=dev[4], residual=dev[5], path=path, tma=tma,
        )  # fmt: skip
        err = (c.cpu() - ref).abs().max().item()
        label = f"{path}{', TMA, B ' + ('(N, K)' if b_dev.stride(0) == 1 else '(K, N)') if tma else ''}"
        report(
            f"mx_mm {label:28s} fp32 out + epilogue",
            err <= 1e-4 * ref.abs().max().item(),
            f"max|err|={err:.3g}",
        )
    qh, kh, vh = (torch.randn(2, 64, 64, generator=g) for _ in range(3))
    q, qs = _q(qh, 2)
    kq, ks = _q(kh, 2)
    v, vs = _q(vh, 1)
    ref = mx_attention_reference(q, qs, kq, ks, v, vs, causal=True, block_n=32)
    out = mx_attention_triton(
        *(t.to(device) for t in (q, qs, kq, ks, v, vs)), causal=True, out_dtype=torch.float32,
        tiles={"BLOCK_M": 32, "BLOCK_N": 32},
    )  # fmt: skip
    err = (out.cpu() - ref).abs().max().item()
    report("mx_attention causal (tile-faithful reference)", err <= 1e-4, f"max|err|={err:.3g}")
    do, lse = torch.randn(2, 64, 64, generator=g), torch.logsumexp(qh @ kh.mT / 8, dim=-1)
    refs = mx_attention_backward_reference(qh, kh, vh, ref, do, lse, causal=True)
    qkvd = [t.to(device) for t in (qh, kh, vh, do)]
    operands = quantize_backward_operands(*qkvd, lambda x, axis, elem: _q(x, axis % x.ndim), attention_mode="both",
                                          forward_elem="e4m3", grad_elem="e4m3")  # fmt: skip
    grads = mx_attention_backward_triton(
        operands, ref.to(device), qkvd[3], lse.to(device), causal=True, tiles={"BLOCK_M": 32, "BLOCK_N": 32},
    )  # fmt: skip
    err = max(
        ((got.cpu() - r).abs().max() / r.abs().max()).item()
        for got, r in zip(grads, refs, strict=True)
    )
    report("mx_attention backward causal (reference)", err <= 1e-4, f"max rel err={err:.3g}")
    return ok


def bench_quantize(device: torch.device, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """GB/s of the quantize kernel and of `copy_`, per size; printed and returned."""
    rows = []
    print("\nquantize (bf16 in, e4m3 + E8M0 out, rceil, block 32)")
    print(f"{'M=N':>7} {'copy GB/s':>10} {'row GB/s':>9} {'col GB/s':>9} {'row+col GB/s':>13}")
    for s in sizes:
        x = torch.randn(s, s, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        n = s * s
        one_copy = n + n // 32  # FP8 data + scale bytes
        t_copy = bench(lambda: dst.copy_(x), device, reps)
        t_row = bench(lambda: quantize_mx_triton(x, -1), device, reps)
        t_col = bench(lambda: quantize_mx_triton(x, 0), device, reps)
        t_both = bench(lambda: quantize_mx_triton_rowcol(x), device, reps)
        gbs = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
        rows.append({"size": s, "copy_gbs": gbs(4 * n, t_copy), "rowwise_gbs": gbs(2 * n + one_copy, t_row),
                     "colwise_gbs": gbs(2 * n + one_copy, t_col), "both_gbs": gbs(2 * n + 2 * one_copy, t_both),
                     "both_over_copy": (2 * n + 2 * one_copy) / t_both / (4 * n / t_copy)})  # fmt: skip
        print(
            f"{s:>7} {_rate(gbs(4 * n, t_copy), 10)} {_rate(gbs(2 * n + one_copy, t_row), 9)} "
            f"{_rate(gbs(2 * n + one_copy, t_col), 9)} "
            f"{_rate(gbs(2 * n + 2 * one_copy, t_both), 13)}"
        )
    return rows


def bench_gemm(device: torch.device, sizes: list[int], reps: int, columns: list[str]) -> list[dict[str, Any]]:
    """TFLOP/s of the MX GEMM variants `columns` (GEMM_COLUMNS), of torch.mm in bf16 and of
    torch._scaled_mm FP8 row-wise, per size; printed and returned (a variant that fails to run
    gives its exception's name)."""
    rows = []
    print("\nGEMM TFLOP/s (bf16 out)")
    cols = [f"mx {c}" for c in columns] + ["mm bf16", "_scaled_mm fp8 rowwise"]
    print(f"{'M=N=K':>7} " + " ".join(f"{c:>22}" for c in cols))
    for s in sizes:
        m = n = k = s
        xa = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        xb = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        a, sa = quantize_mx_triton(xa, -1)
        b, sb = quantize_mx_triton(xb, 0)
        flops = 2 * m * n * k
        figures: dict[str, float | str] = {}
        for column in columns:
            path, tma = GEMM_COLUMNS[column]
            try:
                t = bench(
                    lambda: mx_mm_triton(a, sa, b, sb, 32, torch.bfloat16, path=path, tma=tma),
                    device, reps,
                )  # fmt: skip
                figures[f"mx {column}"] = flops / t / 1e9
            except Exception as exc:  # a path the GPU cannot compile
                figures[f"mx {column}"] = f"failed: {type(exc).__name__}"
        figures["mm bf16"] = flops / bench(lambda: xa @ xb, device, reps) / 1e9
        if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
            try:
                a8 = xa.to(torch.float8_e4m3fn)
                b8 = xb.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major B
                scale_a = torch.ones(m, 1, device=device)
                scale_b = torch.ones(1, n, device=device)
                t = bench(
                    lambda: torch._scaled_mm(a8, b8, scale_a, scale_b, out_dtype=torch.bfloat16),
                    device, reps,
                )  # fmt: skip
                figures["_scaled_mm fp8 rowwise"] = flops / t / 1e9
            except Exception as exc:
                figures["_scaled_mm fp8 rowwise"] = f"failed: {type(exc).__name__}"
        else:
            figures["_scaled_mm fp8 rowwise"] = "n/a"
        cells = [_rate(v, 22) if isinstance(v, float) else f"{v:>22}" for v in (figures[c] for c in cols)]
        print(f"{s:>7} " + " ".join(cells))
        rows.append({"size": s, "tflops": figures})
    return rows


def bench_attention(
    device: torch.device, seqs: list[int], reps: int, heads: int, dim: int
) -> list[dict[str, Any]]:
    """Forward (no grad) and forward+backward of `mxcompile.attention.mx_attention` (bf16 in and
    out, its quantizations included, as a training step pays them) against SDPA in bf16, per
    length and causality: milliseconds and TFLOP/s, printed and returned."""
    from mxcompile.attention import mx_attention

    rows = []
    print(f"\nattention TFLOP/s (B=1, H={heads}, D={dim}, bf16 in and out; MX: mx_attention)")
    print(f"{'S':>7} {'causal':>7} {'fwd mx':>9} {'fwd SDPA':>9} {'fwd+bwd mx':>11} {'fwd+bwd SDPA':>13}")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for s in seqs:
        for causal in (False, True):
            xs = [torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16) for _ in range(3)]
            do = torch.randn_like(xs[0])
            leaves = [x.clone().requires_grad_() for x in xs]
            flops = 4 * heads * s * s * dim / (2 if causal else 1)

            def forward(attention: Callable[..., torch.Tensor]) -> Callable[[], object]:
                def run() -> None:
                    with torch.no_grad():
                        attention(*xs, is_causal=causal)

                return run

            def forward_backward(attention: Callable[..., torch.Tensor]) -> Callable[[], object]:
                def run() -> None:
                    attention(*leaves, is_causal=causal).backward(do)

                return run

            times = {
                "forward_mx_ms": bench(forward(mx_attention), device, reps),
                "forward_sdpa_ms": bench(forward(sdpa), device, reps),
                "forward_backward_mx_ms": bench(forward_backward(mx_attention), device, reps),
                "forward_backward_sdpa_ms": bench(forward_backward(sdpa), device, reps),
            }
            rows.append({"seq": s, "causal": causal, **times,
                         "forward_mx_over_sdpa": times["forward_mx_ms"] / times["forward_sdpa_ms"],
                         "forward_backward_mx_over_sdpa":
                             times["forward_backward_mx_ms"] / times["forward_backward_sdpa_ms"]})  # fmt: skip
            rates = [flops * (1 if "forward_b" not in k else 3.5) / t / 1e9 for k, t in times.items()]
            print(f"{s:>7} {str(causal):>7} " + " ".join(_rate(r, w) for r, w in zip(rates, (9, 9, 11, 13))))
    return rows


def pipelining_rows(capability: int) -> Iterator[tuple[str, str, object]]:
    """(kernel, config, PipelineReport), one by one, of every kernel with a main loop and every autotune
    config, compiled for `capability` at a large shape with a real launch's specialisation: the
    MX GEMM's main loops (4096^2) and the causal MX attention kernels (16 heads x 4096 tokens,
    head_dim 128, the launches of the static report: `kernel_static.launchers`)."""
    from mxcompile.triton_templates.aot import compile_launch, pipeline_report
    from mxcompile.triton_templates.configs import (
        attention_autotune_configs,
        attention_backward_autotune_configs,
        mx_mm_autotune_configs,
    )
    from mxcompile.triton_templates.kernel_static import launchers
    from mxcompile.triton_templates.mx_gemm import MXMMKey, mx_mm_launch

    size = 4096
    a = torch.empty(size, size, dtype=torch.float8_e4m3fn, device="meta")
    sa = torch.empty(size, size // 32, dtype=torch.uint8, device="meta")
    sb = torch.empty(size // 32, size, dtype=torch.uint8, device="meta")
    gemm = functools.partial(mx_mm_launch, a, sa, a, sb, block_size=32, out_dtype=torch.bfloat16,
                             key=MXMMKey(), interpret=False)  # fmt: skip
    # (label, config, launch taking (tiles, wrap))
    launches: list[tuple[str, object, Callable[..., object]]] = []
    # (label, main loop, use_tma): TMA on sm100+; the per-block loops on sm90.
    paths = [("dot_scaled", "dot_scaled", False)]
    if capability >= 100:
        paths += [("dot_scaled, TMA", "dot_scaled", True)]
    else:
        paths += [("expand_bf16", "expand_bf16", False), ("fp8_per_block", "fp8_per_block", False)]
    def gemm_launch(main_loop: str, tma: bool) -> Callable[..., object]:
        return lambda tiles, wrap: gemm(tiles=tiles, wrap=wrap, path=main_loop, use_tma=tma)

    for path, main_loop, tma in paths:
        launch = gemm_launch(main_loop, tma)
        launches += [(f"mx_mm_kernel ({path})", c, launch) for c in mx_mm_autotune_configs(tma, main_loop)]
    attention = launchers(128, True)
    launches += [("mx_attention_fwd_kernel", c, attention["mx_attention_fwd"][1])
                 for c in attention_autotune_configs()]  # fmt: skip
    for name in ("dkdv", "dq"):
        launch = attention[f"mx_attention_{name}"][1]
        launches += [(f"mx_attention_bwd_{name}_kernel", c, launch) for c in attention_backward_autotune_configs(name)]
    for label, config, launch in launches:
        kernel_name = label.split(" ")[0]
        (kernel,) = compile_launch(
            lambda wrap, c=config, f=launch: f(c.kwargs, wrap), capability,
            num_warps=config.num_warps, num_stages=config.num_stages, only=kernel_name,
        )  # fmt: skip
        tiles = " ".join(f"{k.removeprefix('BLOCK_')}={v}" for k, v in config.kwargs.items())
        config_label = f"{tiles} w={config.num_warps} s={config.num_stages}"
        yield label, config_label, pipeline_report(kernel)


def report_pipelining(capabilities: list[int]) -> int:
    print("main-loop pipelining, compiled without a GPU with a real launch's specialisation")
    header = (f"{'sm':>4} {'kernel':34s} {'config (tiles, warps, stages)':40s} {'smem KiB':>8} "
              f"{'cp.async':>8} {'TMA':>4} {'buffers':>7} {'pipelined':>9} {'regs':>5} {'spill B':>7}")
    print(header)
    for capability in capabilities:
        for label, config, r in pipelining_rows(capability):
            print(f"{capability:>4} {label:34s} {config:40s} {r.shared_bytes / 1024:8.1f} "
                  f"{r.async_copies:8d} {r.tma_copies:4d} {r.buffers:7d} {'yes' if r.pipelined else 'NO':>9} "
                  f"{r.registers:5d} {r.stack_bytes:7d}", flush=True)
    return 0


def _write(path: Path | None, results: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def main(args: argparse.Namespace) -> int:
    if args.pipelining is not None:
        return report_pipelining(args.pipelining or [90, 100])
    if args.tiny:
        device = torch.device("cpu")
        sizes, seqs, reps, heads, dim = [64], [64], 2, 2, 32
    else:
        device = torch.device("cuda")
        sizes, seqs, reps, heads, dim = args.sizes, args.seqs, 1, 16, 128
    ok, reason = triton_available(device)
    print(f"device: {device} ({reason})")
    if not ok:
        print("cannot run: " + reason, file=sys.stderr)
        return 2
    results: dict[str, Any] = {"command": ["python", "benchmarks/gpu_kernels.py", *sys.argv[1:]],
                               "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        print(f"GPU: {results['gpu']}, torch {torch.__version__}")
    if args.check or args.tiny:
        print("\ncorrectness checks")
        results["checks_passed"] = check(device)
        _write(args.json, results)
        if not results["checks_passed"]:
            print("correctness check FAILED", file=sys.stderr)
            return 1
    if "quantize" not in args.skip:
        results["quantize"] = bench_quantize(device, sizes, reps)
        _write(args.json, results)
    if "gemm" not in args.skip:
        results["gemm"] = bench_gemm(device, sizes, reps, args.gemm_paths)
        _write(args.json, results)
    if "attention" not in args.skip:
        rows = bench_attention(device, seqs, reps, heads, dim)
        results["attention"] = {"batch": 1, "heads": heads, "head_dim": dim, "rows": rows}
        _write(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
