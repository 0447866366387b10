"""Tensor parallelism for any model with the `mxfp8` backend: `tensor_parallel_plan` expands
name patterns into torch's plan, `parallelize_module` (named after torch's) applies it and
returns the weights whose shards cut MX blocks along a contraction axis.

Nothing else is needed for the backend: AOTAutograd desugars DTensor into local tensors plus
`_c10d_functional` collectives, so the GEMM pass sees the local GEMMs, and the backend keeps
in high precision (with the reason in the report) every GEMM whose local contraction axis is
not made of whole global blocks. Compile the parallelized model with
`torch.compile(model, backend="mxfp8")` as on one process.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from torch import nn

from ..config import MXConfig
from .layouts import ShardingProblem, sharded_contraction_problems

__all__ = ["parallelize_module", "tensor_parallel_plan"]


def tensor_parallel_plan(model: nn.Module, styles: Mapping[str, Any]) -> dict[str, Any]:
    """torch's plan ({module name: ParallelStyle}) for every nn.Linear of `model` whose name
    matches a pattern of `styles` (fnmatch: `"layers.*.self_attn.q_proj"`, `"*.mlp.fc"`).

    Each pattern must match at least one nn.Linear, and no nn.Linear may match two patterns:
    a typo would otherwise leave layers replicated without a word.
    """
    plan: dict[str, Any] = {}
    matched = dict.fromkeys(styles, 0)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        hits = [pattern for pattern in styles if fnmatch.fnmatchcase(name, pattern)]
        if len(hits) > 1:
            raise ValueError(f"{name} matches several patterns {hits}; make the patterns disjoint")
        if hits:
            plan[name] = styles[hits[0]]
            matched[hits[0]] += 1
    unmatched = [pattern for pattern, count in matched.items() if count == 0]
    if unmatched:
        raise ValueError(f"patterns {unmatched} match no nn.Linear of {type(model).__name__}; "
                         "names look like " + ", ".join(n for n, m in model.named_modules()
                                                        if isinstance(m, nn.Linear))[:300])
    return plan


def parallelize_module(
    model: nn.Module, mesh: Any, plan: Mapping[str, Any], *, config: MXConfig | None = None
) -> list[ShardingProblem]:
    """torch's `parallelize_module(model, mesh, plan)` in place; returns the weights whose
    shards along a contracted axis cut MX blocks (`sharded_contraction_problems`): their
    GEMMs stay in high precision on every rank."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    config = config if config is not None else MXConfig()
    if not isinstance(config, MXConfig):
        raise ValueError(f"config must be an MXConfig, got {type(config).__name__}")
    torch_parallelize_module(model, mesh, dict(plan))
    return sharded_contraction_problems(model, config.block_size)
