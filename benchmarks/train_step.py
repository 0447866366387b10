"""Training-step time of the built-in GPT on CPU, in one run: torch.compile's default backend
in bf16 autocast, the mxfp8 backend, and torchao's MX training recipe when it runs here.

    python benchmarks/train_step.py                 # width 512, 6 layers, seq 256, batch 8
    python benchmarks/train_step.py --quick         # tiny shapes, a smoke test

Each variant compiles, runs --warmup steps, then times --steps steps (median). Prints step
times and ratios to the bf16 step. Target: mxfp8 <= 1.15x bf16.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch

from mxcompile.examples.gpt import GPT, GPTConfig, lm_loss


def make_step(model: torch.nn.Module, compiled: Callable, optimizer) -> Callable:
    def step(idx: torch.Tensor) -> float:
        with torch.autocast("cpu", torch.bfloat16):
            loss = lm_loss(compiled(idx), idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def time_steps(step: Callable, idx: torch.Tensor, warmup: int, steps: int) -> tuple[float, float]:
    started = time.perf_counter()
    for _ in range(warmup):
        step(idx)
    compile_and_warmup = time.perf_counter() - started
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(idx)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_and_warmup


def torchao_variant(model: torch.nn.Module):
    """torchao's MXFP8 training (EMULATED kernels run on CPU), or the reason it can't run."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as err:
        return None, f"torchao not importable: {err}"
    model = model.float()
    config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED)
    quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    return model, ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and 2 timed steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.heads, args.seq, args.batch = 64, 2, 2, 64, 2
        args.warmup, args.steps, args.no_torchao = 2, 2, True

    config = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    print(f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch}, "
          f"{torch.get_num_threads()} threads")

    rows = []
    variants = (("bf16 (inductor)", "inductor", None),
                ("mxfp8", "mxfp8", None),
                ("mxfp8, attention off", "mxfp8", {"attention": "off"}))
    for name, backend, options in variants:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = make_step(model, torch.compile(model, backend=backend, options=options), optimizer)
        rows.append((name, *time_steps(step, idx, args.warmup, args.steps), ""))
        torch._dynamo.reset()
    if not args.no_torchao:
        model, why = torchao_variant(copy.deepcopy(base))
        if model is None:
            rows.append(("torchao MX", float("nan"), float("nan"), why))
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            step = make_step(model, torch.compile(model), optimizer)
            try:
                rows.append(("torchao MX (emulated)", *time_steps(step, idx, args.warmup, args.steps), ""))
            except RuntimeError as err:  # torchao's CPU path is a prototype; report, don't hide
                rows.append(("torchao MX (emulated)", float("nan"), float("nan"), str(err).splitlines()[0]))

    reference = rows[0][1]
    print(f"\n{'variant':24} {'step ms':>9} {'ratio':>7} {'compile+warmup s':>17}")
    for name, median, warm, note in rows:
        print(f"{name:24} {median * 1e3:9.1f} {median / reference:6.2f}x {warm:17.1f}  {note}")


if __name__ == "__main__":
    main()
