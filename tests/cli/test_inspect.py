"""`mxcompile inspect` on a built-in example and on a user's file, through a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from rich.console import Console

from mxcompile.cli.kernels import NO_KERNELS_ON_CPU
from mxcompile.cli.main import main
from mxcompile.cli.views import graph_code

Cli = Callable[..., subprocess.CompletedProcess[str]]


def test_builtin_example_shows_graphs_decisions_totals_and_kernels(cli: Cli) -> None:
    result = cli("inspect", "mlp", "--kernels")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for heading in ("forward graph — before the rewrite", "forward graph — after the rewrite",
                    "backward graph — before the rewrite", "backward graph — after the rewrite",
                    "GEMM and attention decisions", "Totals"):
        assert heading in out
    assert "│ ❱" in out and "lines with mxcompile ops (❱)" in out
    assert "layers.1.linear" in out and "weight_grad" in out
    assert "8 of 8" in out  # GEMMs converted
    assert "no memory budget set" in out
    assert " ".join(NO_KERNELS_ON_CPU.split()[:6]) in " ".join(out.split())


def test_user_file_backward_graph_only_with_config(cli: Cli, user_target: Path) -> None:
    result = cli("inspect", f"{user_target}:make", "--graph", "backward", "--config", "exclude=down")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backward graph — after the rewrite" in out
    assert "forward graph" not in out
    assert "exclude=('down',)" in out
    assert "matches exclude pattern" in out  # the reason recorded by the pass, shown as is
    assert "kept" in out
    assert "no memory budget set" in out


def test_json_is_the_report_only(user_target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", f"{user_target}:make", "--json"]) == 0  # in-process: saves a start-up
    data = json.loads(capsys.readouterr().out)  # nothing but JSON on stdout
    assert data["schema_version"] == 1
    modules = {d["module"] for d in data["decisions"]}
    assert modules == {"up", "down"}
    assert data["totals"]["gemms"] == len(data["decisions"])


def test_marks_only_lines_with_mx_ops() -> None:
    code = 'x = torch.ops.aten.mm.default(a, b)\ny = torch.ops.mxcompile.quantize.default(x, 1)\n'
    console = Console(width=200, record=True)
    console.print(graph_code(code, "after", mark=True))
    lines = [line for line in console.export_text().splitlines() if line.startswith("│ ❱")]
    assert len(lines) == 1 and "torch.ops.mxcompile.quantize" in lines[0]
