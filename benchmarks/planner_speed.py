"""Activation-memory planner: speed on a 24-layer transformer-like problem, the tied ILP of
`plan_repeated`, and (with --gap) the heuristic's gap to the ILP on small random problems.

    python benchmarks/planner_speed.py [--gap] [--gap-examples 300]

Prints wall and CPU time: on a shared machine the wall time includes waiting for a core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from mxcompile.planner import BudgetInfeasibleError, plan_activation_memory, plan_repeated
from mxcompile.planner.ilp import min_peak
from mxcompile.planner.memory import build_tables, evaluate_codes
from mxcompile.planner.synthetic import random_problem, transformer_block, transformer_problem

N_LAYERS = 24
BUDGET_FRACTIONS = (0.05, 0.2, 0.3, 0.5, 0.8)
TIED_FRACTION = 0.2
BLOCK_GROUPS = (1, 2, 4)
GAP_SIZES = (6, 12)
GAP_SEED = 0
GAP_TIME_LIMIT_S = 30.0


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def speed() -> None:
    for fraction in BUDGET_FRACTIONS:
        problem, _ = transformer_problem(N_LAYERS, budget_fraction=fraction)
        plan, wall, cpu = _timed(lambda: plan_activation_memory(problem, solver="heuristic"))
        print(
            f"{N_LAYERS} layers, {len(problem.tensors)} tensors, {len(problem.steps)} steps, budget at "
            f"{fraction:.0%} of activation headroom: heuristic {wall:.2f} s wall, {cpu:.2f} s CPU; "
            f"step {plan.step_time_s * 1e3:.1f} ms (+{plan.extra_time_s * 1e3:.2f} ms)"
        )
    full, _ = transformer_problem(N_LAYERS, budget_fraction=TIED_FRACTION)
    block = replace(transformer_block(), budget_bytes=full.budget_bytes)
    persistent = full.baseline_bytes[0] - block.baseline_bytes[0]
    untied = plan_activation_memory(full, solver="heuristic")
    print(f"at {TIED_FRACTION:.0%}: untied heuristic +{untied.extra_time_s * 1e3:.2f} ms")
    for groups in BLOCK_GROUPS:
        plan, wall, cpu = _timed(
            lambda: plan_repeated(block, N_LAYERS, persistent_bytes=persistent, block_groups=groups, solver="ilp")
        )
        print(
            f"  plan_repeated ILP, {groups} block group(s): +{plan.extra_time_s * 1e3:.2f} ms "
            f"({wall:.2f} s wall, {cpu:.2f} s CPU, optimal={plan.optimal})"
        )


def gap(examples: int) -> None:
    for n in GAP_SIZES:
        rng = random.Random(GAP_SEED)
        gaps, extra_gaps, misses, binding = [], [], 0, 0
        for _ in range(examples):
            problem = random_problem(rng, n)
            tables = build_tables(problem)
            keep = evaluate_codes(tables, [0] * n).peak_bytes
            lowest = min_peak(problem, time_limit_s=GAP_TIME_LIMIT_S, tables=tables)[0].peak_bytes
            budget = lowest + int(rng.random() * (keep - lowest + 1))
            problem = replace(problem, budget_bytes=max(budget, 1))
            ilp = plan_activation_memory(problem, solver="ilp", time_limit_s=GAP_TIME_LIMIT_S)
            try:
                heuristic = plan_activation_memory(problem, solver="heuristic")
            except BudgetInfeasibleError:
                misses += 1
                continue
            if ilp.extra_time_s > 0:
                binding += 1
                extra_gaps.append(heuristic.extra_time_s / ilp.extra_time_s - 1)
            gaps.append(heuristic.step_time_s / ilp.step_time_s - 1 if ilp.step_time_s > 0 else 0.0)
        print(
            f"{n} tensors, {examples} random problems (seed {GAP_SEED}): heuristic step time above the ILP's by "
            f"max {max(gaps):.2%}, mean {statistics.mean(gaps):.3%}; {sum(g > 1e-9 for g in gaps)} worse; "
            f"extra time (when the ILP's is > 0, {binding} cases) mean +{statistics.mean(extra_gaps or [0]):.1%}; "
            f"heuristic found no plan in {misses}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", action="store_true", help="also measure the heuristic's gap to the ILP")
    parser.add_argument("--gap-examples", type=int, default=300)
    args = parser.parse_args()
    speed()
    if args.gap:
        gap(args.gap_examples)


if __name__ == "__main__":
    main()
