"""The profile document: report.json of `mxcompile profile` (schema: mxcompile/cli/SCHEMA.md)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Sequence

import torch

from ..config import MXConfig
from ..report import Report
from .layer_error import LayerError
from .step_profile import StepProfile

PROFILE_SCHEMA_VERSION = 1


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare_steps(reference: StepProfile, candidate: StepProfile) -> dict[str, float | None]:
    """candidate / reference for step time and the memory measures (None where unmeasured)."""
    return {
        "median_step_ratio": _ratio(candidate.median_step_s, reference.median_step_s),
        "min_step_ratio": _ratio(candidate.min_step_s, reference.min_step_s),
        "peak_rss_ratio": _ratio(candidate.peak_rss_bytes, reference.peak_rss_bytes),
        "peak_step_increase_ratio": _ratio(candidate.peak_step_increase_bytes, reference.peak_step_increase_bytes),
        "peak_tensor_ratio": _ratio(candidate.peak_tensor_bytes, reference.peak_tensor_bytes),
    }


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (strict JSON has no inf or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def profile_document(
    *,
    target: str,
    steps: int,
    warmup: int,
    autocast_bf16: bool,
    config: MXConfig,
    report: Report,
    layers: Sequence[LayerError],
    profiles: dict[str, StepProfile],
    reference: str,
    candidate: str,
    plots: dict[str, str],
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The JSON document of a profile run (schema: mxcompile/cli/SCHEMA.md, version
    `PROFILE_SCHEMA_VERSION`)."""
    rewrite = report.to_dict()
    rewrite.pop("graphs")
    return json_safe({
        "schema_version": PROFILE_SCHEMA_VERSION,
        "target": target,
        "steps": steps,
        "warmup": warmup,
        "autocast_bf16": autocast_bf16,
        "torch_version": torch.__version__,
        "config": config.to_dict(),
        "variants": {name: profile.to_dict() for name, profile in profiles.items()},
        "comparison": {"reference": reference, "candidate": candidate,
                       **compare_steps(profiles[reference], profiles[candidate])},
        "layers": [asdict(layer) for layer in layers],
        "rewrite": rewrite,
        "plots": dict(plots),
        "notes": list(notes),
    })
