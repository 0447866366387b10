"""torch's compile caches and the mxfp8 backend: a second process with the same model and
MXConfig is served by the AOTAutograd and FX graph caches, gives bit-identical results and the
same report; a changed MXConfig field misses. Three fresh processes (one cold compile each of
two configs, one warm load) on a tiny MLP."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxcompile.passes as passes
from mxcompile.compile_cache import cache_tag
from mxcompile.config import MXConfig
from mxcompile.planner.budget import MemoryBudget
from mxcompile.report import CONVERTED

CHILD = Path(__file__).with_name("cache_child.py")
CHILD_TIMEOUT_S = 900


def _run(cache_dir: Path, options: dict, out: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    for name in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(CHILD), json.dumps(options), str(out)], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "tensors": torch.load(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile-cache")
    cache = root / "inductor"
    return {
        "cold": _run(cache, {}, root / "cold.pt"),
        "warm": _run(cache, {}, root / "warm.pt"),
        "floor": _run(cache, {"scale_mode": "floor"}, root / "floor.pt"),
    }


def test_second_process_is_served_by_the_aot_autograd_and_fx_graph_caches(runs):
    cold, warm = runs["cold"]["counters"], runs["warm"]["counters"]
    assert cold.get("aot_autograd.autograd_cache_miss", 0) >= 1 and not cold.get("aot_autograd.autograd_cache_hit")
    assert warm.get("aot_autograd.autograd_cache_hit", 0) >= 1, warm
    assert not warm.get("aot_autograd.autograd_cache_miss") and not warm.get("aot_autograd.autograd_cache_bypass"), warm
    assert warm.get("inductor.fxgraph_cache_hit", 0) >= 1 and not warm.get("inductor.fxgraph_cache_miss"), warm


def test_cached_graph_gives_bit_identical_results(runs):
    cold, warm = runs["cold"]["tensors"], runs["warm"]["tensors"]
    assert cold.keys() == warm.keys()
    for name in cold:
        assert torch.equal(cold[name], warm[name]), name


def test_cached_graph_keeps_its_report(runs):
    cold, warm = runs["cold"], runs["warm"]
    assert any(decision == CONVERTED for _, decision, _ in cold["decisions"]), cold["decisions"]
    assert warm["decisions"] == cold["decisions"] and warm["summary"] == cold["summary"]


def test_changed_config_field_misses(runs):
    floor = runs["floor"]["counters"]
    assert floor.get("aot_autograd.autograd_cache_miss", 0) >= 1 and not floor.get("aot_autograd.autograd_cache_hit"), floor
    # the config did change the numerics: a stale entry would have returned the rceil results
    assert not torch.equal(runs["floor"]["tensors"]["y"], runs["cold"]["tensors"]["y"])


CHANGED_FIELDS = {
    "forward_elem": "e5m2", "grad_elem": "e5m2", "scale_mode": "floor", "block_size": 16,
    "hp_weight_grad": True, "include": ("fc1",), "exclude": ("fc1",), "min_gemm_flops": 1,
    "attention": "off", "memory_budget": MemoryBudget.parse(0.5), "offload": True,
    "fsdp_all_gather": "mxfp8", "fallback": False, "gemm_kernel": "dequantized", "smooth_swiglu": True,
    # issue 48's recipe fields (on mxfp8 the FP4 switches accept their "off" values only)
    "recipe": "nvfp4", "rht": False, "stochastic_rounding": False, "weight_2d": False,
    "high_precision_layers": 0, "seed": 1,
    "measure_first_step": False, "attention_chunking": "least_memory",
}


def test_every_config_field_changes_the_cache_tag():
    assert set(CHANGED_FIELDS) == {f.name for f in dataclasses.fields(MXConfig)}, "a new MXConfig field needs a case here"
    base = cache_tag(MXConfig())
    assert cache_tag(MXConfig()) == base
    for name, value in CHANGED_FIELDS.items():
        assert cache_tag(MXConfig().replace(**{name: value})) != base, name


def _replacement_pass(gm, config, graph_name):
    raise AssertionError("never run: only its name enters the tag")


def test_a_replaced_pass_changes_the_cache_tag(monkeypatch):
    base = cache_tag(MXConfig())
    monkeypatch.setattr(passes, "PIPELINE", (("gemm_rewrite", _replacement_pass),))
    assert cache_tag(MXConfig()) != base
