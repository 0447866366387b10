"""Every key mxcompile stores in a graph's or a node's `meta` dict, in one place: the passes,
the backend and the lowering import them from here."""

# node.meta key of the config's GemmKernel on the MX and FP4 GEMM nodes, read by the CUDA lowering
# and by the cost model, which sits below the passes and so defines it (cost/graph_costs.py).
from ..cost.graph_costs import GEMM_KERNEL_KEY  # noqa: F401 (re-exported)

GRAPH_INFO_KEY = "mxcompile_graph_info"  # gm.meta: the backend's GraphInfo (passes.graph_facts)
PLANNED_GRAPH_KEY = "mxcompile_memory_planned"  # gm.meta flag set by passes.memory_plan
# node.meta flag on the backward nodes passes.memory_plan placed (the copies that recompute a
# tensor, the reloads of offloaded ones): the Inductor lowering keeps each after the backward
# node the plan put before it.
PLAN_PLACED_KEY = "mxcompile_plan_placed"
# node.meta key on GEMMs attention_rewrite decided on (value: their role); gemm_rewrite skips them.
CLAIMED_KEY = "mxcompile_attention"
# node.meta key on aten._grouped_mm nodes gemm_rewrite made from transformers' fallback grouped-GEMM
# ops (value: the op's name), so that the decision row names where the GEMM came from.
GROUPED_ORIGIN_KEY = "mxcompile_grouped_origin"
