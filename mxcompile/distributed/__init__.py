"""mxcompile under torch.distributed: DDP, FSDP2 (with an MXFP8 weight all-gather) and tensor
parallelism with the `mxfp8` backend, for any model: `fully_shard` and `parallelize_module`
(named after the torch APIs they wrap). The README's distributed section has the usages."""

from .comm_counter import CollectiveCounter, CollectiveTotals
from .fsdp import FullyShardResult, compile_fsdp2, find_block_types, fully_shard
from .layouts import ShardingProblem, gpt_tensor_parallel_plan, shard_gpt_fsdp2, sharded_contraction_problems
from .mx_all_gather import (
    MXAllGatherSpec,
    MXAllGatherWeight,
    all_gather_decisions,
    all_gather_mx_weight,
    enable_mx_all_gather,
    mx_all_gather_bytes_per_element,
)
from .subclass_inputs import param_placeholder_indices
from .tensor_parallel import parallelize_module, tensor_parallel_plan

__all__ = [
    "CollectiveCounter",
    "CollectiveTotals",
    "FullyShardResult",
    "MXAllGatherSpec",
    "MXAllGatherWeight",
    "ShardingProblem",
    "all_gather_decisions",
    "all_gather_mx_weight",
    "compile_fsdp2",
    "enable_mx_all_gather",
    "find_block_types",
    "fully_shard",
    "gpt_tensor_parallel_plan",
    "mx_all_gather_bytes_per_element",
    "param_placeholder_indices",
    "parallelize_module",
    "shard_gpt_fsdp2",
    "sharded_contraction_problems",
    "tensor_parallel_plan",
]
