"""Convergence over seeds: the built-in GPT trained on the offline Shakespeare corpus in high
precision and in MXFP8 and FP4 (NVFP4, MXFP4) variants, several seeds each; validation loss on
held-out text at fixed steps, mean ± std over seeds, and each variant's gap to the
high-precision baseline with a 95% Welch t interval, and with a paired t interval over the seeds
(a seed fixes the initial weights and the batch order in every variant, so per-seed differences
cancel the variation they share). An ablation is also paired against its full recipe.

    python benchmarks/convergence.py --quick                       # tiny smoke run (the test's)
    python benchmarks/convergence.py --size tiny --d-model 32 --layers 2 --heads 2 --seq-len 32 \\
        --batch-size 4 --steps 1000 --precision fp32 --threads 1 --eval-every 100 \\
        --eval-batches 64 --seeds 0 1 2 3 4 --variants baseline mxfp8 nvfp4 nvfp4-no-rht \\
        nvfp4-no-sr nvfp4-no-2d nvfp4-no-hp mxfp4 mxfp4-sr-rht   # the FP4 table (docs/fp4.md)

Variants (same seed = same initial weights and same batch order in every variant):
  baseline      torch.compile's default backend, in --precision (bf16 autocast, or fp32)
  mxfp8         every GEMM, attention's included, in MXFP8 (mxcompile's defaults)
  mx-noattn     linear layers only (attention="off")
  mx-floor      a contrast: scale_mode="floor" (OCP's rule, which saturates a block's top
                elements where rceil never does; the recipe paper reports it worse)
  mx-e5m2-fwd   a contrast that should be worse: E5M2 elements (2 mantissa bits) in the forward
  mx-broken     a deliberately broken recipe, so that the benchmark must separate it: mx-noattn
                with every linear operand's block scale one binade too small, injected into the
                CPU kernels of mxcompile's quantize ops (`broken_scales`): elements of the top
                half of each block's range saturate at the format's max
  torchao-mx    torchao's MXFP8 training recipe with its emulated kernels (fp32 master weights,
                no autocast: torchao 0.18 fails under bf16 autocast); its one-line failure
                reason is reported instead when it cannot run here
  nvfp4         backend="nvfp4" with its defaults, NVIDIA's NVFP4 pre-training recipe (linear
                layers' GEMMs in NVFP4, 16x16 weight blocks, RHT on the weight-gradient inputs,
                stochastic rounding of gradients, the last 15% of linear layers and the lm_head
                in high precision; attention in high precision)
  nvfp4-no-rht  nvfp4 with rht=False            } ablations: each is also paired against nvfp4
  nvfp4-no-sr   nvfp4 with stochastic_rounding=False  } (`compare_to`), to tell whether taking
  nvfp4-no-2d   nvfp4 with weight_2d=False      } that part out makes it worse
  nvfp4-no-hp   nvfp4 with high_precision_layers=0 (no layer kept, the lm_head included)
  mxfp4         backend="mxfp4" with its defaults (MXFP4 GEMMs, round to nearest, no RHT, no
                high-precision layers), also paired against nvfp4
  mxfp4-sr-rht  mxfp4 with its two switches on (stochastic rounding of gradients, RHT on the
                weight-gradient inputs), also paired against mxfp4

Validation: every --eval-every steps the trained weights are copied into a plain GPT and
evaluated eagerly, in --precision, on the same --eval-batches batches of the validation split
(the corpus' last 10%, never trained on), so every variant is scored by the same forward.

Writes convergence.json (settings, every per-seed curve, the summary) and convergence.png (mean
curves with ± std bands over seeds) to --out. A run without the baseline, or with one seed, is a
part: it writes its runs only. `--merge A.json B.json ...` combines parts of the same command run
with other --variants or --seeds (e.g. one process per variant and seed) and writes the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from matplotlib.figure import Figure
from scipy import stats

from mxcompile.examples.data import load_corpus, train_val_split
from mxcompile.examples.gpt import GPT, GPT_SIZES, GPTConfig
from mxcompile.examples.train import evaluate, train
from mxcompile.numerics import blocks_and_scales, elem_format, scale_bytes_from_amax, scale_mode_named
from mxcompile.numerics.formats import E8M0_BIAS, E8M0_NAN
from mxcompile.numerics.rounding import fake_quantize_blocks
from mxcompile.numerics.scales import inverse_scale_fp32_from_bytes
from mxcompile.ops.quantize import fake_quantize_op, quantize_op

CONFIDENCE = 0.95
EVAL_SEED = 1234  # fixed: every variant and seed is scored on the same validation batches
PRECISIONS = ("bf16", "fp32")
BASELINE = "baseline"
TORCHAO = "torchao"
NVFP4 = "nvfp4"
RESULTS_NAME = "convergence.json"
PLOT_NAME = "convergence.png"
# Settings that must agree between result files before --merge combines them.
MERGE_KEYS = ("size", "d_model", "layers", "heads", "seq_len", "steps", "batch_size", "lr", "grad_clip",
              "texts", "eval_every", "eval_batches", "precision")


@dataclass(frozen=True)
class Variant:
    """One column: how the model is trained. backend is a torch.compile backend name, or
    TORCHAO for torchao's recipe (applied to the model, then compiled with Inductor)."""

    name: str
    backend: str
    options: Mapping[str, Any] | None = None
    broken_scales: bool = False  # run under `broken_scales` (a fault injection; mxfp8 only)
    # Another variant this one is also paired against (an ablation against its full recipe).
    compare_to: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a variant needs a name")
        if self.compare_to == self.name:
            raise ValueError(f"variant {self.name!r}: compare_to names the variant itself; name another one")
        if self.backend == TORCHAO and self.options is not None:
            raise ValueError(f"variant {self.name!r}: torchao takes no compile options")
        if self.broken_scales and self.backend != "mxfp8":
            raise ValueError(f"variant {self.name!r}: broken_scales needs the mxfp8 backend")


VARIANTS = (
    Variant(BASELINE, "inductor"),
    Variant("mxfp8", "mxfp8"),
    Variant("mx-noattn", "mxfp8", {"attention": "off"}),
    Variant("mx-floor", "mxfp8", {"scale_mode": "floor"}),
    Variant("mx-e5m2-fwd", "mxfp8", {"forward_elem": "e5m2"}),
    # attention off: the MX attention op rounds inside its own kernels, not through the
    # quantize ops that broken_scales replaces.
    Variant("mx-broken", "mxfp8", {"attention": "off"}, broken_scales=True),
    Variant("torchao-mx", TORCHAO),
    # The FP4 recipes (torch.compile options of backend="nvfp4" / "mxfp4"): NVIDIA's recipe
    # with its defaults, each of its four parts switched off (paired against the full recipe),
    # and MXFP4 with its defaults and with its two switches on.
    Variant(NVFP4, "nvfp4"),
    Variant("nvfp4-no-rht", "nvfp4", {"rht": False}, compare_to=NVFP4),
    Variant("nvfp4-no-sr", "nvfp4", {"stochastic_rounding": False}, compare_to=NVFP4),
    Variant("nvfp4-no-2d", "nvfp4", {"weight_2d": False}, compare_to=NVFP4),
    Variant("nvfp4-no-hp", "nvfp4", {"high_precision_layers": 0}, compare_to=NVFP4),
    Variant("mxfp4", "mxfp4", compare_to=NVFP4),
    Variant("mxfp4-sr-rht", "mxfp4", {"stochastic_rounding": True, "rht": True}, compare_to="mxfp4"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}
QUICK_VARIANTS = (BASELINE, "mxfp8")


class TorchaoUnavailable(RuntimeError):
    """torchao's MX recipe cannot run here; the message is the one-line reason."""


def broken_fake_quantize(x: torch.Tensor, axis: int, elem: str, scale_mode: str, block_size: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """`mxcompile::fake_quantize` with each block's scale one binade too small: the elements are
    x / (scale / 2), rounded and saturated at the format's max, times scale / 2. Written from
    the numerics core (the correct scales, then halved), in fp32."""
    axis %= x.ndim
    fmt = elem_format(elem)
    blocks, _amax, scale, inverse = blocks_and_scales(x.float(), axis, fmt, scale_mode_named(scale_mode), block_size)
    # E8M0's least scale (2**-127, e.g. an all-zero block) has no binade below it: kept.
    least = scale <= E8M0_LEAST_SCALE
    rounded = fake_quantize_blocks(blocks, torch.where(least, scale, scale * 0.5),
                                   torch.where(least, inverse, inverse * 2.0), fmt).reshape(x.shape)
    return torch.empty_like(x, dtype=dtype).copy_(rounded)


E8M0_LEAST_SCALE = 2.0**-E8M0_BIAS


def broken_quantize(x: torch.Tensor, axis: int, elem: str, scale_mode: str,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxcompile::quantize` with each block's scale byte one less (scale one binade too small):
    the correct scale bytes minus 1 (0 stays 0, NaN stays NaN), the elements x / (scale / 2)
    saturated at the format's max."""
    axis %= x.ndim
    fmt = elem_format(elem)
    blocks, amax, _scale, _inverse = blocks_and_scales(x.float(), axis, fmt, scale_mode_named(scale_mode), block_size)
    correct = scale_bytes_from_amax(amax, fmt, scale_mode_named(scale_mode))
    scale_bytes = torch.where(correct == E8M0_NAN, correct, (correct - 1).clamp(min=0))
    elements = (blocks * inverse_scale_fp32_from_bytes(scale_bytes)).clamp(-fmt.max_normal, fmt.max_normal)
    data = torch.empty_like(x, dtype=fmt.dtype).copy_(elements.reshape(x.shape))
    return data, scale_bytes.squeeze(axis + 1).to(torch.uint8)


@contextlib.contextmanager
def broken_scales() -> Iterator[None]:
    """Within the block, mxcompile's quantize ops run `broken_quantize` and
    `broken_fake_quantize` on CPU: every MX linear GEMM of a compiled graph (the CPU lowering
    keeps these ops opaque, so their kernels are looked up at each call) rounds its operands
    with scales one binade too small. The ops' own kernels are restored on exit."""
    ops = ((quantize_op, broken_quantize), (fake_quantize_op, broken_fake_quantize))
    saved = [(op, op._backend_fns["cpu"]) for op, _ in ops]
    try:
        for op, kernel in ops:
            op.register_kernel("cpu")(kernel)
        yield
    finally:
        for op, kernel in saved:
            op.register_kernel("cpu")(kernel)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The preset --size with any of --d-model/--layers/--heads/--seq-len overriding it."""
    overrides = {"d_model": args.d_model, "n_layer": args.layers, "n_head": args.heads,
                 "block_size": args.seq_len}
    return dataclasses.replace(GPT_SIZES[args.size], **{k: v for k, v in overrides.items() if v is not None})


def build_model(config: GPTConfig, seed: int) -> GPT:
    """A GPT initialised from `seed`, leaving the caller's random state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def torchao_mx(model: GPT) -> GPT:
    """Apply torchao's MXFP8 training recipe with emulated kernels (the one that runs on CPU)
    to every nn.Linear, in place; TorchaoUnavailable with the reason when it cannot."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as err:
        raise TorchaoUnavailable(f"torchao not importable: {err}") from err
    config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED)
    quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear))
    return model


def validation_loss(model: GPT, scorer: GPT, args: argparse.Namespace, val_data: torch.Tensor) -> float:
    """The trained weights of `model` copied into the plain GPT `scorer`, evaluated eagerly."""
    scorer.load_state_dict({k: v.detach() for k, v in model.state_dict().items()})
    return evaluate(scorer, args.batch_size, scorer.config.block_size, args.eval_batches,
                    seed=EVAL_SEED, data=val_data, autocast_bf16=args.precision == "bf16")


def run_seed(variant: Variant, seed: int, args: argparse.Namespace, train_data: torch.Tensor,
             val_data: torch.Tensor) -> dict:
    """Train one seed of one variant; its validation curve at the eval steps, its training
    losses and its wall time."""
    config = model_config(args)
    model = build_model(config, seed)
    scorer = build_model(config, seed)
    backend, options, autocast = variant.backend, variant.options, args.precision == "bf16"
    if variant.backend == TORCHAO:
        model, backend, autocast = torchao_mx(model), "inductor", False
    curve: list[float] = []

    def progress(step: int, loss: float) -> None:
        if step % args.eval_every == 0:
            curve.append(validation_loss(model, scorer, args, val_data))

    started = time.perf_counter()
    with broken_scales() if variant.broken_scales else contextlib.nullcontext():
        losses = train(model, args.steps, args.batch_size, config.block_size, lr=args.lr, seed=seed,
                       compile_backend=backend, compile_options=options, autocast_bf16=autocast,
                       progress=progress, data=train_data, max_grad_norm=args.grad_clip)
    return {"seed": seed, "val": curve, "train": losses, "seconds": time.perf_counter() - started}


def run(args: argparse.Namespace, on_seed: Callable[[dict], None] | None = None) -> dict:
    """Every selected variant over every seed, seed by seed (every variant's seed 0, then every
    variant's seed 1, ...), so that a run stopped early holds whole seeds of every variant;
    `on_seed(runs)` after each (e.g. to save them). A torchao failure is recorded as its reason."""
    train_data, val_data = train_val_split(load_corpus(args.texts))
    selected = [v for v in VARIANTS if v.name in args.variants]
    runs: dict[str, dict] = {v.name: {"status": "ok", "runs": []} for v in selected}
    for seed in args.seeds:
        for variant in selected:
            entry = runs[variant.name]
            if entry["status"] != "ok":
                continue
            try:
                entry["runs"].append(run_seed(variant, seed, args, train_data, val_data))
            except (TorchaoUnavailable, RuntimeError) as err:
                if variant.backend != TORCHAO:
                    raise
                # torchao's CPU path is a prototype: report its reason in the table, don't hide it.
                entry["status"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
                continue
            finally:
                torch._dynamo.reset()
            print(f"{variant.name} seed {seed}: val {entry['runs'][-1]['val'][-1]:.4f} "
                  f"({entry['runs'][-1]['seconds']:.0f} s)", flush=True)
            if on_seed is not None:
                on_seed(runs)
    return runs


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """Mean(a) - mean(b) with its two-sided Welch t interval (unequal variances, Welch-
    Satterthwaite degrees of freedom; the t quantile from scipy)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a Welch interval needs 2 or more values per group; got {len(a)} and {len(b)}")
    diff = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:  # identical values in both groups: no spread to scale an interval by
        return {"diff": diff, "low": diff, "high": diff, "df": float(len(a) + len(b) - 2), "t": 0.0}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = float(stats.t.ppf(0.5 + confidence / 2, df))
    return {"diff": diff, "low": diff - t * se, "high": diff + t * se, "df": df, "t": t}


def paired_interval(a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE) -> dict | None:
    """Mean over seeds of a[seed] - b[seed] with its two-sided t interval (n - 1 degrees of
    freedom). Valid because a seed fixes the initial weights and the batch order in every
    variant, so the seed-to-seed variation common to both cancels. None with fewer than 2
    seeds in common."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    diffs = [a[seed] - b[seed] for seed in seeds]
    diff = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    t = float(stats.t.ppf(0.5 + confidence / 2, len(diffs) - 1))
    return {"diff": diff, "low": diff - t * se, "high": diff + t * se, "df": float(len(diffs) - 1), "t": t,
            "seeds": seeds}


def summarize(runs: Mapping[str, dict]) -> dict:
    """Per variant: mean and sample std over seeds of the validation curve and its final value;
    the gap of the final value to the baseline (absolute and percent of the baseline mean) with
    its Welch interval; whether the variant's mean lies within the baseline's mean ± std."""
    if runs.get(BASELINE, {}).get("status") != "ok":
        raise ValueError(f"the {BASELINE!r} variant is missing or failed; every gap is measured against it")
    for name, entry in runs.items():
        if entry["status"] == "ok" and len(entry["runs"]) < 2:
            raise ValueError(f"variant {name!r} has {len(entry['runs'])} seed; std and intervals need 2 or "
                             "more: run more --seeds, or --merge the parts run with other seeds")
    base_final = [r["val"][-1] for r in runs[BASELINE]["runs"]]
    base_mean, base_std = statistics.fmean(base_final), statistics.stdev(base_final)
    base_by_seed = {r["seed"]: r["val"][-1] for r in runs[BASELINE]["runs"]}
    summary = {}
    for name, entry in runs.items():
        if entry["status"] != "ok":
            summary[name] = {"status": entry["status"]}
            continue
        diverged = [r["seed"] for r in entry["runs"] if not math.isfinite(r["val"][-1])]
        if diverged:  # a recipe that diverges is a result, not a crash of the statistics
            summary[name] = {"status": f"diverged: non-finite validation loss at seeds {diverged}"}
            continue
        curves = [r["val"] for r in entry["runs"]]
        final = [c[-1] for c in curves]
        gap = welch_interval(final, base_final)
        paired = paired_interval({r["seed"]: r["val"][-1] for r in entry["runs"]}, base_by_seed)
        summary[name] = {
            "status": "ok",
            "seeds": [r["seed"] for r in entry["runs"]],
            "mean_curve": [statistics.fmean(col) for col in zip(*curves)],
            "std_curve": [statistics.stdev(col) for col in zip(*curves)],
            "final_mean": statistics.fmean(final),
            "final_std": statistics.stdev(final),
            "gap": gap,
            "gap_percent": {k: 100.0 * gap[k] / base_mean for k in ("diff", "low", "high")},
            "paired_gap": paired,
            "paired_gap_percent": None if paired is None else
            {k: 100.0 * paired[k] / base_mean for k in ("diff", "low", "high")},
            "within_baseline_spread": abs(statistics.fmean(final) - base_mean) <= base_std,
            # Paired: the interval excludes 0 (the variant is told apart from the baseline),
            # and its half-width, the smallest gap these seeds could tell from 0.
            "separated": None if paired is None else not paired["low"] <= 0.0 <= paired["high"],
            "resolvable_percent": None if paired is None else
            100.0 * (paired["high"] - paired["low"]) / 2.0 / base_mean,
            "seconds_per_run": statistics.fmean(r["seconds"] for r in entry["runs"]),
            "compared": compare_to_reference(name, runs),
        }
    return summary


def compare_to_reference(name: str, runs: Mapping[str, dict]) -> dict | None:
    """The paired interval of `name`'s final loss minus that of its `compare_to` variant (an
    ablation minus its full recipe), absolute and in percent of the reference's mean; None when
    the variant has no reference, or the reference did not run or has under 2 seeds in common."""
    reference = VARIANTS_BY_NAME[name].compare_to if name in VARIANTS_BY_NAME else None
    if reference is None or runs.get(reference, {}).get("status") != "ok":
        return None
    finals = {r["seed"]: r["val"][-1] for r in runs[reference]["runs"]}
    paired = paired_interval({r["seed"]: r["val"][-1] for r in runs[name]["runs"]}, finals)
    if paired is None or not all(math.isfinite(v) for v in finals.values()):
        return None
    ref_mean = statistics.fmean(finals[seed] for seed in paired["seeds"])
    return {"reference": reference, "paired_gap": paired,
            "paired_gap_percent": {k: 100.0 * paired[k] / ref_mean for k in ("diff", "low", "high")},
            "separated": not paired["low"] <= 0.0 <= paired["high"], "worse": paired["low"] > 0.0}


def eval_steps(settings: Mapping[str, Any]) -> list[int]:
    return list(range(settings["eval_every"], settings["steps"] + 1, settings["eval_every"]))


def print_table(results: Mapping[str, Any]) -> None:
    settings, summary = results["settings"], results["summary"]
    base = settings["precision"]
    print(f"\nGPT {settings['config']}, {settings['steps']} steps, batch {settings['batch_size']}, "
          f"seeds {settings['seeds']}, baseline {base}; validation loss at step {settings['steps']}")
    print(f"{'variant':12} {'val loss mean ± std':>22} {'gap to ' + base + ' [95% CI]':>34} "
          f"{'gap %':>24} {'paired gap % (same seeds)':>28} {'s/run':>7}")
    for name, row in summary.items():
        if row["status"] != "ok":
            print(f"{name:12} {row['status']}")
            continue
        gap, pct, paired = row["gap"], row["gap_percent"], row["paired_gap_percent"]
        paired_text = "n/a" if paired is None else \
            f"{paired['diff']:+.2f}% [{paired['low']:+.2f}, {paired['high']:+.2f}]"
        print(f"{name:12} {row['final_mean']:13.4f} ± {row['final_std']:.4f} "
              f"{gap['diff']:+10.4f} [{gap['low']:+.4f}, {gap['high']:+.4f}] "
              f"{pct['diff']:+7.2f}% [{pct['low']:+.2f}, {pct['high']:+.2f}] {paired_text:>28} "
              f"{row['seconds_per_run']:7.0f}")
    if summary.get("mxfp8", {}).get("status") == "ok":
        print(spread_statement(summary, base))
    for line in separation_statements(summary, base):
        print(line)


def separation_statements(summary: Mapping[str, Any], base: str) -> list[str]:
    """Per variant, whether its paired 95% interval excludes 0; then the smallest gap the setup
    resolves: the half-width of a paired interval, for mxfp8 and over all variants."""
    rows = {name: row for name, row in summary.items()
            if name != BASELINE and row["status"] == "ok" and row["paired_gap"] is not None}
    lines = [f"{name:12} paired gap {row['paired_gap_percent']['diff']:+.2f}%: "
             f"{'separated from' if row['separated'] else 'not separated from'} {base} "
             f"(interval {'excludes' if row['separated'] else 'contains'} 0)" for name, row in rows.items()]
    for name, row in rows.items():
        if (compared := row.get("compared")) is not None:
            pct, verdict = compared["paired_gap_percent"], "not separated from"
            if compared["separated"]:
                verdict = "separated (worse) from" if compared["worse"] else "separated (better) from"
            lines.append(f"{name:12} vs {compared['reference']}: paired gap {pct['diff']:+.2f}% "
                         f"[{pct['low']:+.2f}, {pct['high']:+.2f}] of {compared['reference']}: {verdict} it")
    if rows:
        widths = {name: row["resolvable_percent"] for name, row in rows.items()}
        mx = f"mxfp8 ±{widths['mxfp8']:.2f}%, " if "mxfp8" in widths else ""
        lines.append(f"smallest resolvable gap (half-width of the paired 95% interval, seeds "
                     f"{rows[next(iter(rows))]['paired_gap']['seeds']}): {mx}"
                     f"over the variants {min(widths.values()):.2f}% to {max(widths.values()):.2f}%")
    return lines


def spread_statement(summary: Mapping[str, Any], base: str) -> str:
    row, ref = summary["mxfp8"], summary[BASELINE]
    where = "within" if row["within_baseline_spread"] else "outside"
    contains = row["gap"]["low"] <= 0.0 <= row["gap"]["high"]
    return (f"mxfp8's mean final loss lies {where} {base}'s seed-to-seed spread "
            f"(|gap| {abs(row['gap']['diff']):.4f} vs {base} std {ref['final_std']:.4f}); "
            f"the 95% interval of the gap {'contains' if contains else 'excludes'} 0.")


def plot(results: Mapping[str, Any]) -> Figure:
    """Mean validation curve of each variant with a band of ± one std over seeds."""
    steps, summary = eval_steps(results["settings"]), results["summary"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, row in summary.items():
        if row["status"] != "ok":
            continue
        mean, std = row["mean_curve"], row["std_curve"]
        label = BASELINE + f" ({results['settings']['precision']})" if name == BASELINE else name
        (line,) = ax.plot(steps, mean, label=f"{label}: {row['final_mean']:.4f} ± {row['final_std']:.4f}")
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2, label=f"_{name} band")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"GPT on Shakespeare, mean ± std over seeds {results['settings']['seeds']}")
    ax.legend()
    fig.tight_layout()
    return fig


def settings_of(args: argparse.Namespace) -> dict:
    return {"size": args.size, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
            "seq_len": args.seq_len, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "grad_clip": args.grad_clip,
            "texts": args.texts, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
            "precision": args.precision, "seeds": list(args.seeds), "threads": torch.get_num_threads(),
            "config": dataclasses.asdict(model_config(args))}


def merge(paths: Sequence[Path]) -> dict:
    """Combine result files whose MERGE_KEYS settings agree: each variant's seeds are pooled
    (sorted by seed); a (variant, seed) in two files is an error; a failed part's status wins."""
    loaded = [json.loads(Path(p).read_text()) for p in paths]
    settings = dict(loaded[0]["settings"])
    pooled: dict[str, dict] = {}
    for path, result in zip(paths, loaded):
        differ = [k for k in MERGE_KEYS if result["settings"].get(k) != settings.get(k)]
        if differ:
            raise ValueError(f"{path} was run with other settings ({', '.join(differ)}); "
                             "merge only parts of the same command run with other --variants or --seeds")
        for name, entry in result["runs"].items():
            into = pooled.setdefault(name, {"status": "ok", "runs": []})
            seen = {r["seed"] for r in into["runs"]}
            if any(r["seed"] in seen for r in entry["runs"]):
                raise ValueError(f"variant {name!r} has a seed in more than one file ({path}); give each once")
            into["runs"].extend(entry["runs"])
            if entry["status"] != "ok":
                into["status"] = entry["status"]
    for entry in pooled.values():
        entry["runs"].sort(key=lambda r: r["seed"])
    settings["seeds"] = sorted({r["seed"] for entry in pooled.values() for r in entry["runs"]})
    settings["wall_seconds"] = max(result["settings"].get("wall_seconds", 0.0) for result in loaded)
    return {"settings": settings, "runs": {name: pooled[name] for name in VARIANT_NAMES if name in pooled}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(GPT_SIZES))
    parser.add_argument("--d-model", type=int, default=None, help="overrides the preset")
    parser.add_argument("--layers", type=int, default=None, help="overrides the preset")
    parser.add_argument("--heads", type=int, default=None, help="overrides the preset")
    parser.add_argument("--seq-len", type=int, default=None, help="overrides the preset's block size")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad-clip", type=float, default=None,
                        help="clip the global gradient norm to this value (None: no clipping)")
    parser.add_argument("--texts", type=int, default=20, help="number of corpus texts to load")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS,
                        help="baseline and MX high-precision dtype: bf16 autocast, or fp32 "
                             "(for CPUs without bf16 GEMM instructions, where bf16 is slow)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_NAMES), choices=VARIANT_NAMES)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads; 1 is far faster on an oversubscribed CPU")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: baseline and mxfp8 only, GPT 'tiny' at batch 2 (the graphs of "
                             "`mxcompile demo --batch-size 2`, so each can reuse the other's compiled "
                             "kernels), 6 steps, seeds 0 1 2")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="combine these result files instead of training")
    parser.add_argument("--out", type=Path, default=Path("out/convergence"))
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.d_model, args.layers, args.heads, args.seq_len = "tiny", None, None, None, None
        args.steps, args.eval_every, args.eval_batches, args.batch_size = 6, 2, 2, 2
        args.texts, args.seeds = 1, [0, 1, 2]
        args.variants = [v for v in args.variants if v in QUICK_VARIANTS]
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: give each seed once")
    if args.steps % args.eval_every != 0:
        parser.error(f"--steps {args.steps} is not a multiple of --eval-every {args.eval_every}; "
                     "the final step must be an eval step")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.merge is not None:
        results = merge(args.merge)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = settings_of(args)

        def save(runs: dict) -> None:  # each finished seed, so that a stopped run keeps them
            done = {name: entry for name, entry in runs.items() if entry["runs"] or entry["status"] != "ok"}
            seeds = sorted({r["seed"] for entry in done.values() for r in entry["runs"]})
            part = {"settings": {**settings, "seeds": seeds, "wall_seconds": time.perf_counter() - started},
                    "runs": done}
            (args.out / RESULTS_NAME).write_text(json.dumps(part, indent=1))

        results = {"settings": settings, "runs": run(args, on_seed=save)}
        results["settings"]["wall_seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    if BASELINE not in results["runs"] or len(results["settings"]["seeds"]) < 2:
        (args.out / RESULTS_NAME).write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out / RESULTS_NAME}: a part (no {BASELINE}, or one seed); combine parts with --merge")
        return results
    results["summary"] = summarize(results["runs"])
    print_table(results)
    (args.out / RESULTS_NAME).write_text(json.dumps(results, indent=1))
    plot(results).savefig(args.out / PLOT_NAME, dpi=100)
    print(f"\nwrote {args.out / RESULTS_NAME} and {args.out / PLOT_NAME}")
    return results


if __name__ == "__main__":
    main()
