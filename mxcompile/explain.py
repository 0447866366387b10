"""`mxcompile.explain`: run the mxfp8 pipeline on a model and return its `Report` without
lowering or training. One source of truth for `mxcompile inspect`, `profile` and the tests."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .backend import compile_graph, memory_model_of
from .config import MXConfig
from .distributed.mx_all_gather import all_gather_decisions
from .lowering import eager_compiler, inductor_compiler
from .report import Report


def explain(model: Callable, *example_inputs: Any, config: MXConfig | None = None, **example_kwargs: Any) -> Report:
    """Trace `model` (an nn.Module or a function of tensors) on `example_inputs` and
    `example_kwargs` (as `model(*example_inputs, **example_kwargs)`, the way HF models are
    called: `explain(model, **batch)`) with the mxfp8 pipeline and return every decision.
    `config` is explain's own keyword, so a model input of that name cannot be given here.

    A memory plan (`config.memory_budget`) is the one `torch.compile(model, backend="mxfp8")`
    makes: it models the step as Inductor runs it (pointwise chains fused), although explain
    itself lowers op by op.

    Runs one forward pass with autograd enabled (the joint graph is built then) and no backward,
    so no gradient of the model is touched; buffers are restored afterwards. For a model
    sharded with `mxcompile.distributed.fully_shard`, `report.all_gather` holds the MXFP8
    all-gather decision of every nn.Linear weight, with its reason.
    """
    config = config if config is not None else MXConfig()
    if not isinstance(config, MXConfig):
        raise ValueError(f"config must be an MXConfig, got {type(config).__name__}")
    report = Report(config.to_dict())
    if isinstance(model, torch.nn.Module):
        report.all_gather.update(all_gather_decisions(model))
    # Lowered op by op (no Inductor compile), planned as `backend="mxfp8"` plans (for Inductor).
    backend = functools.partial(compile_graph, config=config, lower=eager_compiler, report=report,
                                memory_model=memory_model_of(inductor_compiler))
    modules = [model] if isinstance(model, torch.nn.Module) else []
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    compiled = torch.compile(model, backend=backend)
    try:
        with torch.enable_grad():
            compiled(*example_inputs, **example_kwargs)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return report
