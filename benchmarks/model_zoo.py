"""The converted GEMM FLOP share of each HF architecture of the test zoo (tests/hf_zoo.py: tiny
configs, default dropout, train mode), as `mxcompile.report_of` gives it for the graphs a
two-step training run and an eval forward under no_grad compiled. The README's table of tested
architectures comes from this script:

    python benchmarks/model_zoo.py            # every zoo model
    python benchmarks/model_zoo.py vit mixtral

The rewritten graphs run eagerly (no Inductor): the shares are those of the rewrite, which
Inductor does not change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mxcompile  # noqa: E402
from hf_zoo import LR, SEQ, ZOO, recording_eager_backend  # noqa: E402
from mxcompile.report import KEPT  # noqa: E402


def shares(name: str) -> tuple[float, float, int, int, str]:
    """(training share, eval share, GEMMs converted, GEMMs, top kept reason) for one model."""
    torch.manual_seed(0)
    spec = ZOO[name]
    model = spec.build().train()
    batch = spec.batch(SEQ)
    compiled = torch.compile(model, backend=recording_eager_backend())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(2):
        compiled(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    training = mxcompile.report_of(model)
    model.eval()
    with torch.no_grad():
        compiled(**batch)
    inference = mxcompile.report_of(model)[len(training):]

    def share(reports) -> float:
        total = sum(r.gemm_flops_total for r in reports)
        return sum(r.converted_flop_fraction * r.gemm_flops_total for r in reports) / total if total else 0.0

    decisions = [d for r in training for d in r.decisions]
    kept = [d for d in decisions if d.decision == KEPT]
    top = max(kept, key=lambda d: d.flops).reason if kept else "-"
    return share(training), share(inference), len(decisions) - len(kept), len(decisions), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[], metavar="MODEL",
                        help=f"zoo models (default: all of {', '.join(ZOO)})")
    names = parser.parse_args().models or list(ZOO)
    unknown = sorted(set(names) - set(ZOO))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; accepted: {', '.join(ZOO)}")
    print("| architecture | training FLOPs converted | eval FLOPs converted | GEMMs converted (training) | largest kept GEMM's reason |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        # One process, many models: without a reset, the shared transformers wrappers' code
        # objects reach dynamo's recompile limit and later models run uncompiled.
        torch._dynamo.reset()
        mxcompile.clear_reports()
        train, evaluation, converted, gemms, top = shares(name)
        print(f"| {name} | {train:.1%} | {evaluation:.1%} | {converted} of {gemms} | {top} |", flush=True)


if __name__ == "__main__":
    main()
