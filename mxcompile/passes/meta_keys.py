"""Every key mxcompile stores in a graph's or a node's `meta` dict, in one place: the passes,
the backend and the lowering import them from here."""

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
# node.meta key on the mxcompile::mx_mm and mxcompile::quantize nodes of an MX GEMM, and on the
# mxcompile::mx_mm_fp4 node of an FP4 GEMM: the config's GemmKernel, read by the CUDA lowering
# (mxcompile.lowering) to choose between the Triton kernels and Inductor's code (a GEMM of
# dequantized operands, quantization fused into Inductor's kernels).
GEMM_KERNEL_KEY = "mxcompile_gemm_kernel"
