"""MXFP8 weight all-gather for FSDP2 (`MXConfig(fsdp_all_gather="mxfp8")`).

FSDP2 shards an `nn.Linear` weight W (N, K) along dim 0 (out_features) and all-gathers it
before each use. Here every rank MX-quantizes its own shard before the all-gather, so the
collective moves fp8 elements plus one E8M0 scale byte per block: (1 + 1/block_size) bytes per
element (1.03 B for blocks of 32) instead of 2 (bf16) or 4 (fp32).

Why the gathered copy is exactly the single-process quantization:

* Forward, Y = X Wᵀ quantizes W along K (dim 1). Blocks along K lie inside one row, and a
  dim-0 shard holds whole rows, so no block straddles a shard: quantizing each shard along
  dim 1 and concatenating is bit-identical to quantizing the full W along dim 1, whatever the
  shard sizes. Constraint: K % block_size == 0.
* Backward, dX = dY W quantizes W along N (dim 0). A block along N stays inside a shard only
  if every shard boundary is a multiple of block_size: (N / world_size) % block_size == 0.
  When this holds the backward all-gather (FSDP re-gathers a resharded weight in the
  backward) moves the N-axis quantization instead, again bit-identical to one process.
  When it does not hold, or when FSDP keeps the forward copy for the backward (root module,
  `reshard_after_forward=False`), the backward GEMM re-quantizes the K-axis copy along N:
  a second rounding that single-process training does not have (reported in
  `MXAllGatherWeight.backward_axis`).

FSDP2's extension point is a tensor subclass on the sharded parameter with
`fsdp_pre_all_gather` / `fsdp_post_all_gather`: `MXAllGatherWeight` wraps the high-precision
master weight (the optimizer sees and updates it), the pre-all-gather hook quantizes the local
shard, the post-all-gather hook dequantizes the gathered bytes into the unsharded parameter
(a plain tensor of FSDP's param dtype). The unsharded parameter therefore holds exactly the MX
values; the compiled graph's GEMM re-quantizes it along the same axis, which reproduces the
gathered data and scales exactly (MX quantization is idempotent), so the gathered MX copy is
what the forward GEMM computes with. FSDP2 runs its hooks outside the compiled graph, so the
compiled region only ever sees plain tensors and torch.compile needs nothing special.

Uneven dim-0 sharding (N % world_size != 0) cannot use the extension: FSDP2 requires every
all-gather input of a padded shard to have the padded shard's size, and the scales do not.
`enable_mx_all_gather` leaves such weights alone (bf16 / param-dtype all-gather) and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..config import FsdpAllGather, MXConfig
from ..numerics import DEFAULT_BLOCK_SIZE, MXTensor, dequantize_along, elem_format, quantize_along
from ..numerics.formats import SUPPORTED_INPUT_DTYPES
from ..numerics import scale_mode_named

aten = torch.ops.aten

WEIGHT_NDIM = 2
ROW_AXIS = 0  # N, out_features: the axis FSDP2 shards, and the dX GEMM's contraction axis
COL_AXIS = 1  # K, in_features: the forward GEMM's contraction axis
_NOT_IN_BACKWARD = -1  # torch._C._current_graph_task_id() outside the autograd engine
# The nn.Linear attribute holding the all-gather decision for its weight, with its reason:
# FSDP2 replaces the parameter when it shards, the module stays (read by `all_gather_decisions`).
ALL_GATHER_DECISION_ATTR = "mxcompile_all_gather"

__all__ = [
    "ALL_GATHER_DECISION_ATTR",
    "AllGatherStats",
    "MXAllGatherSpec",
    "MXAllGatherWeight",
    "all_gather_decisions",
    "all_gather_mx_weight",
    "enable_mx_all_gather",
    "mx_all_gather_bytes_per_element",
]


def mx_all_gather_bytes_per_element(block_size: int) -> float:
    """Bytes the MX all-gather moves per weight element: one fp8 byte plus a scale byte per block."""
    return 1.0 + 1.0 / block_size


@dataclass(frozen=True)
class MXAllGatherSpec:
    """How a weight is quantized for the all-gather (taken from an `MXConfig`)."""

    elem: str = "e4m3"
    scale_mode: str = "rceil"
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_config(cls, config: MXConfig) -> "MXAllGatherSpec":
        return cls(elem=config.forward_elem, scale_mode=config.scale_mode, block_size=config.block_size)


def _check_shard(shard: torch.Tensor, axis: int, block_size: int) -> None:
    if not isinstance(shard, torch.Tensor) or shard.ndim != WEIGHT_NDIM:
        raise ValueError(
            f"shard must be a 2-D (rows, K) tensor, got "
            f"{tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__}"
        )
    if shard.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"shard has dtype {shard.dtype}; MX quantization accepts {list(SUPPORTED_INPUT_DTYPES)}")
    if axis not in (ROW_AXIS, COL_AXIS):
        raise ValueError(f"axis={axis!r} is not accepted; accepted: {ROW_AXIS} (N) or {COL_AXIS} (K)")
    if shard.shape[axis] % block_size:
        where = "K (in_features)" if axis == COL_AXIS else "this rank's rows (N / world_size)"
        raise ValueError(
            f"shard shape {tuple(shard.shape)}: {where} = {shard.shape[axis]} is not divisible by "
            f"block_size={block_size}; MX blocks along axis {axis} would straddle "
            + ("rows" if axis == COL_AXIS else "the shard boundary")
        )


def _all_gather_single(out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """dist.all_gather_single (torch >= 2.13) or its older name all_gather_into_tensor,
    looked up at call time so that CollectiveCounter sees the call."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def all_gather_mx_weight(
    shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    axis: int = COL_AXIS,
    elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> MXTensor:
    """All-gather a dim-0-sharded weight in MX format.

    shard: this rank's rows of W (N, K), rows in rank order, the same shape on every rank.
    axis: the quantization axis: 1 (K, the forward GEMM's; any shard size) or 0 (N, the dX
    GEMM's; needs shard rows % block_size == 0 so blocks do not straddle shards).
    Returns the MXTensor of the full W, bit-identical to `quantize_mx(W, axis)` on one process.
    Moves (1 + 1/block_size) bytes per element: fp8 data and uint8 scales, as uint8.
    """
    _check_shard(shard, axis, block_size)
    world_size = dist.get_world_size(group)
    data, scale_bytes = quantize_along(
        shard.detach(), axis, elem_format(elem), scale_mode_named(scale_mode), block_size
    )
    gathered = []
    for local in (data.contiguous().view(torch.uint8), scale_bytes.contiguous()):
        out = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local, group=group)
        gathered.append(out)
    return MXTensor(
        data=gathered[0].view(elem_format(elem).dtype),
        scale=gathered[1].view(torch.float8_e8m0fnu),
        axis=axis,
        elem=elem,
        block_size=block_size,
        scale_mode=scale_mode,
        orig_dtype=shard.dtype,
    )


# Ops through which FSDP2 builds, pads, copies and views the sharded parameter: their outputs
# stay MXAllGatherWeight so that the sharded local tensor keeps the all-gather hooks.
_PRESERVED_OPS = frozenset({
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.narrow.default, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.copy_.default, aten.clone.default, aten._to_copy.default, aten._pin_memory.default,
    aten.detach.default, aten.alias.default,
})


@dataclass
class AllGatherStats:
    """Per-weight counts of the all-gathers in each format (read by tests and benchmarks)."""

    forward: int = 0  # K-axis gathers
    backward: int = 0  # N-axis gathers


class MXAllGatherWeight(torch.Tensor):
    """A high-precision (master) weight whose FSDP2 all-gather moves MX bytes.

    Every op unwraps it to the plain tensor it holds (so the optimizer, clipping and state_dict
    see an ordinary tensor) except the few FSDP2 uses to shard and pad, which keep the wrapper.
    `backward_axis` is the quantization axis of the gather FSDP2 issues during the backward:
    0 (N, exact) when each shard's rows are a multiple of block_size, else 1 (the K-axis copy,
    re-quantized along N by the dX GEMM).
    """

    _hp: torch.Tensor
    spec: MXAllGatherSpec
    backward_axis: int
    stats: AllGatherStats

    @staticmethod
    def __new__(cls, hp: torch.Tensor, spec: MXAllGatherSpec, backward_axis: int = COL_AXIS,
                stats: AllGatherStats | None = None) -> "MXAllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, hp.size(), strides=hp.stride(), storage_offset=hp.storage_offset(),
            dtype=hp.dtype, device=hp.device, layout=hp.layout, requires_grad=hp.requires_grad,
        )

    def __init__(self, hp: torch.Tensor, spec: MXAllGatherSpec, backward_axis: int = COL_AXIS,
                 stats: AllGatherStats | None = None) -> None:
        self._hp = hp
        self.spec = spec
        self.backward_axis = backward_axis
        self.stats = stats if stats is not None else AllGatherStats()

    def __repr__(self) -> str:
        return f"MXAllGatherWeight({self._hp!r}, spec={self.spec}, backward_axis={self.backward_axis})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[MXAllGatherSpec, int, AllGatherStats]]:
        return ["_hp"], (self.spec, self.backward_axis, self.stats)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: tuple, outer_size: Any,
                             outer_stride: Any) -> "MXAllGatherWeight":
        return MXAllGatherWeight(inner["_hp"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        template = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._hp, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED_OPS:
            return out
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: cls(t, template.spec, template.backward_axis, template.stats),
            out,
        )

    # FSDP2 all-gather extension -------------------------------------------------------------

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, torch.dtype]]:
        """Quantize this rank's shard (cast to FSDP's param dtype first, as the plain
        all-gather would) and hand FSDP the fp8 bytes and scale bytes to gather."""
        in_backward = torch._C._current_graph_task_id() != _NOT_IN_BACKWARD
        axis = self.backward_axis if in_backward else COL_AXIS
        if in_backward:
            self.stats.backward += 1
        else:
            self.stats.forward += 1
        param_dtype = getattr(mp_policy, "param_dtype", None) or self._hp.dtype
        spec = self.spec
        data, scale_bytes = quantize_along(
            self._hp.detach().to(param_dtype), axis, elem_format(spec.elem),
            scale_mode_named(spec.scale_mode), spec.block_size,
        )
        return (data.contiguous().view(torch.uint8), scale_bytes.contiguous()), (axis, param_dtype)

    def fsdp_post_all_gather(
        self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: tuple[int, torch.dtype],
        param_dtype: torch.dtype, *, out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Dequantize the gathered (N, K) fp8 bytes with their scales into the unsharded
        parameter: a plain tensor holding exactly the MX values."""
        data_bytes, scale_bytes = all_gather_outputs
        axis, _ = metadata
        fp8 = elem_format(self.spec.elem).dtype
        weight = dequantize_along(data_bytes.view(fp8), scale_bytes, axis, self.spec.block_size, param_dtype)
        if out is not None:
            # FSDP2 refills the same unsharded parameter every gather (autograd may hold it
            # for the backward); like FSDP2's own copy-out, the refill keeps its version.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            return None
        return weight, (weight,)


def _backward_axis(rows: int, world_size: int, block_size: int) -> tuple[int, str]:
    shard_rows = rows // world_size
    if shard_rows % block_size == 0:
        return ROW_AXIS, f"backward gathers W quantized along N (shard rows {shard_rows})"
    return COL_AXIS, (
        f"shard rows N/world_size = {shard_rows} not divisible by block_size={block_size}: "
        "the backward reuses the K-axis MX copy (the dX GEMM re-quantizes it along N)"
    )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def enable_mx_all_gather(
    module: nn.Module,
    config: MXConfig | None = None,
    world_size: int | None = None,
    *,
    modules: Iterable[nn.Module] | None = None,
) -> dict[str, str]:
    """Wrap the weights of `module`'s nn.Linear layers in MXAllGatherWeight; call before
    `fully_shard`. Returns {parameter name: what was done or why it was left alone}.

    Eligible: 2-D floating weights with K % block_size == 0 and N % world_size == 0 (FSDP2
    cannot pad an extension's scale tensor). Biases, norms and embeddings keep the plain gather.
    `modules` restricts the conversion to these linears (default: every nn.Linear).
    """
    config = config if config is not None else MXConfig(fsdp_all_gather="mxfp8")
    if config.fsdp_all_gather is not FsdpAllGather.MXFP8:
        raise ValueError(
            f"config.fsdp_all_gather='{config.fsdp_all_gather}'; enable_mx_all_gather needs 'mxfp8'"
        )
    check_all_gather_recipe(config)
    world_size = world_size if world_size is not None else dist.get_world_size()
    spec = MXAllGatherSpec.from_config(config)
    chosen = None if modules is None else {id(m) for m in modules}
    decisions: dict[str, str] = {}
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or (chosen is not None and id(child) not in chosen):
            continue
        weight = child.weight
        key = f"{name}.weight" if name else "weight"
        if isinstance(weight, MXAllGatherWeight) or isinstance(getattr(weight, "data", None), MXAllGatherWeight):
            decisions[key] = "already MX all-gather"
            continue
        backward_axis, decision = all_gather_decision(weight, spec, world_size)
        if backward_axis is not None:
            wrapped = MXAllGatherWeight(weight.detach(), spec, backward_axis)
            child.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        setattr(child, ALL_GATHER_DECISION_ATTR, decision)
        decisions[key] = decision
    return decisions


def check_all_gather_recipe(config: MXConfig) -> None:
    """The MXFP8 all-gather serves the mxfp8 recipe only. Under an FP4 recipe the linear layers'
    GEMMs quantize their weights to NVFP4 / MXFP4 (16x16 blocks, an fp32 tensor scale): a weight
    gathered as MXFP8 values would be rounded twice, and its gradients would no longer be those
    of one process. FP4 recipes all-gather weights in high precision (`fsdp_all_gather="bf16"`,
    FSDP2's param dtype); an FP4 all-gather is not implemented."""
    if config.fp4 is not None and config.fsdp_all_gather is FsdpAllGather.MXFP8:
        raise ValueError(
            f"fsdp_all_gather='mxfp8' with recipe={config.recipe.value!r}: the MXFP8 weight all-gather would round "
            f"the weights to MXFP8 before the {config.recipe.value} GEMMs round them again; FP4 recipes all-gather "
            "weights in high precision: set fsdp_all_gather='bf16' (the default)")


def all_gather_decision(weight: torch.Tensor, spec: MXAllGatherSpec, world_size: int) -> tuple[int | None, str]:
    """The exactness rule for one nn.Linear weight (N, K) sharded along N over `world_size`
    ranks: (the backward gather's quantization axis, the decision with its reason), or
    (None, why the weight keeps FSDP2's plain all-gather)."""
    rows, cols = weight.shape
    if _is_dtensor(weight):
        return None, ("kept: tensor-parallel DTensor weight (2-D mesh); the MX all-gather wraps "
                      "plain tensors only, so FSDP2 gathers it in the parameter dtype")
    if not weight.dtype.is_floating_point:
        return None, f"kept: dtype {weight.dtype} is not floating point"
    if cols % spec.block_size:
        return None, f"kept: K={cols} not divisible by block_size={spec.block_size}"
    if rows % world_size:
        return None, (f"kept: N={rows} not divisible by world_size={world_size} (FSDP2 pads uneven "
                      "shards and requires every all-gather input to have the padded size)")
    axis, why = _backward_axis(rows, world_size, spec.block_size)
    return axis, f"mxfp8 all-gather; {why}"


def all_gather_decisions(model: nn.Module) -> dict[str, str]:
    """{weight name: all-gather decision with its reason} for every nn.Linear of `model` that
    `enable_mx_all_gather` (or `fully_shard` with `fsdp_all_gather="mxfp8"`) decided on; empty
    for a model it never saw. Read by `mxcompile.explain`."""
    return {
        f"{name}.weight" if name else "weight": getattr(module, ALL_GATHER_DECISION_ATTR)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and hasattr(module, ALL_GATHER_DECISION_ATTR)
    }
