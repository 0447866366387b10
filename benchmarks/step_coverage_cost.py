"""What the run-time MX share (mxcompile/step_coverage.py) costs: the first training steps with
the measurement on and off, side by side, each in fresh processes.

    python benchmarks/step_coverage_cost.py --repeats 3 --out benchmarks/results/step_coverage_cost.json

Each process builds ``llama-small`` (mxcompile.measure.steps:hf_checkpointing_step, with or
without HF gradient checkpointing), compiles it with ``backend="mxfp8"``, and times its first
``STEPS`` training steps. "off" compiles with ``options={"measure_first_step": False}`` (no window
ever opens), so the difference is its cost: the profiler in step 1 (which also compiles), the
reading of the profile at step 2's first graph call, and nothing after. The on/off processes
alternate, ``--repeats`` of each; medians are printed, every run is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = 6
CASES = ({"checkpointing": False}, {"checkpointing": True})
RESULT_MARKER = "STEP_COVERAGE_COST "


def child(measure: bool, checkpointing: bool) -> dict:
    import mxcompile
    from mxcompile.measure.steps import hf_checkpointing_step

    step = hf_checkpointing_step(backend="mxfp8", checkpointing=checkpointing, measure_first_step=measure)
    times = []
    for _ in range(STEPS):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    coverage = mxcompile.reports() and next((r.step_coverage for r in mxcompile.reports() if r.step_coverage), None)
    return {"times_s": times, "measure_seconds": coverage.measure_seconds if coverage else None,
            "mx_flop_fraction": coverage.mx_flop_fraction if coverage else None}


def run_child(measure: bool, checkpointing: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps([measure, checkpointing])],
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode or not lines:
        raise RuntimeError(f"child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT_MARKER + json.dumps(child(*json.loads(args.child))))
        return
    results = []
    for case in CASES:
        runs = {"on": [], "off": []}
        for _ in range(args.repeats):
            for label, measure in (("on", True), ("off", False)):
                runs[label].append(run_child(measure, case["checkpointing"]))
        row = {"case": case, "runs": runs}
        for label in ("on", "off"):
            times = [r["times_s"] for r in runs[label]]
            row[label] = {"step1_s": statistics.median(t[0] for t in times),
                          "step2_s": statistics.median(t[1] for t in times),
                          "later_s": statistics.median(statistics.median(t[2:]) for t in times)}
        row["measure_seconds"] = statistics.median(r["measure_seconds"] for r in runs["on"])
        results.append(row)
        print(f"llama-small, checkpointing={case['checkpointing']}: median of {args.repeats} processes each")
        for key, name in (("step1_s", "step 1 (compiles)"), ("step2_s", "step 2"), ("later_s", "steps 3-6")):
            on, off = row["on"][key], row["off"][key]
            print(f"  {name:<18} on {on:8.3f} s  off {off:8.3f} s  on-off {on - off:+.3f} s ({on / off:.3f}x)")
        print(f"  reading the profile: {row['measure_seconds']:.3f} s; share {runs['on'][0]['mx_flop_fraction']:.4f}")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
                                        "steps": STEPS, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
