"""Helpers for the CLI tests: run `python -m mxcompile` in a subprocess, write user targets,
check the JSON keys against SCHEMA.md, check report.html and its PNGs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from PIL import Image

SUBPROCESS_TIMEOUT_S = 600
CLI_COLUMNS = "140"

# A user-style target file: its own model class and factory, nothing from mxcompile.examples.
USER_TARGET_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class TwoLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(32, 64)
            self.down = nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))


    def make():
        torch.manual_seed(0)
        return TwoLayer(), (torch.randn(32, 32),)


    def broken():
        raise RuntimeError("the weights file is missing")


    def not_a_pair():
        return TwoLayer()


    def tensor_inputs():
        return TwoLayer(), torch.randn(32, 32)


    NOT_CALLABLE = 3
    """
)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = SUBPROCESS_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`python -m mxcompile ARGS` with output captured as text."""
    env = {**os.environ, "COLUMNS": CLI_COLUMNS}
    return subprocess.run([sys.executable, "-m", "mxcompile", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_cli` as a fixture."""
    return run_cli


@pytest.fixture
def user_target(tmp_path: Path) -> Path:
    """A user's factory file (`make` is the good factory) in a fresh directory."""
    path = tmp_path / "my_model.py"
    path.write_text(USER_TARGET_SOURCE)
    return path


# ---- The documented JSON keys (mxcompile/cli/SCHEMA.md) ----------------------------------

REPORT_KEYS = {"schema_version", "config", "totals", "decisions", "passes", "saved_tensors", "graphs",
               "memory_plan", "fallbacks", "all_gather", "step_coverage"}
TOTALS_KEYS = {"gemms", "converted", "kept", "gemm_flops", "gemm_flops_converted", "converted_flop_fraction",
               "converted_by_format", "saved_activation_bytes_before", "saved_activation_bytes_after", "saved_quantized_by_format",
               "step_mx_flop_fraction"}
STEP_COVERAGE_KEYS = {"mx_flop_fraction", "mx_flops", "compiled_flops", "eager_flops", "eager_gemms",
                      "eager_modules", "graph_breaks", "graph_calls", "measure_seconds"}
DECISION_KEYS = {"graph", "node", "op", "kind", "shapes", "flops", "module", "decision", "format", "reason",
                 "operands"}
OPERAND_KEYS = {"name", "shape", "axis", "elem", "format", "element", "block_size", "scale", "tensor_scale",
                "block_2d", "stochastic", "rht"}
PASS_KEYS = {"name", "graph", "nodes_added", "nodes_removed"}
SAVED_KEYS = {"name", "dtype", "shape", "bytes"}
GRAPH_KEYS = {"name", "before", "after"}

PROFILE_KEYS = {"schema_version", "target", "steps", "warmup", "autocast_bf16", "torch_version", "config",
                "variants", "comparison", "layers", "rewrite", "plots", "notes"}
VARIANT_KEYS = {"backend", "autocast_bf16", "compile_s", "step_times_s", "median_step_s", "min_step_s",
                "peak_rss_bytes", "rss_before_step_bytes", "peak_step_increase_bytes", "peak_tensor_bytes",
                "memory_timeline", "operators", "operator_classes", "notes", "load_average", "cpu_count",
                "step_coverage"}
OPERATOR_KEYS = {"name", "op_class", "self_cpu_us", "calls"}
COMPARISON_KEYS = {"reference", "candidate", "median_step_ratio", "min_step_ratio", "peak_rss_ratio",
                   "peak_step_increase_ratio", "peak_tensor_ratio"}
LAYER_KEYS = {"module", "m", "k", "n", "calls", "gemms"}
GEMM_KEYS = {"kind", "status", "sqnr_db", "note", "operands"}
BLOCK_KEYS = {"role", "axis_name", "elem", "blocks", "saturated_block_fraction", "flushed_fraction",
              "min_scale_exponent", "max_scale_exponent"}
PLOT_KEYS = {"memory", "sqnr", "operator_time"}

ALL_KEY_SETS = (REPORT_KEYS, TOTALS_KEYS, DECISION_KEYS, OPERAND_KEYS, PASS_KEYS, SAVED_KEYS, GRAPH_KEYS,
                PROFILE_KEYS, VARIANT_KEYS, OPERATOR_KEYS, COMPARISON_KEYS, LAYER_KEYS, GEMM_KEYS, BLOCK_KEYS,
                PLOT_KEYS, STEP_COVERAGE_KEYS)


def check_report_keys(data: dict[str, Any]) -> None:
    """The inspect --json document has exactly the documented keys."""
    assert set(data) == REPORT_KEYS
    assert set(data["totals"]) == TOTALS_KEYS
    assert data["decisions"], "expected at least one decision"
    for decision in data["decisions"]:
        assert set(decision) == DECISION_KEYS
        for operand in decision["operands"]:
            assert set(operand) == OPERAND_KEYS
    for section, keys in (("passes", PASS_KEYS), ("saved_tensors", SAVED_KEYS), ("graphs", GRAPH_KEYS)):
        for row in data[section]:
            assert set(row) == keys


def check_profile_keys(data: dict[str, Any]) -> None:
    """The profile report.json has exactly the documented keys."""
    assert set(data) == PROFILE_KEYS
    assert set(data["variants"]) == {"inductor", "mxfp8"}
    for variant in data["variants"].values():
        assert set(variant) == VARIANT_KEYS
        for operator in variant["operators"]:
            assert set(operator) == OPERATOR_KEYS
    assert set(data["comparison"]) == COMPARISON_KEYS
    assert set(data["plots"]) == PLOT_KEYS
    for layer in data["layers"]:
        assert set(layer) == LAYER_KEYS
        for gemm in layer["gemms"]:
            assert set(gemm) == GEMM_KEYS
            for block in gemm["operands"]:
                assert set(block) == BLOCK_KEYS
    assert set(data["rewrite"]) == REPORT_KEYS - {"graphs"}


# ---- report.html and its PNGs -------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOID_ELEMENTS = {"meta", "img", "br", "hr", "link", "input"}


class _Collector(HTMLParser):
    """Collects <img src>, checks that every non-void element is closed in order."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.stack: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.images.append(values["src"] or "")
        if tag in ("script", "link"):
            self.external.append(tag)
        if tag not in VOID_ELEMENTS:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def check_html_and_plots(html_path: Path, document: dict[str, Any]) -> None:
    parser = _Collector()
    parser.feed(html_path.read_text())
    parser.close()
    assert not parser.stack, f"unclosed elements: {parser.stack}"
    assert not parser.external, "the report must be self-contained"
    assert sorted(parser.images) == sorted(document["plots"].values())
    for name in parser.images:
        path = html_path.parent / name
        assert path.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


@pytest.fixture
def schema() -> SimpleNamespace:
    """The key sets and checkers of the CLI's JSON, HTML and PNG output."""
    return SimpleNamespace(
        check_report_keys=check_report_keys, check_profile_keys=check_profile_keys,
        check_html_and_plots=check_html_and_plots, all_key_sets=ALL_KEY_SETS,
    )
