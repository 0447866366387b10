"""Helpers of the cost-model tests (tests/cost/): synthetic device profiles, and traced graphs
whose nodes carry fake values, looked up by op."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from mxcompile.cost.profiles import DeviceProfile

GIGA = 1e9


def synthetic_profile(*, op_rates=None, native_fp8_gemm=True, fp32=10 * GIGA, bf16=20 * GIGA, fp8=40 * GIGA,
                      bandwidth=100 * GIGA) -> DeviceProfile:
    """A device profile with these rates (FLOP/s, bytes/s; `op_rates` as measured rates)."""
    op_rates = dict(op_rates or {})
    sources = {"peak_flops.fp32": "a", "peak_flops.bf16": "b", "peak_flops.fp8": "c", "memory_bandwidth": "d",
               "host_link_bandwidth": "e", **{f"op_rates.{key}": "f" for key in op_rates}}
    return DeviceProfile(name="synthetic", peak_flops={"fp32": fp32, "bf16": bf16, "fp8": fp8},
                         memory_bandwidth=bandwidth, host_link_bandwidth=bandwidth, sources=sources,
                         op_rates=op_rates, native_fp8_gemm=native_fp8_gemm)


def first_of_each_op(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """The first node of each op of ``gm``, by schema name."""
    nodes = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            nodes.setdefault(schema.name, node)
    return nodes


def traced_ops(fn, *inputs: torch.Tensor) -> dict[str, fx.Node]:
    """``fn`` traced, every node with its fake value; its first node of each op, by schema name."""
    gm = fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*inputs)
    return first_of_each_op(gm)
