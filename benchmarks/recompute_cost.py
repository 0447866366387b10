"""The memory planner's extra-time estimate against the measured step overhead, side by side.

    OMP_NUM_THREADS=1 python benchmarks/recompute_cost.py                  # gpt-small, budgets 0.5 0.3
    OMP_NUM_THREADS=1 python benchmarks/recompute_cost.py --model gpt-tiny --fractions 0.3 --steps 3

For each budget fraction f, the model (:func:`mxcompile.measure.steps.build_model`: next-token
loss of the built-in GPT) is compiled with ``backend="mxfp8"`` (Inductor) with
``memory_budget=f`` and without one; each runs ``--steps`` timed training steps after a warm-up
step. The estimate is ``report.memory_plan["extra_time_s"]`` of that compile (recomputation,
exposed transfers and the attention ops' extra passes, from the planner's cost model,
:mod:`mxcompile.cost`, on :func:`mxcompile.calibration.cpu.measure_cpu_profile`); the measured
overhead is the planned step's time minus the unplanned one's, the fastest step of each.

Timing: with one torch thread (``OMP_NUM_THREADS=1``, recommended on a shared machine) a step is
timed by the process's CPU time, which other processes on the same cores do not inflate, and
the CPU profile is measured the same way; with more threads, by the wall clock.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

DEFAULT_MODEL = "gpt-small"
DEFAULT_FRACTIONS = (0.5, 0.3)
MS = 1e3


def _clock() -> Any:
    import torch

    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def compiled_step(model: str, fraction: float | None, *, batch_size: int) -> tuple[Callable[[], None], dict]:
    """One training step of ``model`` compiled with the mxfp8 backend at ``fraction`` (None: no
    budget), already run once (compiled), and the compile's ``report.memory_plan`` ({} without)."""
    import torch

    import mxcompile
    from mxcompile.config import MemoryBudget
    from mxcompile.measure.steps import build_model

    module, args = build_model(model, batch_size)
    # measure_first_step off: its profiler would run in the second step, a timed one.
    options = {"measure_first_step": False}
    if fraction is not None:
        options["memory_budget"] = MemoryBudget.of_fraction(fraction)
    compiled = torch.compile(module, backend="mxfp8", options=options)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        compiled(*args).backward()

    step()
    reports = mxcompile.report_of(module)
    return step, dict(reports[-1].memory_plan or {}) if reports else {}


def fastest_interleaved(steps: dict[Any, Callable[[], None]], repeats: int) -> dict[Any, float]:
    """The fastest time of each step over ``repeats`` rounds that run every step once, in turn:
    a slow spell of a shared machine then hits all of them, not one."""
    from mxcompile.measure.timing import time_interleaved

    times = time_interleaved(list(steps.values()), repeats, clock=_clock())
    return {key: min(step_times) for key, step_times in zip(steps, times)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--fractions", nargs="+", type=float, default=list(DEFAULT_FRACTIONS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per compile (the fastest counts)")
    args = parser.parse_args(argv)

    import torch

    from mxcompile.calibration.cpu import measure_cpu_profile

    profile = measure_cpu_profile()
    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} thread(s), "
          f"{'CPU time' if torch.get_num_threads() == 1 else 'wall time'}; profile {profile.name}: "
          f"{profile.memory_bandwidth / 1e9:.1f} GB/s, fp32 {profile.flops('fp32') / 1e9:.1f} GFLOP/s, "
          f"op rates {({k: f'{v:.3g}' for k, v in profile.op_rates.items()})}", flush=True)
    fractions = [None, *sorted(args.fractions, reverse=True)]
    compiled = {fraction: compiled_step(args.model, fraction, batch_size=args.batch) for fraction in fractions}
    best = fastest_interleaved({fraction: step for fraction, (step, _) in compiled.items()}, args.steps)
    base = best[None]
    print(f"no budget: step {base * MS:.0f} ms (fastest of {args.steps}, interleaved with the planned steps)")
    rows = []
    print(f"{'budget':>6} {'step ms':>8} {'measured +ms':>12} {'estimated ms':>12} {'est/meas':>8}  recomputed")
    for fraction in fractions[1:]:
        planned, plan = best[fraction], compiled[fraction][1]
        measured = planned - base
        estimated = plan.get("extra_time_s", 0.0)
        ratio = f"{estimated / measured:.2f}" if measured > 0 else "-"
        print(f"{fraction:6.2f} {planned * MS:8.0f} {measured * MS:+12.0f} {estimated * MS:12.1f} {ratio:>8}  "
              f"{len(plan.get('recomputed', []))} tensors: {', '.join(plan.get('recomputed', []))}", flush=True)
        rows.append({"fraction": fraction, "step_s": planned, "base_step_s": base, "measured_overhead_s": measured,
                     "estimated_extra_s": estimated, "recomputed": plan.get("recomputed", [])})
    return rows


if __name__ == "__main__":
    main()
