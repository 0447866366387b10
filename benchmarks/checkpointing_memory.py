"""Issue 46's memory target: HF gradient checkpointing under mxfp8 against the same model's
checkpointed step under Inductor, peak resident memory of one step, fresh processes.

    python benchmarks/checkpointing_memory.py --peak-runs 3 --out benchmarks/results/checkpointing_memory.json

Rows, each one training step of ``llama-small`` (mxcompile.measure.steps:hf_checkpointing_step,
4 layers, width 256, batch 8 x 128 tokens) in its own fresh process
(mxcompile.measure.fresh_process.measure_step_peak: VmHWM reset before the step, large buffers
returned to the OS on free), after WARMUP_STEPS untimed steps (the first compiles; the second
closes mxcompile's first-step measurement, so its profiler is not in the measured step):

* Inductor with HF checkpointing (dynamo runs the checkpointed layers eagerly in fp32);
* mxfp8 with HF checkpointing, non-reentrant and reentrant (each layer compiled on its own);
* both backends without checkpointing, for scale.

Each row is the median of ``--peak-runs`` processes (every run is kept in the JSON). The target
(issue 46): mxfp8 with checkpointing at or under Inductor with checkpointing, in what the step
adds to the resident set (as benchmarks/memory_budget_rss.py compares) and in tensor storage.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from mxcompile.measure.fresh_process import measure_step_peak

FACTORY = "mxcompile.measure.steps:hf_checkpointing_step"
WARMUP_STEPS = 2
MIB = 2 ** 20
ROWS = (  # (label, factory kwargs)
    ("inductor, checkpointing", {"backend": "inductor", "checkpointing": True}),
    ("mxfp8, checkpointing", {"backend": "mxfp8", "checkpointing": True}),
    ("mxfp8, checkpointing (reentrant)", {"backend": "mxfp8", "checkpointing": True, "use_reentrant": True}),
    ("inductor, no checkpointing", {"backend": "inductor", "checkpointing": False}),
    ("mxfp8, no checkpointing", {"backend": "mxfp8", "checkpointing": False}),
)
REFERENCE_ROW = ROWS[0][0]


def add_ratios(rows: list[dict]) -> None:
    """Each row's step peak (what the step adds to the resident set, as
    benchmarks/memory_budget_rss.py compares them) and tensor peak over REFERENCE_ROW's, printed.
    The process's whole peak is kept in the rows but not compared: it also holds what each
    backend loaded before the step (compiled code, native kernels), not the step's memory."""
    reference = next(r for r in rows if r["row"] == REFERENCE_ROW)
    for row in rows:
        row.pop("peak_ratio_to_inductor_checkpointing", None)
        row["step_peak_ratio_to_inductor_checkpointing"] = row["step_peak_mib"] / reference["step_peak_mib"]
        row["tensor_peak_ratio_to_inductor_checkpointing"] = row["tensor_peak_mib"] / reference["tensor_peak_mib"]
        print(f"{row['row']:<36} over {REFERENCE_ROW}: step adds "
              f"{row['step_peak_ratio_to_inductor_checkpointing']:.3f}x, tensors "
              f"{row['tensor_peak_ratio_to_inductor_checkpointing']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-runs", type=int, default=3, help="fresh processes per row (median)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for label, kwargs in ROWS:
        runs = [measure_step_peak(FACTORY, factory_kwargs=kwargs, warmup_steps=WARMUP_STEPS)
                for _ in range(args.peak_runs)]
        rows.append({"row": label, "kwargs": kwargs,
                     "peak_mib": statistics.median(r.peak_bytes for r in runs) / MIB,
                     "step_peak_mib": statistics.median(r.step_peak_bytes for r in runs) / MIB,
                     "tensor_peak_mib": statistics.median(r.tensor_peak_bytes for r in runs) / MIB,
                     "runs": [{"peak_bytes": r.peak_bytes, "before_bytes": r.before_bytes,
                               "tensor_peak_bytes": r.tensor_peak_bytes} for r in runs]})
        print(f"{label:<36} peak {rows[-1]['peak_mib']:8.1f} MiB  step adds {rows[-1]['step_peak_mib']:7.1f} MiB  "
              f"tensors {rows[-1]['tensor_peak_mib']:7.1f} MiB", flush=True)
    add_ratios(rows)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
                                        platform.machine(), "peak_runs": args.peak_runs,
                                        "warmup_steps": WARMUP_STEPS, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
