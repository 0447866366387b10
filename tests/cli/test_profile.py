"""`mxcompile profile` end to end (two compiles per run): a built-in example and a user file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

Cli = Callable[..., subprocess.CompletedProcess[str]]

STEPS = "1"
WARMUP = "1"


def _profile(cli: Cli, target: str, out: Path, *extra: str) -> dict:
    result = cli("profile", target, "--steps", STEPS, "--warmup", WARMUP, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr
    assert "Training step (forward + backward)" in result.stdout
    assert "Per-layer SQNR" in result.stdout
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_profile_builtin_example(cli: Cli, tmp_path: Path, schema: SimpleNamespace) -> None:
    out = tmp_path / "mlp"
    doc = _profile(cli, "mlp", out)
    schema.check_profile_keys(doc)
    schema.check_html_and_plots(out / "report.html", doc)
    for variant in doc["variants"].values():
        assert len(variant["step_times_s"]) == int(STEPS)
        assert variant["median_step_s"] > 0
        assert variant["operators"]
    assert doc["comparison"]["median_step_ratio"] > 0
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
