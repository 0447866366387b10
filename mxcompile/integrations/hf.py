"""Hugging Face `Trainer` with the mxfp8 backend, or an FP4 recipe's (nvfp4, mxfp4).

`TrainingArguments(torch_compile=True, torch_compile_backend="mxfp8")` does not work: the
Trainer hands the backend name to accelerate, which accepts only the names of its own
`DynamoBackend` list and raises "'MXFP8' is not a valid DynamoBackend" before any graph is
compiled. The way that works is to compile the model before the Trainer sees it:

    from mxcompile.integrations.hf import MXReportCallback, compile_model

    trainer = Trainer(model=compile_model(model, args), args=args, train_dataset=...,
                      callbacks=[MXReportCallback()])

For an FP4 recipe, pass its config: `compile_model(model, args, config=MXConfig.for_recipe("nvfp4"))`.

`compile_model` compiles the model in place with the mxfp8 backend, so that the Trainer still
sees the model's own class and forward signature (and it refuses arguments that would make the
Trainer compile again); `MXReportCallback` puts the share of GEMM FLOPs that ran in MX formats
(MXFP8, or the recipe's NVFP4 / MXFP4) into the Trainer's log history and says at the end of
training in which formats, and what was kept in high precision.
Nothing here patches transformers or accelerate.
"""

from __future__ import annotations

import collections
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..backend import configured_backend, end_measured_step, report_of, step_coverage_of
from ..config import MXConfig
from ..coverage import warn_uncompiled
from ..report import converted_phrase

logger = logging.getLogger(__name__)

# The keys MXReportCallback adds to each log entry.
FLOP_FRACTION_KEY = "mx_gemm_flop_fraction"
STEP_FLOP_FRACTION_KEY = "mx_step_flop_fraction"  # measured at run time: eager GEMMs included
GRAPHS_KEY = "mx_graphs"
KEPT_REASONS_SHOWN = 3


def compile_model(
    model: torch.nn.Module, args: TrainingArguments | None = None, config: MXConfig | None = None,
    **torch_compile_kwargs: Any,
) -> torch.nn.Module:
    """Compiles `model` in place with the mxfp8 backend (`Module.compile`) and returns it, to
    pass as `Trainer(model=...)`.

    In place rather than `torch.compile(model)`: the Trainer reads the model's class and its
    forward's signature, and the wrapper torch.compile returns has neither. Its forward takes
    `(*args, **kwargs)`, so with the default `remove_unused_columns=True` the Trainer drops every
    column of the batch ("The batch received was empty"), and it finds no label names, so
    evaluation reports no loss. An HF model's forward is transformers code, which dynamo traces
    from `Module.compile` as from `torch.compile`; layers it would not trace are warned about.

    `args`, when given, are the TrainingArguments the Trainer will get: with `torch_compile=True`
    the Trainer would compile again through accelerate, which refuses the mxfp8 backend, so
    that is an error here, named before the Trainer starts. `config` is the MXConfig (default
    `MXConfig()`: mxfp8; `MXConfig.for_recipe("nvfp4", options)` for the NVFP4 recipe, as
    `backend="nvfp4"` makes it); `torch_compile_kwargs` go to `Module.compile` (e.g. `dynamic=True`)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile_model takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, OptimizedModule) or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError("the model is already compiled: pass the uncompiled module to compile_model (a "
                         "torch.compile wrapper hides the model's forward signature and labels from the Trainer)")
    if args is not None and args.torch_compile:
        raise ValueError(
            f"TrainingArguments(torch_compile=True, torch_compile_backend={args.torch_compile_backend!r}) "
            "make the Trainer compile the model again through accelerate, which accepts only its own "
            "backend names (\"'MXFP8' is not a valid DynamoBackend\"): set torch_compile=False; "
            "compile_model compiles the model with the backend of its config (mxfp8, nvfp4 or mxfp4)")
    backend = configured_backend(config, torch_compile_kwargs, "compile_model")
    model.compile(backend=backend, **torch_compile_kwargs)
    warn_uncompiled(model)
    return model


@dataclass(frozen=True)
class MXShare:
    """What ran in MX formats for one model, over the retained reports of its compiled graphs
    (`mxcompile.report_of`): one report per graph, recompiles (new shapes, eval) included."""

    graphs: int
    gemms: int
    converted_gemms: int
    gemm_flops: int
    converted_flops: int
    kept_reasons: tuple[str, ...]  # the reasons that kept the most GEMM FLOPs, most first
    # The share of all GEMM FLOPs in MX of the first training step after compiling, measured at run time (eager
    # GEMMs outside every compiled graph included); None until that step has ended.
    step_flop_fraction: float | None = None
    # Converted GEMMs per format family (`Report.converted_by_format`: "mxfp8", "nvfp4", "mxfp4"), most first.
    formats: dict[str, int] = field(default_factory=dict)

    @property
    def converted_flop_fraction(self) -> float:
        return self.converted_flops / self.gemm_flops if self.gemm_flops else 0.0

    def summary(self) -> str:
        """One line, e.g. '2 graphs: 30 of 32 GEMMs in MXFP8, 99.1% of GEMM FLOPs; the step
        (run time): 99.1% of its GEMM FLOPs in MX; kept: ...', or with several formats
        '1 graph(s): 24 of 38 GEMMs converted (NVFP4 24), ...'."""
        converted = converted_phrase(self.converted_gemms, self.gemms, self.formats)
        line = f"{self.graphs} graph(s): {converted}, {self.converted_flop_fraction:.1%} of GEMM FLOPs"
        if self.step_flop_fraction is not None:
            line += f"; the step (run time): {self.step_flop_fraction:.1%} of all its GEMM FLOPs in MX"
        return line + (f"; kept: {'; '.join(self.kept_reasons)}" if self.kept_reasons else "")


def mx_share(model: torch.nn.Module) -> MXShare:
    """The MX share of `model`'s compiled graphs (the module, or what torch.compile returned
    for it)."""
    reports = report_of(model)
    flops_by_reason: dict[str, int] = {}
    for report in reports:
        for reason, flops, _ in report.kept_flops_by_reason():
            flops_by_reason[reason] = flops_by_reason.get(reason, 0) + flops
    reasons = sorted(flops_by_reason, key=lambda r: -flops_by_reason[r])[:KEPT_REASONS_SHOWN]
    formats: collections.Counter[str] = collections.Counter()
    for report in reports:
        formats.update(report.converted_by_format())
    coverage = step_coverage_of(model)
    return MXShare(
        graphs=len(reports),
        gemms=sum(r.totals()["gemms"] for r in reports),
        converted_gemms=sum(r.totals()["converted"] for r in reports),
        gemm_flops=sum(r.gemm_flops_total for r in reports),
        converted_flops=sum(r.gemm_flops_converted for r in reports),
        kept_reasons=tuple(reasons),
        step_flop_fraction=coverage.mx_flop_fraction if coverage is not None else None,
        formats=dict(formats.most_common()),
    )


class MXReportCallback(TrainerCallback):
    """Records what ran in MX formats (MXFP8, or an FP4 recipe's NVFP4 / MXFP4) in the Trainer's logs.

    At each log step it adds `mx_gemm_flop_fraction` (GEMM FLOPs converted over all GEMM FLOPs
    of the model's compiled graphs), `mx_step_flop_fraction` (the first training step after compiling: its GEMM
    FLOPs in MX over all of them, eager GEMMs outside the compiled graphs included, measured at
    run time; from the first log after that step) and `mx_graphs` (how many graphs were compiled) to the log
    entry in `trainer.state.log_history` (saved with checkpoints in trainer_state.json) and to
    the logs the callbacks after this one see: the Trainer's progress bar or printer (added
    after user callbacks) shows them; the reporters of `report_to` (TensorBoard, W&B, ...) run
    before user callbacks and do not get them (transformers 5.25).
    At the end of training it logs one summary line (logger `mxcompile.integrations.hf`) and
    warns when no graph of the model was compiled by mxcompile: then the model was not compiled
    with an mxcompile backend, and nothing ran in MX. At the end of every step it closes the
    first-step measurement (`measure_first_step`) if that step has ended and it is still open:
    outside compiled code, where stopping the profiler is safe (`mxcompile.backend.end_measured_step`)."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        end_measured_step()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        logs: dict[str, float] | None = None, model: torch.nn.Module | None = None, **kwargs: Any,
    ) -> None:
        if model is None or logs is None:
            return
        share = mx_share(model)
        values = {FLOP_FRACTION_KEY: share.converted_flop_fraction, GRAPHS_KEY: share.graphs}
        if share.step_flop_fraction is not None:
            values[STEP_FLOP_FRACTION_KEY] = share.step_flop_fraction
        logs.update(values)
        # Trainer.log appended a copy of these logs (with the step) just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        model: torch.nn.Module | None = None, **kwargs: Any,
    ) -> None:
        if model is None:
            return
        share = mx_share(model)
        if share.graphs == 0:
            warnings.warn("mxcompile compiled no graph of this model: it was not compiled with an mxcompile backend "
                          "(mxfp8, nvfp4, mxfp4), and no GEMM ran in MX; pass Trainer(model=mxcompile.integrations.hf.compile_model("
                          "model, args))", UserWarning, stacklevel=2)
            return
        logger.info("mxcompile: %s", share.summary())
