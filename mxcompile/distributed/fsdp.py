"""FSDP2 for any model with the `mxfp8` backend: `fully_shard` (named after torch's) shards a
model per block, puts the MXFP8 all-gather on every eligible nn.Linear weight and compiles
every FSDP unit's forward, so that every GEMM reaches the backend.

Why units are compiled one by one (`compile_fsdp2`) rather than `torch.compile(model)`: FSDP2
runs `torch._dynamo.disable`d hooks at every unit's call, so each unit's forward starts a new
frame, and dynamo does not trace a frame whose code is torch.nn's (an nn.Linear LM head, an
nn.Sequential): such units would run in full precision (see `mxcompile.coverage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..config import FsdpAllGather, MXConfig, Recipe
from ..coverage import warn_uncompiled

# The backends named by a recipe (backend="mxfp8", "nvfp4", "mxfp4"): each takes `config` as options.
RECIPE_BACKENDS = tuple(recipe.value for recipe in Recipe)

__all__ = ["FullyShardResult", "compile_fsdp2", "find_block_types", "fully_shard", "unsharded_parameters"]


@dataclass(frozen=True)
class FullyShardResult:
    """What `fully_shard` did, each with its reason."""

    units: Mapping[str, str] = field(default_factory=dict)  # unit name ("" = root) -> why it is a unit
    all_gather: Mapping[str, str] = field(default_factory=dict)  # weight -> MX all-gather decision
    compiled: tuple[str, ...] = ()  # modules whose forward was compiled


def unsharded_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters of the FSDP2 units in `module`: compiled graphs run with these,
    while between steps the module holds the sharded (DTensor) ones. Read through FSDP2's
    private state (`_get_fsdp_state()`: a list `_fsdp_param_groups` in torch 2.13, a single
    `_fsdp_param_group` in 2.11); empty where there is none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    found: list[torch.Tensor] = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            state = unit._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
            for group in groups:
                found.extend(p._unsharded_param for p in group.fsdp_params if hasattr(p, "_unsharded_param"))
    return found


def find_block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated blocks of `model`: the class of every nn.ModuleList whose items all have
    one class and own parameters (GPT's `blocks`, HF's `layers`). Empty for a flat model."""
    found: list[type[nn.Module]] = []
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(item) for item in module}
        kind = next(iter(kinds))
        if len(kinds) == 1 and any(True for _ in module[0].parameters()) and kind not in found:
            found.append(kind)
    return tuple(found)


def _shared_elsewhere(model: nn.Module, module: nn.Module) -> bool:
    """Whether a parameter of `module` is also reached outside it (tied embeddings)."""
    own = {id(p) for p in module.parameters()}
    inside = {id(m) for m in module.modules()}
    for other in model.modules():
        if id(other) in inside:
            continue
        if any(id(p) in own for p in other.parameters(recurse=False)):
            return True
    return False


def _plan_units(model: nn.Module, block_types: Sequence[type[nn.Module]]) -> dict[str, str]:
    """Unit name -> reason: every block, then every nn.Linear outside all blocks (own unit, so
    it reshards after the forward and is re-gathered for the backward like the blocks; the
    root unit is not resharded), then the root."""
    units: dict[str, str] = {}
    block_names = [name for name, m in model.named_modules() if name and isinstance(m, tuple(block_types))]
    # Outermost blocks only: a block nested in another block is part of its unit.
    for name in block_names:
        if not any(name.startswith(outer + ".") for outer in block_names):
            units[name] = f"block type {type(model.get_submodule(name)).__name__}"
    tied: list[str] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.Linear):
            continue
        if any(name == unit or name.startswith(unit + ".") for unit in units):
            continue
        if _shared_elsewhere(model, module):
            tied.append(name)
        else:
            units[name] = "nn.Linear outside every block: own unit, resharded after the forward"
    units[""] = "root: everything not in another unit" + (
        f"; {', '.join(tied)} share weights with other modules and stay here" if tied else "")
    return units


def fully_shard(
    model: nn.Module,
    mesh: Any,
    *,
    config: MXConfig | None = None,
    block_types: Sequence[type[nn.Module]] | None = None,
    mp_policy: Any | None = None,
    compile: bool = True,
    backend: str | Callable[..., Any] | None = None,
) -> FullyShardResult:
    """FSDP2 on `model` in place, for training with the mxfp8 backend or an FP4 recipe's.

    * units: every block (`block_types`, or `find_block_types(model)`), every nn.Linear
      outside the blocks whose weight is not tied to another module, and the root;
    * with `config.fsdp_all_gather == "mxfp8"`, the MXFP8 all-gather on every eligible
      nn.Linear weight (`enable_mx_all_gather`, decisions with reasons in the result);
    * with `compile=True`, every unit's forward compiled (`compile_fsdp2`) with `backend`
      (default: the backend of `config.recipe`; "mxfp8", "nvfp4" or "mxfp4" gets `config` as
      options, and `config` defaults to that recipe's; a callable backend carries its own
      config), then warns (mxcompile.coverage) if some nn.Linear still escapes every compiled graph.

    FP4 recipes all-gather weights in high precision: `fsdp_all_gather="mxfp8"` with an FP4
    recipe raises (`mx_all_gather.check_all_gather_recipe`).
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from .mx_all_gather import check_all_gather_recipe, enable_mx_all_gather

    recipe = backend if isinstance(backend, str) and backend in RECIPE_BACKENDS else None
    config = config if config is not None else MXConfig.for_recipe(recipe or Recipe.MXFP8)
    if not isinstance(config, MXConfig):
        raise ValueError(f"config must be an MXConfig, got {type(config).__name__}")
    if recipe is not None and config.recipe.value != recipe:
        raise ValueError(f"backend={recipe!r} with config.recipe={config.recipe.value!r}: pass "
                         f"config=MXConfig.for_recipe({recipe!r}, ...) or backend={config.recipe.value!r}")
    backend = backend if backend is not None else config.recipe.value
    check_all_gather_recipe(config)
    types = tuple(block_types) if block_types is not None else find_block_types(model)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise ValueError(f"block_types must be nn.Module subclasses, got {types!r}")
    units = _plan_units(model, types)
    all_gather: dict[str, str] = {}
    if config.fsdp_all_gather is FsdpAllGather.MXFP8:
        all_gather = enable_mx_all_gather(model, config, world_size=mesh.size())
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for name in units:  # the root comes last
        torch_fully_shard(model.get_submodule(name), **kwargs)
    compiled: tuple[str, ...] = ()
    if compile:
        options = config.to_dict() if isinstance(backend, str) else None
        compiled = compile_fsdp2(model, backend=backend, options=options)
        warn_uncompiled(model)
    return FullyShardResult(units=units, all_gather=all_gather, compiled=compiled)


def compile_fsdp2(
    model: nn.Module,
    backend: str | Callable[..., Any] = "mxfp8",
    options: Mapping[str, Any] | None = None,
) -> tuple[str, ...]:
    """Compile an FSDP2 model so that every nn.Linear reaches the backend; returns the names
    of the modules whose forward was compiled.

    `torch.compile(model)` is not enough: at each unit's call dynamo meets a disabled hook; in
    a root forward that calls its blocks in a loop it cannot resume the graph break and runs
    the root's whole forward eagerly ("graph break in loop"). Blocks with a user-code forward
    are then still traced in frames of their own, but modules whose forward is torch.nn's
    (an nn.Linear LM head, nn.Sequential) are not. So this compiles `forward` of every FSDP unit
    below the root and of every root child that owns an nn.Linear outside those units, with
    `module.forward = torch.compile(module.forward)` (keeps parameter names and FSDP's hooks,
    which wrap `__call__`). The root's own code (embeddings, the loop) runs eagerly.
    """
    from torch.distributed.fsdp import FSDPModule

    kwargs: dict[str, Any] = {"backend": backend}
    if options is not None:
        kwargs["options"] = dict(options)
    names = {id(m): name for name, m in model.named_modules()}
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    covered = {id(sub) for unit in units for sub in unit.modules()}
    targets: list[nn.Module] = list(units)

    def owns_uncovered_linear(module: nn.Module) -> bool:
        return any(isinstance(sub, nn.Linear) and id(sub) not in covered for sub in module.modules())

    if isinstance(model, nn.Linear):  # a bare nn.Linear is its own (root) unit
        targets.append(model)
    pending = list(model.children())
    while pending:
        child = pending.pop()
        if id(child) in covered or not owns_uncovered_linear(child):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # containers have no forward
            pending.extend(child.children())
        else:
            targets.append(child)
    for module in targets:
        module.forward = torch.compile(module.forward, **kwargs)
    return tuple(names[id(m)] for m in targets)
