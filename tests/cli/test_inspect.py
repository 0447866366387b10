"""`mxcompile inspect` on a built-in example and on a user's file, through a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
from rich.console import Console

from mxcompile.cli.kernels import NO_KERNELS_ON_CPU
from mxcompile.cli.main import main
from mxcompile.cli.views import FORMATS_COLUMN, decisions_table, graph_code
from mxcompile.config import MXConfig
from mxcompile.report import CONVERTED, GemmDecision, OperandQuantization, Report

Cli = Callable[..., subprocess.CompletedProcess[str]]
WIDE = "400"  # console columns for tests that read whole table cells


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
    assert data["schema_version"] == 2
    modules = {d["module"] for d in data["decisions"]}
    assert modules == {"up", "down"}
    assert data["totals"]["gemms"] == len(data["decisions"])


def test_marks_only_lines_with_mx_ops() -> None:
    code = 'x = torch.ops.aten.mm.default(a, b)\ny = torch.ops.mxcompile.quantize.default(x, 1)\n'
    console = Console(width=200, record=True)
    console.print(graph_code(code, "after", mark=True))
    lines = [line for line in console.export_text().splitlines() if line.startswith("│ ❱")]
    assert len(lines) == 1 and "torch.ops.mxcompile.quantize" in lines[0]


def test_nvfp4_backend_shows_the_recipe_formats_and_the_kept_layers(
    user_target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--backend nvfp4`: the recipe's resolved switches, each GEMM's format (decision column)
    and its operands' formats, and the layer the recipe keeps with its reason."""
    monkeypatch.setenv("COLUMNS", WIDE)  # no cell wraps
    args = ["inspect", f"{user_target}:make", "--backend", "nvfp4", "--graph", "none",
            "--config", "high_precision_layers=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "backend='nvfp4'" in out and "attention='off'" in out
    assert ("nvfp4 recipe: nvfp4 GEMMs, rht=True, stochastic_rounding=True, weight_2d=True, "
            "high_precision_layers=1, seed=0") in out
    formats = _formats_cells(out)
    assert formats["output"] == ["nvfp4 e2m1/16/E4M3", "nvfp4 e2m1/16/E4M3, 2-D 16x16"]  # X, W
    assert formats["weight_grad"] == ["nvfp4 e2m1/16/E4M3, stochastic, RHT", "nvfp4 e2m1/16/E4M3, RHT"]  # dYt, X
    assert "Kept in high precision under the nvfp4 recipe" in out
    assert "the last 1 of 2 linear layers stay in high precision" in out
    assert "2 of 5 (3 kept): nvfp4 2" in out  # up's output and weight-gradient GEMMs; down's three kept


def _formats_cells(out: str) -> dict[str, list[str]]:
    """The operand formats cell of each converted GEMM of the decisions table, by kind (one
    converted GEMM per kind in these tests): its lines, lhs first."""
    cells: dict[str, list[str]] = {}
    kind = None
    for line in out.splitlines():
        cols = [c.strip() for c in line.split("│")[1:-1]]
        if len(cols) != 9:  # not a row of the decisions table
            continue
        if cols[2]:
            kind = cols[2] if cols[6] not in ("kept", "") else None
        if kind is not None and cols[7]:
            cells.setdefault(kind, []).append(cols[7])
    return cells


def test_mxfp4_json_carries_each_operands_format(user_target: Path, schema: SimpleNamespace,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", f"{user_target}:make", "--backend", "mxfp4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    schema.check_report_keys(data)
    assert data["config"]["recipe"] == "mxfp4" and data["config"]["attention"] == "off"
    assert data["totals"]["converted_by_format"] == {"mxfp4": 5}  # up has no input-gradient GEMM
    for decision in data["decisions"]:
        assert decision["decision"] == "mxfp8" and decision["format"] == "mxfp4"  # converted, to MXFP4
        for operand in decision["operands"]:
            assert {k: operand[k] for k in ("format", "element", "block_size", "scale", "tensor_scale", "block_2d",
                                             "stochastic", "rht")} == {
                "format": "mxfp4", "element": "e2m1", "block_size": 32, "scale": "e8m0", "tensor_scale": False,
                "block_2d": False, "stochastic": False, "rht": False}


def test_backend_and_a_contradicting_recipe_are_refused(user_target: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", f"{user_target}:make", "--backend", "nvfp4", "--config", "recipe=mxfp4"]) == 2
    err = capsys.readouterr().err
    assert "recipe='mxfp4' contradicts the backend's recipe 'nvfp4'" in err, err


def test_formats_column_only_where_formats_differ() -> None:
    """A report whose operands all share one format (plain MXFP8) shows no operand-formats
    column; e5m2 gradients beside e4m3 activations do."""
    def rendered(config: MXConfig) -> str:
        operands = tuple(OperandQuantization.of(n, (32, 32), 1, config.mx_operand_format(elem))
                         for n, elem in (("dy", config.grad_elem), ("w", config.forward_elem)))
        decision = GemmDecision("backward", "mm", "aten.mm.default", "input_grad", ((32, 32), (32, 32)), 1, "m",
                                CONVERTED, "why", operands)
        console = Console(width=int(WIDE), record=True)
        console.print(decisions_table(Report(config.to_dict(), [decision])))
        return console.export_text()

    assert FORMATS_COLUMN not in rendered(MXConfig())
    mixed = rendered(MXConfig(grad_elem="e5m2"))
    assert FORMATS_COLUMN in mixed and "mxfp8 e5m2/32/E8M0" in mixed and "mxfp8 e4m3/32/E8M0" in mixed
