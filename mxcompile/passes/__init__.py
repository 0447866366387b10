"""The ordered pass pipeline. Each pass is one module with a function
`(gm, config, graph_name) -> PassResult` that changes the graph in place and reports what it
changed. The order below is the order they run in; nothing else decides it.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..config import MXConfig
from ..report import PassResult
from .attention_rewrite import rewrite_attention
from .gemm_rewrite import rewrite_gemms

Pass = Callable[[fx.GraphModule, MXConfig, str], PassResult]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("attention_rewrite", rewrite_attention),  # first: claims attention's bmm's before gemm_rewrite
    ("gemm_rewrite", rewrite_gemms),
)


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
