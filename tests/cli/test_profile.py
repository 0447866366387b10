"""`mxcompile profile` end to end (two compiles per run): a built-in example and a user file."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

Cli = Callable[..., subprocess.CompletedProcess[str]]

STEPS = "3"  # odd, more than one: the median is one of the listed times, not their only one
WARMUP = "1"


def _profile(cli: Cli, target: str, out: Path, *extra: str) -> dict:
    result = cli("profile", target, "--steps", STEPS, "--warmup", WARMUP, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr
    assert "Training step (forward + backward)" in result.stdout
    assert "Per-layer SQNR" in result.stdout
    return json.loads((out / "report.json").read_text())


def _check_step_times_and_operators(variant: dict) -> None:
    """The summaries are computed from the listed numbers, and the operator table is a
    consistent part of the per-class totals of the same profiled step."""
    times = variant["step_times_s"]
    assert len(times) == int(STEPS), times
    assert variant["median_step_s"] == pytest.approx(statistics.median(times)), variant
    assert variant["min_step_s"] == min(times), variant
    assert variant["peak_tensor_bytes"] == max((b for _, b in variant["memory_timeline"]), default=0), variant
    operators, classes = variant["operators"], variant["operator_classes"]
    assert operators
    self_us = [o["self_cpu_us"] for o in operators]
    assert self_us == sorted(self_us, reverse=True), operators  # the top ones, largest first
    assert all(o["calls"] >= 1 for o in operators), operators
    for op_class in {o["op_class"] for o in operators}:
        listed = sum(o["self_cpu_us"] for o in operators if o["op_class"] == op_class)
        assert listed <= classes[op_class] * (1 + 1e-9), (op_class, listed, classes)


@pytest.mark.slow
def test_profile_builtin_example(cli: Cli, tmp_path: Path, schema: SimpleNamespace) -> None:
    out = tmp_path / "mlp"
    doc = _profile(cli, "mlp", out)
    schema.check_profile_keys(doc)
    schema.check_html_and_plots(out / "report.html", doc)
    for variant in doc["variants"].values():
        _check_step_times_and_operators(variant)
    mx, reference = doc["variants"]["mxfp8"], doc["variants"]["inductor"]
    comparison = doc["comparison"]
    assert comparison["median_step_ratio"] == pytest.approx(mx["median_step_s"] / reference["median_step_s"])
    assert comparison["min_step_ratio"] == pytest.approx(mx["min_step_s"] / reference["min_step_s"])
    assert comparison["peak_tensor_ratio"] == pytest.approx(mx["peak_tensor_bytes"] / reference["peak_tensor_bytes"])
    statuses = {g["status"] for layer in doc["layers"] for g in layer["gemms"]}
    assert "measured" in statuses


@pytest.mark.slow
def test_profile_user_file_fp32_with_config(cli: Cli, user_target: Path, tmp_path: Path,
                                            schema: SimpleNamespace) -> None:
    out = tmp_path / "user"
    doc = _profile(cli, f"{user_target}:make", out, "--fp32", "--config", "hp_weight_grad=true")
    schema.check_profile_keys(doc)
    schema.check_html_and_plots(out / "report.html", doc)
    assert doc["autocast_bf16"] is False
    assert [layer["module"] for layer in doc["layers"]] == ["up", "down"]
    weight_grads = [g for layer in doc["layers"] for g in layer["gemms"] if g["kind"] == "weight_grad"]
    assert {g["status"] for g in weight_grads} == {"kept"}  # hp_weight_grad, as the report says
