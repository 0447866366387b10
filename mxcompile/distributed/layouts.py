"""Distributed layouts of the built-in GPT that train with `backend="mxfp8"`, and the check
that a tensor-parallel layout keeps MX blocks inside shards.

* DDP: `DistributedDataParallel(torch.compile(model, backend="mxfp8"))`. DDP's all-reduces
  run in autograd hooks outside the compiled graph, which is the single-process graph on the
  local batch. `torch.compile(DDP(model))` compiles only models whose forward is user code
  (the built-in GPT): DDP's forward graph-breaks before calling the model, and dynamo does
  not trace a torch.nn forward that starts a frame (`mxcompile.coverage`).
* FSDP2: `shard_gpt_fsdp2` (`fsdp.fully_shard` per block, on the LM head and on the root),
  then `compile_fsdp2`. FSDP2's hooks are `torch._dynamo.disable`d, so they run outside the
  compiled graphs, which see the unsharded parameters as plain inputs.
* Tensor parallelism: `gpt_tensor_parallel_plan` (`tensor_parallel.tensor_parallel_plan`)
  with `parallelize_module`. DTensor is
  desugared by AOTAutograd: the joint graph holds the local shards as plain tensors, and
  the redistributions as `_c10d_functional` all_reduce / all_gather_into_tensor + wait_tensor
  nodes, so the GEMM pass sees local GEMMs (RowwiseParallel: a K-shard per rank).

A GEMM that contracts over a sharded axis is the single-process GEMM, bit for bit up to the
order of the final sum, exactly when every shard starts and ends on a multiple of the block
size: then each rank's local blocks are global blocks. `sharded_contraction_problems` lists
the DTensor weights for which that does not hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import MXConfig
from ..numerics import DEFAULT_BLOCK_SIZE

ROW_AXIS, COL_AXIS = 0, 1
_AXIS_ROLE = {
    ROW_AXIS: "N (out_features), contracted by the dX = dY·W GEMM",
    COL_AXIS: "K (in_features), contracted by the forward Y = X·Wᵀ GEMM",
}

__all__ = [
    "ShardingProblem",
    "gpt_tensor_parallel_plan",
    "shard_gpt_fsdp2",
    "sharded_contraction_problems",
]


def gpt_tensor_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """Megatron-style plan for the built-in GPT's blocks (`tensor_parallel_plan` with fixed
    patterns): ColwiseParallel on attn.qkv and mlp.fc, RowwiseParallel on attn.proj and
    mlp.proj. Embeddings, norms and the LM head stay replicated.

    The fused qkv output is gathered back to a replicated tensor (`output_layouts=Replicate()`)
    and attn.proj takes a replicated input, so attention itself runs replicated: a column
    shard of the fused [q | k | v] projection is not a set of whole heads, and on CPU
    `aten._scaled_dot_product_flash_attention_for_cpu` has no DTensor sharding strategy (it
    raises NotImplementedError on a DTensor), so attention must see plain tensors. The MLP is
    sharded end to end (local GELU on a column shard, partial sums all-reduced after mlp.proj).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .tensor_parallel import tensor_parallel_plan

    if getattr(model, "blocks", None) is None:
        raise ValueError(f"{type(model).__name__} has no .blocks; give the built-in GPT (mxcompile.examples.gpt.GPT)")
    return tensor_parallel_plan(model, {
        "blocks.*.attn.qkv": ColwiseParallel(output_layouts=Replicate()),
        "blocks.*.attn.proj": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
    })


def shard_gpt_fsdp2(
    model: nn.Module,
    mesh: Any,
    *,
    config: MXConfig | None = None,
    mp_policy: Any | None = None,
) -> dict[str, str]:
    """`fully_shard` without compiling, for the built-in GPT: units are the blocks, the LM
    head and the root. Returns the MX all-gather decisions per weight ({} for the plain
    all-gather); compile with `compile_fsdp2`."""
    from .fsdp import fully_shard

    if getattr(model, "blocks", None) is None:
        raise ValueError(f"{type(model).__name__} has no .blocks; give the built-in GPT (mxcompile.examples.gpt.GPT)")
    block_type = type(model.blocks[0])
    return dict(fully_shard(model, mesh, config=config, block_types=(block_type,), mp_policy=mp_policy,
                            compile=False).all_gather)


@dataclass(frozen=True)
class ShardingProblem:
    """A DTensor weight whose shards along a GEMM's contraction axis cut MX blocks."""

    param: str
    axis: int
    shards: tuple[tuple[int, int], ...]  # (global offset, length) of every rank's shard
    block_size: int

    def __str__(self) -> str:
        cuts = ", ".join(f"[{o}, {o + n})" for o, n in self.shards)
        return (
            f"{self.param}: axis {self.axis} ({_AXIS_ROLE[self.axis]}) is sharded as {cuts}; "
            f"a shard that does not start and end on a multiple of block_size={self.block_size} "
            "makes that rank's MX blocks differ from the single-process blocks (or makes ranks "
            "decide differently): keep GEMMs contracting over this axis in high precision"
        )


def shard_intervals(global_shape: tuple[int, ...], mesh: Any, placements: Any, axis: int) -> list[tuple[int, int]]:
    """(global offset, length) along `axis` of every mesh coordinate's shard, deduplicated."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shards = []
    for coordinate in itertools.product(*(range(s) for s in mesh.shape)):
        shape, offset = _compute_local_shape_and_global_offset(
            global_shape, mesh.shape, list(coordinate), placements)
        shards.append((int(offset[axis]), int(shape[axis])))
    return sorted(set(shards))


def sharded_contraction_problems(module: nn.Module, block_size: int = DEFAULT_BLOCK_SIZE) -> list[ShardingProblem]:
    """The 2-D DTensor parameters of `module` sharded along an axis some GEMM contracts (K for
    the forward, N for the dX GEMM) with a shard boundary off a multiple of block_size.

    Even sharding with (global size / shards) % block_size == 0 is always fine. DTensor shards
    like torch.chunk, so an uneven split such as K=65 on 2 ranks ([0, 33) and [33, 65)) is
    not: rank 1's local K=32 passes the GEMM pass's divisibility check, and its blocks start
    at column 33.
    """
    from torch.distributed.tensor import DTensor, Shard

    problems = []
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor) or param.ndim != 2:
            continue
        sharded_axes = {p.dim % param.ndim for p in param.placements if isinstance(p, Shard)}
        for axis in sorted(sharded_axes):
            shards = shard_intervals(tuple(param.shape), param.device_mesh, param.placements, axis)
            if any(length and (offset % block_size or length % block_size) for offset, length in shards):
                problems.append(ShardingProblem(name, axis, tuple(shards), block_size))
    return problems
