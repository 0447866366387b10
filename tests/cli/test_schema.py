"""The JSON the CLI writes keeps its documented keys (mxcompile/cli/SCHEMA.md), and the HTML
report and plots are well formed, built here from synthetic step profiles (no compilation)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import mxcompile
from mxcompile.cli import plots
from mxcompile.cli.html_report import render_html
from mxcompile.examples import get_example
from mxcompile.profiling import OperatorTime, StepProfile, linear_errors, profile_document

Synthetic = tuple[dict[str, Any], Path, dict[str, str]]
SCHEMA_DOC = Path(mxcompile.__file__).parent / "cli" / "SCHEMA.md"


def test_schema_doc_lists_every_key(schema: SimpleNamespace) -> None:
    documented = set(re.findall(r"`([a-z_0-9]+)`", SCHEMA_DOC.read_text()))
    missing = set().union(*schema.all_key_sets) - documented
    assert not missing, f"keys missing from {SCHEMA_DOC.name}: {sorted(missing)}"


def test_report_json_keys(schema: SimpleNamespace) -> None:
    model, inputs = get_example("mlp")()
    schema.check_report_keys(mxcompile.explain(model, *inputs).to_dict())


def _synthetic_profile(backend: str, scale: float) -> StepProfile:
    return StepProfile(
        backend=backend, autocast_bf16=True, compile_s=10.0 * scale, step_times_s=[0.01 * scale] * 3,
        peak_rss_bytes=int(400e6 * scale), rss_before_step_bytes=int(390e6),
        memory_timeline=[(0.0, 0), (1.0, int(1e5 * scale)), (2.0, 0)],
        operators=[OperatorTime("aten::mm", "GEMM", 100.0 * scale, 4)],
        operator_classes={"GEMM": 100.0 * scale, "Inductor fused kernels": 50.0},
    )


@pytest.fixture(scope="module")
def synthetic_document(tmp_path_factory: pytest.TempPathFactory) -> Synthetic:
    out = tmp_path_factory.mktemp("profile")
    model, inputs = get_example("mlp")()
    config = mxcompile.MXConfig()
    report = mxcompile.explain(model, *inputs, config=config)
    layers = linear_errors(model, inputs, config, report)
    profiles = {"inductor": _synthetic_profile("inductor", 1.0), "mxfp8": _synthetic_profile("mxfp8", 0.8)}
    memory, caption = plots.memory_plot(profiles, out / plots.MEMORY_PLOT)
    files = {"memory": memory.name, "sqnr": plots.sqnr_plot(layers, out / plots.SQNR_PLOT).name,
             "operator_time": plots.operator_plot(profiles, out / plots.OPERATOR_PLOT).name}
    doc = profile_document(target="mlp", steps=3, warmup=1, autocast_bf16=True, config=config, report=report,
                           layers=layers, profiles=profiles, reference="inductor", candidate="mxfp8", plots=files)
    captions = {"memory": caption}
    (out / "report.html").write_text(render_html(doc, captions))
    return doc, out, captions


def test_profile_document_keys(synthetic_document: Synthetic, schema: SimpleNamespace) -> None:
    doc, _, _ = synthetic_document
    schema.check_profile_keys(doc)
    assert doc["comparison"]["median_step_ratio"] == pytest.approx(0.8)


def test_profile_html_and_plots(synthetic_document: Synthetic, schema: SimpleNamespace) -> None:
    doc, out, _ = synthetic_document
    schema.check_html_and_plots(out / "report.html", doc)


def test_memory_plot_falls_back_to_bars(tmp_path: Path) -> None:
    profile = _synthetic_profile("inductor", 1.0)
    profile.memory_timeline = []
    _, caption = plots.memory_plot({"inductor": profile}, tmp_path / "m.png")
    assert "peak resident set per variant" in caption
