"""Compile time of the mxfp8 backend against Inductor's, cold and warm, in one run.

    python benchmarks/compile_time.py                  # demo GPT (small) and a small HF Llama
    python benchmarks/compile_time.py --models gpt --repeats 3

Each measurement is one fresh Python process that builds the model, compiles it and runs three
training steps (bf16 autocast, AdamW): compile time is the first step's time less the faster of
the other two.
"cold" starts from an empty Inductor/AOTAutograd cache directory (TORCHINDUCTOR_CACHE_DIR);
"warm" is a second process on the same directory. Per model and repeat the order is
inductor cold, inductor warm, mxfp8 cold, mxfp8 warm; the medians over --repeats are printed.
Targets (issue 15): mxfp8 cold <= 2x Inductor's cold, warm <= 1.2x Inductor's warm.

Where mxfp8's time goes comes from torch's own compile-time counters
(`torch._dynamo.utils.compilation_time_metrics`, filled by `dynamo_timed`, which the backend
also wraps around its own stages):
  dynamo        the frame compile less the backend call (bytecode analysis, graph capture)
  AOTAutograd   the rest: tracing the joint graph, partitioning, runtime wrappers, cache lookup
                and loading cached graphs (a residual: where the stage timers add up to more
                than the compile time, it is negative, and the table says so)
  passes        mxcompile's pass pipeline (`mxcompile.passes`)
  partition     mxcompile's partition stage (min-cut, with the memory plan when one is set)
  decompose     `lowering.decompose_mx_ops`: the MX ops decomposed for Inductor
  Inductor      `compile_fx_inner` (its FX graph cache lookup included)
and the cache counters: FX graph cache and AOTAutograd cache hits / misses / bypasses, with the
count of C++ files Inductor compiled (cpp_files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from mxcompile.backend import PARTITION_TIMER, PASSES_TIMER
from mxcompile.lowering import DECOMPOSE_TIMER

RESULT_MARKER = "COMPILE_TIME_RESULT "
CHILD_TIMEOUT_S = 1800
BACKENDS = ("inductor", "mxfp8")
MODELS = ("gpt", "llama")
# Llama small enough to compile in a minute on 2 cores, large enough to have the usual graph.
LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
LLAMA_BATCH, LLAMA_SEQ = 2, 128
GPT_SIZE = "small"
# Keys of compilation_time_metrics (torch's, and those the mxfp8 backend adds).
FRAME_KEY = "_compile.compile_inner"
BACKEND_KEY = "OutputGraph.call_user_compiler"
INDUCTOR_KEY = "compile_fx_inner"
CPP_COMPILE_KEY = "compile_file"  # one per C++ file Inductor compiles
MX_KEYS = {"passes": PASSES_TIMER, "partition": PARTITION_TIMER, "decompose": DECOMPOSE_TIMER}
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
                  ("aot_autograd", "autograd_cache_miss"), ("aot_autograd", "autograd_cache_bypass"))


def _build(model_name: str):
    """(model, loss function of the model) for one of MODELS, seeded."""
    import torch

    if model_name == "gpt":
        from mxcompile.examples import gpt_factory, lm_loss

        model, (idx,) = gpt_factory(GPT_SIZE)
        return model, lambda compiled: lm_loss(compiled(idx), idx)
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    ids = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ), generator=torch.Generator().manual_seed(0))
    return model, lambda compiled: compiled(input_ids=ids, labels=ids).loss


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: compile `spec["model"]` with `spec["backend"]`, run two steps."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    import mxcompile  # noqa: F401  (registers the mxfp8 backend)

    model, loss_of = _build(spec["model"])
    compiled = torch.compile(model, backend=spec["backend"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_of(compiled)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    first = step()
    steady = min(step(), step())  # the faster of two: one slow step would read as negative compile time
    return {"first_step_s": first, "step_s": steady,
            "metrics": {k: sum(v) for k, v in compilation_time_metrics.items()},
            "cpp_files": len(compilation_time_metrics.get(CPP_COMPILE_KEY, [])),
            "counters": {f"{group}.{name}": counters[group][name] for group, name in CACHE_COUNTERS}}


def run_child(model: str, backend: str, cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    spec = json.dumps({"model": model, "backend": backend})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{model}/{backend} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    result["compile_s"] = result["first_step_s"] - result["step_s"]
    return result


def breakdown(result: dict[str, Any]) -> dict[str, float]:
    """Seconds per stage (see the module docstring) from one child's metrics."""
    metrics = result["metrics"]
    mx = {name: metrics.get(key, 0.0) for name, key in MX_KEYS.items()}
    dynamo = metrics.get(FRAME_KEY, 0.0) - metrics.get(BACKEND_KEY, 0.0)
    inductor = metrics.get(INDUCTOR_KEY, 0.0)  # the decomposition runs before it, not inside
    rest = result["compile_s"] - dynamo - inductor - sum(mx.values())
    return {"dynamo": dynamo, "AOTAutograd": rest, **mx, "Inductor": inductor}


def _median_row(results: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"compile_s": statistics.median(r["compile_s"] for r in results)}
    stages = [breakdown(r) for r in results]
    row["stages"] = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    row["counters"] = {**results[len(results) // 2]["counters"], "cpp_files": results[len(results) // 2]["cpp_files"]}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--repeats", type=int, default=1, help="cold+warm pairs per backend (median printed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT_MARKER + json.dumps(child(json.loads(args.child))))
        return
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or args.repeats < 1:
        parser.error(f"--models takes {list(MODELS)} (got {unknown}); --repeats >= 1 (got {args.repeats})")
    print(f"{args.repeats} repeat(s) per backend and model, each cold and warm in fresh processes; medians shown")
    for model in models:
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for backend in BACKENDS:
                with tempfile.TemporaryDirectory(prefix="compile-time-") as cache_dir:
                    for phase in ("cold", "warm"):
                        runs.setdefault((backend, phase), []).append(run_child(model, backend, cache_dir))
        rows = {key: _median_row(results) for key, results in runs.items()}
        print(f"\n{model}: compile time (first step less a steady step), seconds")
        print(f"{'phase':6} {'inductor':>9} {'mxfp8':>9} {'ratio':>7}")
        for phase in ("cold", "warm"):
            ind, mx = rows[("inductor", phase)]["compile_s"], rows[("mxfp8", phase)]["compile_s"]
            print(f"{phase:6} {ind:9.1f} {mx:9.1f} {mx / ind:6.2f}x")
        for phase in ("cold", "warm"):
            negative = [backend for backend in BACKENDS if rows[(backend, phase)]["stages"]["AOTAutograd"] < 0]
            if negative:
                print(f"  ({phase}, {', '.join(negative)}: the stage timers add up to more than the compile time, "
                      "so the AOTAutograd residual is negative; its figure is not a time)")
            print(f"  {phase} breakdown (s): " + "  ".join(
                f"{backend}[" + ", ".join(f"{k} {v:.1f}" for k, v in rows[(backend, phase)]["stages"].items()
                                          if backend == "mxfp8" or k not in MX_KEYS) + "]"
                for backend in BACKENDS))
            print(f"  {phase} cache counters: " + "  ".join(
                f"{backend}[" + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in rows[(backend, phase)]["counters"].items() if v)
                + "]" for backend in BACKENDS))


if __name__ == "__main__":
    main()
