"""benchmarks/convergence.py: the statistics it reports are the statistics of its own per-seed
curves. `--quick` trains the baseline and mxfp8 over 3 seeds, and nvfp4 for one seed (every
other variant's options are checked to build a valid config without training); the checks
recompute each mean, std, gap and Welch interval from the per-seed validation curves with
numpy/scipy, and read the plot's bands back from the figure. The interval functions are checked
against scipy's own t tests (an ablation's against its full recipe too), and --merge against
the unsplit result."""

from __future__ import annotations

import dataclasses
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "convergence.py"
QUICK_SEEDS = [0, 1, 2]
QUICK_VARIANTS = ("baseline", "mxfp8")


def _module() -> SimpleNamespace:
    """The script's functions (runpy registers its module while its dataclasses are built)."""
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="convergence_benchmark"))


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("convergence")
    result = subprocess.run(
        # bf16, default threads: the graphs `mxcompile demo --batch-size 2` compiles
        # (tests/cli/test_demo.py), so one test's Inductor kernels serve the other's.
        [sys.executable, str(SCRIPT), "--quick", "--precision", "bf16", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "convergence.json").read_text()), result.stdout, out


def _finals(results: dict, name: str) -> np.ndarray:
    return np.array([r["val"][-1] for r in results["runs"][name]["runs"]])


@pytest.mark.slow
def test_quick_runs_every_variant_over_every_seed(quick) -> None:
    results, _, out = quick
    settings = results["settings"]
    n_evals = settings["steps"] // settings["eval_every"]
    assert list(results["runs"]) == list(QUICK_VARIANTS)
    for name in QUICK_VARIANTS:
        entry = results["runs"][name]
        assert entry["status"] == "ok"
        assert [r["seed"] for r in entry["runs"]] == QUICK_SEEDS
        for r in entry["runs"]:
            assert len(r["val"]) == n_evals and len(r["train"]) == settings["steps"]
            assert all(np.isfinite(r["val"]))
    # The seed changes the run: no two seeds of the baseline give the same curve.
    curves = [tuple(r["val"]) for r in results["runs"]["baseline"]["runs"]]
    assert len(set(curves)) == len(curves)
    assert (out / "convergence.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_summary_is_computed_from_the_seeds(quick) -> None:
    results, _, _ = quick
    base = _finals(results, "baseline")
    for name in QUICK_VARIANTS:
        row = results["summary"][name]
        curves = np.array([r["val"] for r in results["runs"][name]["runs"]])
        np.testing.assert_allclose(row["mean_curve"], curves.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(row["std_curve"], curves.std(axis=0, ddof=1), rtol=1e-12)
        final = curves[:, -1]
        assert row["final_mean"] == pytest.approx(final.mean(), rel=1e-12)
        assert row["final_std"] == pytest.approx(final.std(ddof=1), rel=1e-12)
        gap = row["gap"]
        assert gap["diff"] == pytest.approx(final.mean() - base.mean(), abs=1e-12)
        assert gap["low"] <= gap["diff"] <= gap["high"]
        if name != "baseline":  # independent seeds -> a nonzero spread -> a nonempty interval
            assert gap["low"] < gap["diff"] < gap["high"]
            expected = stats.ttest_ind(final, base, equal_var=False).confidence_interval(0.95)
            assert gap["low"] == pytest.approx(expected.low, rel=1e-9)
            assert gap["high"] == pytest.approx(expected.high, rel=1e-9)
        assert row["gap_percent"]["diff"] == pytest.approx(100 * gap["diff"] / base.mean(), rel=1e-12)
        assert row["within_baseline_spread"] == bool(abs(final.mean() - base.mean()) <= base.std(ddof=1))
        # The paired verdict and the resolvable gap, from the per-seed differences (same seeds).
        diffs = final - base
        low, high = stats.t.interval(0.95, len(diffs) - 1, loc=diffs.mean(), scale=stats.sem(diffs)) \
            if diffs.std() > 0 else (diffs.mean(), diffs.mean())
        assert row["separated"] == bool(not low <= 0.0 <= high)
        assert row["resolvable_percent"] == pytest.approx(100 * (high - low) / 2 / base.mean(), rel=1e-9, abs=1e-12)


@pytest.mark.slow
def test_quick_table_prints_each_variant_and_the_spread_verdict(quick) -> None:
    results, stdout, _ = quick
    for name in QUICK_VARIANTS:
        row = results["summary"][name]
        line = next(l for l in stdout.splitlines() if l.startswith(f"{name} ") and " ± " in l)  # a table row
        assert f"{row['final_mean']:.4f} ± {row['final_std']:.4f}" in line
        assert f"[{row['gap']['low']:+.4f}, {row['gap']['high']:+.4f}]" in line
    where = "within" if results["summary"]["mxfp8"]["within_baseline_spread"] else "outside"
    assert f"mxfp8's mean final loss lies {where} bf16's seed-to-seed spread" in stdout
    mx = results["summary"]["mxfp8"]
    verdict = "separated from" if mx["separated"] else "not separated from"
    assert f"mxfp8        paired gap {mx['paired_gap_percent']['diff']:+.2f}%: {verdict} bf16" in stdout
    assert f"smallest resolvable gap (half-width of the paired 95% interval, seeds {QUICK_SEEDS}): " \
        f"mxfp8 ±{mx['resolvable_percent']:.2f}%" in stdout


@pytest.mark.slow
def test_quick_plot_bands_are_mean_plus_minus_std_of_the_seeds(quick) -> None:
    results, _, _ = quick
    module = _module()
    fig = module.plot(results)
    (ax,) = fig.axes
    steps = np.array(module.eval_steps(results["settings"]))
    bands = ax.collections
    assert len(bands) == len(QUICK_VARIANTS)
    for band, name in zip(bands, QUICK_VARIANTS):
        curves = np.array([r["val"] for r in results["runs"][name]["runs"]])
        mean, std = curves.mean(axis=0), curves.std(axis=0, ddof=1)
        vertices = band.get_paths()[0].vertices
        for step, lo, hi in zip(steps, mean - std, mean + std):
            at_step = vertices[np.isclose(vertices[:, 0], step)][:, 1]
            assert at_step.min() == pytest.approx(lo, rel=1e-9)
            assert at_step.max() == pytest.approx(hi, rel=1e-9)


@pytest.mark.slow
def test_merge_of_parts_equals_the_whole(quick, tmp_path: Path) -> None:
    """Parts split by variant and by seed, merged in any order, give the unsplit runs and summary."""
    results, _, _ = quick
    module = _module()
    paths = []
    for name in QUICK_VARIANTS:
        for run in results["runs"][name]["runs"]:
            settings = {**results["settings"], "seeds": [run["seed"]]}
            path = tmp_path / f"{name}-{run['seed']}.json"
            path.write_text(json.dumps({"settings": settings, "runs": {name: {"status": "ok", "runs": [run]}}}))
            paths.append(path)
    merged = module.merge(paths[::-1])
    assert merged["runs"] == results["runs"]
    assert merged["settings"]["seeds"] == QUICK_SEEDS
    assert module.summarize(merged["runs"]) == results["summary"]
    with pytest.raises(ValueError, match="more than one file"):
        module.merge([paths[0], paths[0]])
    other = json.loads(paths[1].read_text())
    other["settings"]["steps"] += 1
    paths[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="other settings"):
        module.merge(paths)
    one_seed = {name: {"status": "ok", "runs": entry["runs"][:1]} for name, entry in results["runs"].items()}
    with pytest.raises(ValueError, match="2 or more"):
        module.summarize(one_seed)


def test_every_mxfp8_variant_is_a_valid_config() -> None:
    """The variants --quick does not train still name real MXConfig options, each differing
    from the defaults (a typo'd option would be an error, a no-op one would duplicate mxfp8)."""
    from mxcompile.config import MXConfig

    module = _module()
    mx_variants = [v for v in module.VARIANTS if v.backend == "mxfp8"]
    assert {v.name for v in mx_variants} >= {"mxfp8", "mx-noattn", "mx-floor", "mx-e5m2-fwd", "mx-broken"}
    configs = {v.name: MXConfig.from_options(v.options) for v in mx_variants}
    recipes = {(repr(configs[v.name]), v.broken_scales) for v in mx_variants}
    assert len(recipes) == len(configs)
    assert configs["mxfp8"] == MXConfig()


def test_every_fp4_variant_is_its_recipe_with_one_switch_changed() -> None:
    """The FP4 variants are torch.compile options of the nvfp4 / mxfp4 backends: the full
    recipes are the defaults, and each nvfp4 ablation turns exactly one switch of the resolved
    recipe off (so a typo'd or no-op option cannot pass for an ablation), paired against nvfp4."""
    from mxcompile.config import FP4_SWITCHES, MXConfig

    module = _module()
    fp4 = {v.name: v for v in module.VARIANTS if v.backend in ("nvfp4", "mxfp4")}
    assert set(fp4) == {"nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d", "nvfp4-no-hp", "mxfp4",
                        "mxfp4-sr-rht"}
    settings = {name: MXConfig.for_recipe(v.backend, v.options).fp4 for name, v in fp4.items()}
    assert settings["nvfp4"] == MXConfig.for_recipe("nvfp4").fp4
    assert settings["mxfp4"] == MXConfig.for_recipe("mxfp4").fp4
    full = settings["nvfp4"]
    switched_off = {"nvfp4-no-rht": ("rht", False), "nvfp4-no-sr": ("stochastic_rounding", False),
                    "nvfp4-no-2d": ("weight_2d", False), "nvfp4-no-hp": ("high_precision_layers", 0)}
    for name, (switch, off) in switched_off.items():
        assert fp4[name].compare_to == "nvfp4"
        assert getattr(full, switch) != off and getattr(settings[name], switch) == off
        assert all(getattr(settings[name], other) == getattr(full, other) for other in FP4_SWITCHES if other != switch)
    both_on = settings["mxfp4-sr-rht"]
    assert both_on.rht and both_on.stochastic_rounding and not (settings["mxfp4"].rht or settings["mxfp4"].stochastic_rounding)
    assert dataclasses.replace(both_on, rht=False, stochastic_rounding=False) == settings["mxfp4"]
    names = {v.name for v in module.VARIANTS}
    assert all(v.compare_to in names for v in module.VARIANTS if v.compare_to is not None)
    with pytest.raises(ValueError, match="names the variant itself"):
        module.Variant("x", "nvfp4", compare_to="x")


@pytest.mark.slow
def test_quick_nvfp4_trains_through_the_fp4_backend() -> None:
    """A --quick-sized run of the nvfp4 variant (one seed, in process) trains its linear layers'
    GEMMs in NVFP4 with the recipe's switches, as the report of its compiled graph says."""
    import torch

    import mxcompile
    from mxcompile.examples.data import load_corpus, train_val_split
    from mxcompile.report import CONVERTED

    module = _module()
    args = module.parse_args(["--quick", "--precision", "fp32"])
    run = module.run_seed(module.VARIANTS_BY_NAME["nvfp4"], 0, args, *train_val_split(load_corpus(args.texts)))
    report = mxcompile.reports()[-1]
    torch._dynamo.reset()
    assert len(run["val"]) == args.steps // args.eval_every and all(np.isfinite(run["val"]))
    assert report.config["recipe"] == "nvfp4"
    formats = {(d.kind, d.module): [o.elem for o in d.operands] for d in report.decisions if d.decision == CONVERTED}
    assert formats[("weight_grad", "blocks.0.attn.qkv")] == ["nvfp4 sr rht", "nvfp4 rht"]
    assert formats[("output", "blocks.0.attn.qkv")] == ["nvfp4", "nvfp4 2d"]
    # The default high-precision selection at this size: the last of 8 linear layers and the lm_head.
    assert {d.module for d in report.decisions if d.kind == "output" and d.decision != CONVERTED} == \
        {"blocks.1.mlp.proj", "lm_head"}


def test_an_ablation_is_paired_against_its_full_recipe() -> None:
    """`compared`: the ablation's final loss minus the full recipe's on their common seeds, with
    scipy's paired t interval, in percent of the full recipe's mean; "worse" only when the
    interval lies above 0; None when the reference did not run."""
    module = _module()
    final = {"baseline": [2.50, 2.46, 2.53], "nvfp4": [2.52, 2.47, 2.55],
             "nvfp4-no-sr": [2.60, 2.56, 2.62], "nvfp4-no-rht": [2.51, 2.49, 2.54]}
    runs = {name: {"status": "ok", "runs": [{"seed": k, "val": [v], "seconds": 1.0} for k, v in enumerate(vals)]}
            for name, vals in final.items()}
    summary = module.summarize(runs)
    assert summary["nvfp4"]["compared"] is None and summary["baseline"]["compared"] is None
    for name, worse in (("nvfp4-no-sr", True), ("nvfp4-no-rht", False)):
        compared = summary[name]["compared"]
        expected = stats.ttest_rel(final[name], final["nvfp4"]).confidence_interval(0.95)
        assert compared["reference"] == "nvfp4"
        assert compared["paired_gap"]["low"] == pytest.approx(expected.low, rel=1e-12)
        assert compared["paired_gap"]["high"] == pytest.approx(expected.high, rel=1e-12)
        ref_mean = np.mean(final["nvfp4"])
        assert compared["paired_gap_percent"]["diff"] == pytest.approx(
            100 * (np.mean(final[name]) - ref_mean) / ref_mean, rel=1e-12)
        assert compared["worse"] is worse and compared["separated"] is worse
    lines = module.separation_statements(summary, "fp32")
    pct = summary["nvfp4-no-sr"]["compared"]["paired_gap_percent"]
    assert (f"nvfp4-no-sr  vs nvfp4: paired gap {pct['diff']:+.2f}% [{pct['low']:+.2f}, {pct['high']:+.2f}] "
            "of nvfp4: separated (worse) from it") in lines
    assert any(l.startswith("nvfp4-no-rht vs nvfp4: ") and l.endswith("not separated from it") for l in lines)
    without_reference = {name: entry for name, entry in runs.items() if name != "nvfp4"}
    assert module.summarize(without_reference)["nvfp4-no-sr"]["compared"] is None


def test_welch_interval_matches_scipy() -> None:
    module = _module()
    a, b = [2.51, 2.47, 2.55, 2.49], [2.40, 2.46, 2.44]
    got = module.welch_interval(a, b)
    expected = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert got["low"] == pytest.approx(expected.low, rel=1e-12)
    assert got["high"] == pytest.approx(expected.high, rel=1e-12)
    assert got["diff"] == pytest.approx(np.mean(a) - np.mean(b), rel=1e-12)
    assert got["t"] == pytest.approx(stats.t.ppf(0.975, got["df"]), rel=1e-12)
    with pytest.raises(ValueError, match="2 or more"):
        module.welch_interval([1.0], b)


def test_paired_interval_matches_scipy_on_the_common_seeds() -> None:
    module = _module()
    a = {0: 2.51, 1: 2.47, 2: 2.55, 5: 9.0}  # seed 5 has no partner: left out
    b = {0: 2.50, 1: 2.44, 2: 2.56, 3: 2.40}
    got = module.paired_interval(a, b)
    expected = stats.ttest_rel([2.51, 2.47, 2.55], [2.50, 2.44, 2.56]).confidence_interval(0.95)
    assert got["seeds"] == [0, 1, 2]
    assert got["low"] == pytest.approx(expected.low, rel=1e-12)
    assert got["high"] == pytest.approx(expected.high, rel=1e-12)
    assert module.paired_interval({0: 1.0, 1: 2.0}, {1: 2.0, 2: 3.0}) is None


def test_a_repeated_seed_is_refused() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "0", "1", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "give each seed once" in result.stderr


def test_broken_fake_quantize_halves_each_block_scale_and_saturates() -> None:
    """Written from the definition: a block of 32 with amax 1.0 has the rceil scale
    2**ceil(log2(1/448)) = 2**-8; one binade too small it is 2**-9, so the element grid is
    2**-9 times the e4m3 values and everything above 448 * 2**-9 = 0.875 saturates there."""
    conv = _module()
    import torch

    block = torch.zeros(1, 32)
    block[0, :4] = torch.tensor([1.0, -0.9, 0.5, 2.0**-12])
    out = conv.broken_fake_quantize(block, -1, "e4m3", "rceil", 32, torch.float32)
    assert out[0, :4].tolist() == [0.875, -0.875, 0.5, 2.0**-12]
    # A block at E8M0's least scale (all zeros) has no binade below: kept, not NaN (0 * inf).
    zeros = conv.broken_fake_quantize(torch.zeros(2, 32), -1, "e4m3", "rceil", 32, torch.float32)
    assert torch.equal(zeros, torch.zeros(2, 32))
    data, scale = conv.broken_quantize(block, -1, "e4m3", "rceil", 32)
    assert scale.tolist() == [[127 - 9]]
    assert (data.float() * 2.0**-9)[0, :4].tolist() == [0.875, -0.875, 0.5, 2.0**-12]


def test_broken_scales_reach_the_compiled_graph_and_are_undone() -> None:
    """Inside `broken_scales` the mxfp8-compiled linear's output is the GEMM of the broken
    roundings of both operands; after it, the compiled graph rounds correctly again."""
    conv = _module()
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(32, 64) * 3
    compiled = torch.compile(linear, backend="mxfp8", options={"attention": "off"})
    correct = compiled(x).detach()
    with conv.broken_scales():
        broken = compiled(x).detach()
    again = compiled(x).detach()
    rounded = [conv.broken_fake_quantize(t, -1, "e4m3", "rceil", 32, torch.float32) for t in (x, linear.weight)]
    torch.testing.assert_close(broken, rounded[0] @ rounded[1].T, rtol=1e-5, atol=1e-5)
    assert not torch.equal(broken, correct)
    assert torch.equal(again, correct)


def test_a_diverged_variant_is_reported_not_summarized() -> None:
    module = _module()
    runs = {"baseline": {"status": "ok", "runs": [{"seed": k, "val": [2.0 + k / 100], "seconds": 1.0} for k in (0, 1)]},
            "mx-broken": {"status": "ok", "runs": [{"seed": 0, "val": [float("nan")], "seconds": 1.0},
                                                   {"seed": 1, "val": [2.5], "seconds": 1.0}]}}
    summary = module.summarize(runs)
    assert summary["mx-broken"] == {"status": "diverged: non-finite validation loss at seeds [0]"}
    assert summary["baseline"]["status"] == "ok"
