"""The ordered pass pipeline. Each pass is one module with a function
`(gm, config, graph_name) -> PassResult` that changes the graph in place and reports what it
changed. The order below is the order they run in; nothing else decides it:

1. PIPELINE, on the joint (training) or inference graph: attention_rewrite, smooth_swiglu,
   gemm_rewrite;
2. PARTITION_STAGE, on a joint graph only: partition into forward and backward, with the
   memory plan of the saved activations when config.memory_budget is set (memory_plan).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from ..config import MXConfig
from ..report import PassResult
from .attention_rewrite import rewrite_attention
from .gemm_rewrite import rewrite_gemms
from .memory_plan import plan_and_partition
from .smooth_swiglu import smooth_swiglu

Pass = Callable[[fx.GraphModule, MXConfig, str], PassResult]
PartitionStage = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("attention_rewrite", rewrite_attention),  # first: claims attention's bmm's before gemm_rewrite
    # before gemm_rewrite: rescales a SwiGLU down projection's operands, which gemm_rewrite then quantizes
    ("smooth_swiglu", smooth_swiglu),
    ("gemm_rewrite", rewrite_gemms),
)

# After PIPELINE, a joint graph is partitioned by this stage: plain min-cut without a memory
# budget; with one, min-cut, then the plan, then the graphs rewritten to follow it. Inference
# graphs have no backward and stop after PIPELINE.
PARTITION_STAGE: tuple[str, PartitionStage] = ("memory_plan", plan_and_partition)


class PassError(RuntimeError):
    """A pass failed on a graph; names the pass (and the node when the pass knows it)."""


def run_pipeline(gm: fx.GraphModule, config: MXConfig, graph_name: str) -> list[PassResult]:
    results = []
    for name, run_pass in PIPELINE:
        try:
            results.append(run_pass(gm, config, graph_name))
        except Exception as err:  # re-raised with the pass named; the cause is chained
            raise PassError(f"mxcompile pass '{name}' failed on the {graph_name} graph: {err}") from err
    return results


def run_partition_stage(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Run PARTITION_STAGE on a rewritten joint graph; returns (forward, backward). Its errors
    (e.g. a budget no plan can meet) are configuration errors and pass through unwrapped."""
    _, stage = PARTITION_STAGE
    return stage(joint, joint_inputs, **kwargs)
