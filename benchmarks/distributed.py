"""FSDP2 collective bytes and step time per training step of the built-in GPT on 2 CPU
processes (gloo), with the bf16 weight all-gather and with the MXFP8 all-gather
(`MXConfig(fsdp_all_gather="mxfp8")`), both compiled with the mxfp8 backend.

    python benchmarks/distributed.py                      # GPT "small", Inductor lowering
    python benchmarks/distributed.py --quick              # GPT "tiny", eager lowering, smoke test
    python benchmarks/distributed.py --json out.json

Launches itself under `torch.distributed.run --standalone --nproc-per-node N`. Parameters are
fp32 masters with FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the
baseline gathers bf16 (2 B/element), the MX variant gathers fp8 + one scale byte per 32
(1.03 B/element) for every linear weight; norms and embeddings gather bf16 in both.
Bytes are counted by wrapping torch.distributed's collectives (payload each rank contributes:
its shard for an all-gather, the full gradient for a reduce-scatter) over one step; step time
is the median over --steps steps after --warmup steps. Prints both and their ratios
(mxfp8 / bf16).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

DEFAULT_NPROC = 2
DEFAULT_STEPS = 6
DEFAULT_WARMUP = 2
DEFAULT_BATCH_PER_RANK = 4
DATA_SEED = 0
MODEL_SEED = 0
LR = 1e-3
MODES = ("bf16", "mxfp8")
IN_CHILD = "MXCOMPILE_DISTRIBUTED_BENCH_CHILD"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="GPT preset (tiny, small, medium)")
    parser.add_argument("--lowering", choices=("inductor", "eager"), default="inductor",
                        help="inductor: the full mxfp8 backend; eager: the pipeline without Inductor")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--batch-per-rank", type=int, default=DEFAULT_BATCH_PER_RANK)
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    parser.add_argument("--quick", action="store_true", help="tiny GPT, eager lowering, 2 + 1 steps")
    parser.add_argument("--json", help="write the results here (from rank 0)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.lowering, args.steps, args.warmup = "tiny", "eager", 2, 1
    for name in ("steps", "warmup", "batch_per_rank", "nproc"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from mxcompile.backend import compile_graph
    from mxcompile.config import MXConfig
    from mxcompile.distributed import CollectiveCounter, compile_fsdp2, shard_gpt_fsdp2
    from mxcompile.examples.gpt import gpt_factory, lm_loss
    from mxcompile.lowering import eager_compiler, inductor_compiler

    torch._dynamo.reset()
    config = MXConfig(fsdp_all_gather=mode)
    model = gpt_factory(args.size, seed=MODEL_SEED)[0]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_gpt_fsdp2(model, mesh, config=config, mp_policy=policy)
    lower = inductor_compiler if args.lowering == "inductor" else eager_compiler
    compile_fsdp2(model, backend=functools.partial(compile_graph, config=config, lower=lower))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(DATA_SEED + dist.get_rank())
    seq = model.config.block_size
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_per_rank, seq + 1), generator=generator)

    def step() -> float:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    started = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_s = time.perf_counter() - started
    times, comm = [], None
    for _ in range(args.steps):
        dist.barrier()
        with CollectiveCounter() as counter:
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
        comm = counter.totals.as_dict()
    return {"mode": mode, "step_s": statistics.median(times), "compile_and_warmup_s": warmup_s,
            "loss": loss, "collectives": comm}


def child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {mode: run_mode(mode, args) for mode in MODES}
    if dist.get_rank() == 0:
        base, mx = results["bf16"], results["mxfp8"]
        ratios = {
            "all_gather_bytes": mx["collectives"]["bytes"]["all_gather"] / base["collectives"]["bytes"]["all_gather"],
            "total_bytes": mx["collectives"]["total_bytes"] / base["collectives"]["total_bytes"],
            "step_time": mx["step_s"] / base["step_s"],
        }
        summary = {"size": args.size, "lowering": args.lowering, "world_size": dist.get_world_size(),
                   "batch_per_rank": args.batch_per_rank, "torch": torch.__version__,
                   "results": results, "ratios_mxfp8_over_bf16": ratios}
        for mode, r in results.items():
            b = r["collectives"]["bytes"]
            print(f"{mode:6s} all_gather {b.get('all_gather', 0) / 1e6:8.3f} MB  reduce_scatter "
                  f"{b.get('reduce_scatter', 0) / 1e6:8.3f} MB  total {r['collectives']['total_bytes'] / 1e6:8.3f} MB"
                  f"  step {r['step_s'] * 1e3:8.1f} ms  (compile+warmup {r['compile_and_warmup_s']:.1f} s)")
        print("mxfp8 / bf16: " + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get(IN_CHILD):
        child(args)
        return 0
    env = {**os.environ, IN_CHILD: "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", os.path.abspath(__file__),
               *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
