"""Lowering of rewritten forward / backward / inference graphs.

On CPU the mxcompile ops are decomposed into their pure-PyTorch definitions (so Inductor fuses
quantization into its generated C++ loops) and the graph goes to Inductor's inner compiler.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from .ops import DECOMPOSITIONS

MX_OPS = frozenset(DECOMPOSITIONS)


def has_mx_ops(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in MX_OPS for n in gm.graph.nodes)


def decompose_mx_ops(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Retrace `gm`, replacing mxcompile ops by the aten ops of their definitions."""
    if not has_mx_ops(gm):
        return gm
    table = {**select_decomp_table(), **DECOMPOSITIONS}
    trace = make_fx(fx.Interpreter(gm).run, decomposition_table=table, tracing_mode="real")
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return trace(*example_inputs)
    with fake_mode:
        return trace(*example_inputs)


def inductor_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(decompose_mx_ops(gm, example_inputs), example_inputs)


def eager_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Runs the rewritten graph op by op (for `explain` and debugging): no Inductor."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)
