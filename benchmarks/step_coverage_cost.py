"""What the run-time MX share (mxcompile/step_coverage.py) costs: the first training steps with
the measurement on and off, side by side, each in fresh processes.

    python benchmarks/step_coverage_cost.py --repeats 3 --out benchmarks/results/step_coverage_cost.json

Each process builds ``llama-small`` (mxcompile.measure.steps:hf_checkpointing_step, with or
without HF gradient checkpointing), compiles it with ``backend="mxfp8"``, and times its first
``STEPS`` training steps. "on" compiles with ``options={"measure_first_step": True}``, "off" with
False (no window ever opens), so the difference is its cost: the profiler in step 2 (the first
after the step that compiles) and the reading of the profile when the loop closes it after that
step (`mxcompile.end_measured_step()`, called after every step in both), and nothing after. The on/off processes alternate, ``--repeats`` of each; medians are printed, every
run is kept in the JSON. A process that crashes is counted (its exit status kept), not retried:
with the profiler on, processes crashed now and then (docs/integrations.md), and this is also
a count of that.
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
        mxcompile.end_measured_step()  # the loop closes the measurement (docs/integrations.md), timed with it
        times.append(time.perf_counter() - began)
    coverage = mxcompile.reports() and next((r.step_coverage for r in mxcompile.reports() if r.step_coverage), None)
    return {"times_s": times, "measure_seconds": coverage.measure_seconds if coverage else None,
            "mx_flop_fraction": coverage.mx_flop_fraction if coverage else None}


def run_child(measure: bool, checkpointing: bool) -> dict:
    """One process's result, or {"exit": status, "stderr_tail": ...} when it printed none."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps([measure, checkpointing])],
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        return {"exit": done.returncode, "stderr_tail": done.stderr[-2000:]}
    return {"exit": done.returncode, **json.loads(lines[-1][len(RESULT_MARKER):])}


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
            finished = [r for r in runs[label] if "times_s" in r]
            times = [r["times_s"] for r in finished]
            row[label] = {"processes": len(runs[label]), "finished": len(finished),
                          "failed_exits": [r["exit"] for r in runs[label] if r["exit"]]}
            if times:
                row[label].update({"step1_s": statistics.median(t[0] for t in times),
                                   "step2_s": statistics.median(t[1] for t in times),
                                   "step3_s": statistics.median(t[2] for t in times),
                                   "later_s": statistics.median(statistics.median(t[3:]) for t in times)})
        measured = [r["measure_seconds"] for r in runs["on"] if r.get("measure_seconds") is not None]
        row["measure_seconds"] = statistics.median(measured) if measured else None
        results.append(row)
        print(f"llama-small, checkpointing={case['checkpointing']}: median of {args.repeats} processes each")
        for label in ("on", "off"):
            print(f"  {label}: {row[label]['finished']} of {row[label]['processes']} processes finished; "
                  f"failed exit statuses: {row[label]['failed_exits'] or 'none'}")
        for key, name in (("step1_s", "step 1 (compiles)"), ("step2_s", "step 2 (measured, read)"),
                          ("step3_s", "step 3"), ("later_s", "steps 4-6")):
            if key in row["on"] and key in row["off"]:
                on, off = row["on"][key], row["off"][key]
                print(f"  {name:<18} on {on:8.3f} s  off {off:8.3f} s  on-off {on - off:+.3f} s ({on / off:.3f}x)")
        if row["measure_seconds"] is not None:
            shares = [r["mx_flop_fraction"] for r in runs["on"] if r.get("mx_flop_fraction") is not None]
            print(f"  reading the profile: {row['measure_seconds']:.3f} s; share {shares[0]:.4f}")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
                                        "steps": STEPS, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
