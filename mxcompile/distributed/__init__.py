"""mxcompile under torch.distributed: DDP, FSDP2 (with an MXFP8 weight all-gather) and tensor
parallelism with the `mxfp8` backend. See README_SECTION.md in this folder."""

from .comm_counter import CollectiveCounter, CollectiveTotals
from .layouts import (
    ShardingProblem,
    compile_fsdp2,
    gpt_tensor_parallel_plan,
    shard_gpt_fsdp2,
    sharded_contraction_problems,
)
from .mx_all_gather import (
    MXAllGatherSpec,
    MXAllGatherWeight,
    all_gather_mx_weight,
    enable_mx_all_gather,
    mx_all_gather_bytes_per_element,
)
from .subclass_inputs import param_placeholder_indices

__all__ = [
    "CollectiveCounter",
    "CollectiveTotals",
    "MXAllGatherSpec",
    "MXAllGatherWeight",
    "ShardingProblem",
    "all_gather_mx_weight",
    "compile_fsdp2",
    "enable_mx_all_gather",
    "gpt_tensor_parallel_plan",
    "mx_all_gather_bytes_per_element",
    "param_placeholder_indices",
    "shard_gpt_fsdp2",
    "sharded_contraction_problems",
]
