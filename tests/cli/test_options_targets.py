"""In-process units of the CLI: --config parsing, target resolution, formatting, views."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from mxcompile.cli.errors import CLIError
from mxcompile.cli.formatting import format_bytes, format_change, format_flops, format_shapes
from mxcompile.cli.options import changed_settings, config_from_overrides, parse_overrides, parse_value
from mxcompile.cli.targets import load_target
from mxcompile.cli.views import marked_lines, memory_plan_view
from mxcompile.report import Report
from mxcompile.planner.budget import MemoryBudget


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("False", False), ("none", None), ("32", 32), ("0.5", 0.5),
     ("('a', 'b')", ("a", "b")), ("6GiB", "6GiB"), ("lm_head", "lm_head")],
)
def test_parse_value(text: str, value: object) -> None:
    assert parse_value(text) == value


def test_config_from_overrides() -> None:
    config = config_from_overrides(["hp_weight_grad=true", "exclude=lm_head", "memory_budget=6GiB"])
    assert config.hp_weight_grad is True
    assert config.exclude == ("lm_head",)
    assert config.memory_budget == MemoryBudget.of_bytes(6 * 2**30)
    assert set(changed_settings(config)) == {"hp_weight_grad", "exclude", "memory_budget"}


def test_load_file_target(user_target: Path) -> None:
    target = load_target(f"{user_target}:make")
    assert type(target.model).__name__ == "TwoLayer"
    assert isinstance(target.inputs, tuple) and target.inputs[0].shape == (32, 32)


def test_load_module_target() -> None:
    target = load_target("mxcompile.examples:mlp_factory")
    assert type(target.model).__name__ == "MLP"


def test_load_builtin_example() -> None:
    assert type(load_target("gpt").model).__name__ == "GPT"


def test_error_is_cli_error(user_target: Path) -> None:
    with pytest.raises(CLIError) as info:
        load_target(f"{user_target}:broken")
    assert info.value.exit_code == 2


def test_formatting() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    assert format_flops(2_100_000) == "2.1 MFLOP"
    assert format_change(100, 63) == "-37.0%"
    assert format_shapes(((128, 64), (64, 192))) == "128x64 @ 64x192"


def test_marked_lines_only_mx_ops() -> None:
    code = "# File: /x/mxcompile/examples/mlp.py\nq = torch.ops.mxcompile.quantize.default(x)\ny = x\n"
    assert marked_lines(code) == {2}


def _render(renderable: object) -> str:
    console = Console(width=120, record=True)
    console.print(renderable)
    return console.export_text()


def test_memory_plan_views() -> None:
    assert "no memory budget set" in _render(memory_plan_view(Report(config={"memory_budget": None})))
    plan = {"budget_bytes": 2048, "step_time_s": 2e-5, "offloaded": ["a", "b"], "tags": {"must_save": 4},
            "tensors": [{"name": "mm", "bytes": 4096, "decision": "recompute"}]}
    plan["graphs"] = [dict(plan)]  # one graph: the same record nested, shown once
    text = _render(memory_plan_view(Report(config={"memory_budget": "1000B"}, memory_plan=plan)))
    assert "2.0 KiB" in text and "20 µs" in text and "a, b" in text and "must_save=4" in text
    assert "Memory plan: tensors" in text and "recompute" in text and "4.0 KiB" in text
    assert "graphs[0]" not in text


def test_tuple_and_string_fields_keep_strings() -> None:
    options = parse_overrides(["exclude=2", "exclude=lm_head", "include=('a', 'b')", "forward_elem=e5m2"])
    assert options == {"exclude": ("2", "lm_head"), "include": ("a", "b"), "forward_elem": "e5m2"}
