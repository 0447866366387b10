"""Draw attention blocks (tests/gradient_blocks.py) and compare each one's compiled-MX gradients
with the eager MX oracle's: the long run of the fuzzer whose fixed draws CI runs
(tests/models/test_gradient_oracle.py).

    .venv/bin/python scripts/fuzz_gradients.py --examples 200 --seed 1 [--lowering inductor]

`--lowering decomposed` (default) runs the CPU lowering up to Inductor and then the graph op by
op (about 2 s a block here); `inductor` the whole backend (10-35 s a block). Prints one line per
block (worst gradient, its distance, the bound) and exits 1 if any block is out of bounds."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch._inductor.config as inductor_config  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from gradient_blocks import (  # noqa: E402
    block_recipes, bound_for, compare_with_oracle, decomposed_eager_lowering, describe,
    recipe_backend,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="blocks to draw (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--lowering", choices=("decomposed", "inductor"), default="decomposed")
    args = parser.parse_args(argv)
    from mxcompile.lowering import inductor_compiler

    lower = decomposed_eager_lowering() if args.lowering == "decomposed" else inductor_compiler
    failures: list[str] = []

    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @seed(args.seed)
    @given(block_recipes())
    def check(recipe):
        start = time.perf_counter()
        distances = compare_with_oracle(recipe, lambda r: recipe_backend(r, lower))
        bound = bound_for(recipe, exact_lowering=args.lowering == "decomposed")
        worst = max(distances, key=distances.get)
        verdict = "ok  " if distances[worst] <= bound else "FAIL"
        line = f"{verdict} {distances[worst]:.2e} (bound {bound:g}) {worst:<20} {time.perf_counter() - start:5.1f} s | {describe(recipe)}"
        print(line, flush=True)
        if verdict == "FAIL":
            failures.append(line)

    with inductor_config.patch(fallback_random=True):
        check()
    print(f"{args.examples} blocks, {len(failures)} out of bounds")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
