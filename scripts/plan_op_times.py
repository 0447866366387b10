"""Where a memory plan's extra step time goes: torch.profiler's per-op self CPU time of one
model's step without a budget and with one, averaged over --steps steps after two warm-up
steps, and their difference, largest first.

    python scripts/plan_op_times.py --model gpt-small --budget 0.5
    python scripts/plan_op_times.py --model gpt-small --budget 0.5 --lower eager

Issue 37 used it to find why the small GPT's plans cost ~40 ms per step against a recompute
estimate of 10-22 ms (docs/memory.md).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mxcompile.measure.steps import LOWERINGS, MODELS, mxfp8_budget_step


def op_times(model: str, batch_size: int, budget: float | None, steps: int,
             lower: str = "inductor") -> dict[str, tuple[float, float]]:
    """op name -> (calls per step, self CPU ms per step) of a step compiled with this budget."""
    step = mxfp8_budget_step(model, memory_budget=budget, batch_size=batch_size, lower=lower)
    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--lower", default="inductor", choices=LOWERINGS)
    args = parser.parse_args()
    unplanned = op_times(args.model, args.batch, None, args.steps, args.lower)
    torch._dynamo.reset()
    planned = op_times(args.model, args.batch, args.budget, args.steps, args.lower)
    rows = sorted(((planned.get(k, (0, 0.0))[1] - unplanned.get(k, (0, 0.0))[1], k) for k in {*unplanned, *planned}
                   if not k.startswith("## Call CompiledFxGraph")), reverse=True)
    print(f"{args.model} ({args.lower}), batch {args.batch}: budget {args.budget} against none, per step over {args.steps} steps")
    for delta, key in rows[:args.top]:
        (n0, t0), (n1, t1) = unplanned.get(key, (0, 0.0)), planned.get(key, (0, 0.0))
        print(f"{delta:+8.2f} ms  {key[:48]:48} none {n0:5.0f} calls {t0:7.2f} ms   planned {n1:5.0f} calls {t1:7.2f} ms")


if __name__ == "__main__":
    main()
