"""Convergence: the built-in GPT trained on the offline Shakespeare corpus in bf16 (default
backend, autocast) and with the mxfp8 backend, same seed, same initial weights, same data order.

    python benchmarks/convergence.py                      # 300 steps, GPT "small"
    python benchmarks/convergence.py --steps 60 --size tiny --out out/

Prints the loss curves (every --print-every steps), the final loss of each (mean of the last
--tail steps) and the gap to bf16, with MX attention ("mxfp8") and without it ("mx-noattn");
writes loss_curves.png to --out. Target: mxfp8 within 2% of bf16.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from mxcompile.examples import gpt_factory
from mxcompile.examples.data import load_corpus, train_val_split
from mxcompile.examples.train import train

# (name, torch.compile backend, options): the columns of the table.
VARIANTS = (
    ("bf16", "inductor", None),
    ("mxfp8", "mxfp8", None),  # every GEMM and both attention GEMMs in MXFP8 (the defaults)
    ("mx-noattn", "mxfp8", {"attention": "off"}),  # linear layers only: the attention column
)


def final_loss(losses: list[float], tail: int) -> float:
    window = losses[-tail:]
    return sum(window) / len(window)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    base, _ = gpt_factory(args.size, seed=args.seed)
    train_data, _ = train_val_split(load_corpus(args.texts))
    seq_len = base.config.block_size
    results = {}
    for name, backend, options in VARIANTS:
        model = copy.deepcopy(base)
        started = time.perf_counter()
        losses = train(model, args.steps, args.batch_size, seq_len, lr=args.lr, seed=args.seed,
                       compile_backend=backend, compile_options=options, autocast_bf16=True,
                       data=train_data)
        results[name] = {"losses": losses, "seconds": time.perf_counter() - started,
                         "final": final_loss(losses, args.tail)}
        torch._dynamo.reset()
    reference = results["bf16"]["final"]
    for name in results:
        results[name]["gap_percent"] = 100.0 * (results[name]["final"] - reference) / reference
    return results


def print_table(results: dict, args: argparse.Namespace) -> None:
    names = list(results)
    print("step  " + "  ".join(f"{n:>8}" for n in names))
    for step in range(0, args.steps, args.print_every):
        print(f"{step + 1:4d}  " + "  ".join(f"{results[n]['losses'][step]:8.4f}" for n in names))
    print()
    print(f"{'variant':8} {'final':>8} {'gap':>8} {'time s':>8}")
    for name, r in results.items():
        print(f"{name:8} {r['final']:8.4f} {r['gap_percent']:+7.2f}% {r['seconds']:8.1f}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} ({r['final']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("GPT on Shakespeare: bf16 vs mxfp8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--texts", type=int, default=20, help="number of corpus texts to load")
    parser.add_argument("--tail", type=int, default=20, help="final loss = mean of the last N")
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("out/convergence"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = run(args)
    print_table(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "loss_curves.png")
    (args.out / "convergence.json").write_text(json.dumps(results))
    print(f"\nwrote {args.out / 'loss_curves.png'}")
    return results


if __name__ == "__main__":
    main()
