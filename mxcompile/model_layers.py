"""An FP4 recipe's high-precision layers by their place in the whole model, not in one graph.

The NVFP4 recipe keeps the model's last linear layers (about 15%) and its output projection in
high precision (`FP4Settings.high_precision_modules`). A compiled graph is not always the model:
torchtitan compiles each transformer block on its own, a user may compile the output projection
alone (its graph's only module name is ''), and dynamo runs one compiled graph for every block of
the same class: it guards on the module's class, not on the instance or its parameters
(torch 2.13, inline_inbuilt_nn_modules). Applied per graph, the rule kept every block's last
linear layer and missed an output projection compiled alone. So `high_precision_layers` decides
from the model:

- `compiled_scope`: dynamo compiles a graph while the model's forward runs (as
  `checkpointed_layers.modules_on_stack` relies on), so the model is on the Python stack. The
  innermost module there is the one whose forward the graph traces (the graph's module names are
  relative to it); the outermost one that contains it is the model.
- `model_linear_layers`: the model's linear layers in forward order. The modules that can run
  this graph (`_graph_instances`) each contribute the graph's linear layers, in the graph's
  order; the model's other nn.Linear modules come in registration order.
- `output_projection`: the model's last linear layer when its outputs are the vocabulary (its
  out_features are the largest embedding's rows) or its weight is an embedding's (tied), whatever
  its name.
- `separate_instances`: instances of one class that need different decisions (the last blocks
  against the others) cannot share a graph, so each one with layers to keep moves to a subclass
  of its class per set of kept layers (same name, nothing else added), as FSDP2's fully_shard
  moves a module to its FSDP class: dynamo's guard on the class then compiles it its own graph,
  whose compile decides from that instance.

HF gradient checkpointing runs every checkpointed layer through one compiled function,
`checkpointed_layers._run_layer(function, *args)` with `function` HF's partial(forward, layer,
**kwargs): its graphs name the layer's modules from that argument (`args.0.mlp.down_proj`), and a
reentrant checkpoint compiles its joint graph in the backward, with no model on the stack. So
`compiled_scope` first asks dynamo which frame it is tracing: for the runner's, the module is the
layer in `function` (`checkpointed_layers.layer_of_runner`), the model the one whose layers
mxcompile routed through the runner (`checkpointed_layers.model_of`), and the graph's names are
relative to the layer after the prefix `args.<i>` (`CompiledScope.graph_prefix`). The runner's
graphs are guarded on the layer's class too (through `function`), so `separate_instances` gives
the layers that keep layers their own runner graph.

When the graph's module names are not modules of the model (no model found, or a compiled
function that reaches its modules through its arguments otherwise), the rule falls back to the
graph's own linear layers. Torch's AOTAutograd cache key sees the graph and the config, not
the graph's place in the model: one block's cached decisions would serve every block (and,
served, no instance would move to its class). So the backend compiles graphs afresh when
`decides_from_model(config)`, as it compiles graphs with a memory budget (backend.py's
`cacheable`).
"""

from __future__ import annotations

import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
from torch import nn

from .checkpointed_layers import layer_of_runner, model_of
from .config import MXConfig


class MXSeparatedLayersWarning(UserWarning):
    """mxcompile moved modules of a model to per-decision subclasses (`separate_instances`)."""


_WARNED_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models told of the move once

__all__ = ["CompiledScope", "MXSeparatedLayersWarning", "compiled_scope", "decides_from_model", "model_linear_layers", "output_projection",
           "recipe_high_precision", "separate_instances"]

# The class a module had before `separate_instances` moved it (an attribute of the subclass).
ORIGINAL_CLASS = "_mxcompile_original_class"
# How a graph names a module that its compiled function reaches through a partial's positional
# argument i (dynamo's source L['function'].args[i], as graph_facts.clean_module_path writes it).
PARTIAL_ARGUMENT_PREFIX = "args.{}"
# (original class, kept layer names relative to the instance) -> its subclass: one per decision
# set, so every instance with the same decisions shares one class, and so one graph.
_SUBCLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _join(prefix: str, name: str) -> str:
    return ".".join(part for part in (prefix, name) if part)


def _within(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _original_class(module: nn.Module) -> type:
    """The module's class before `separate_instances` moved it."""
    return vars(type(module)).get(ORIGINAL_CLASS, type(module))


@dataclass(frozen=True)
class CompiledScope:
    """Where a compiled graph sits in its model: the model (`root`), the module whose forward
    the graph traces (`module`), its name in the model ('' when the graph traces the model's own
    forward) and the graph's name for it (`graph_prefix`: '' when the graph traces its forward,
    `args.0` when a compiled function reaches it through its argument)."""

    root: nn.Module
    module: nn.Module
    name: str
    graph_prefix: str = ""

    def model_name(self, name: str) -> str:
        """The model's name of a module named relative to `module`."""
        return _join(self.name, name)

    def module_names(self, graph_names: Sequence[str]) -> list[str] | None:
        """The graph's module names relative to `module`; None when one is not below it."""
        if not all(_within(name, self.graph_prefix) for name in graph_names):
            return None
        return [name[len(self.graph_prefix):].lstrip(".") for name in graph_names]


def _unwrapped(value: object) -> nn.Module | None:
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(value, OptimizedModule):
        value = value._orig_mod
    return value if isinstance(value, nn.Module) and not isinstance(value, fx.GraphModule) else None


def _runner_scope() -> CompiledScope | None:
    """The scope of a graph of HF gradient checkpointing's layer runner (the module docstring):
    the layer in the `function` of the `_run_layer` frame that dynamo traces, in the model whose
    layers mxcompile routed through the runner. None when dynamo traces another frame."""
    from torch._dynamo import symbolic_convert

    traced = getattr(symbolic_convert.tls, "current_tx", None)  # set while dynamo traces a frame
    found = layer_of_runner(traced.f_code, traced.f_locals) if traced is not None else None
    if found is None:
        return None
    index, layer = found
    root = model_of(layer)
    if root is None:
        return None
    name = next((n for n, m in root.named_modules() if m is layer), None)
    return CompiledScope(root, layer, name, PARTIAL_ARGUMENT_PREFIX.format(index)) if name is not None else None


def compiled_scope(frame: types.FrameType | None = None) -> CompiledScope | None:
    """The model and the module being compiled: for a graph of HF gradient checkpointing's
    layer runner, its layer (`_runner_scope`); else from the `self` of the Python frames from
    `frame` (default: the caller's) down: the innermost module (a torch.compile wrapper as the
    module it wraps; FX graph modules of the compiler itself left out) and the outermost
    module that contains it. None when no module is found."""
    runner = _runner_scope()
    if runner is not None:
        return runner
    frame = frame if frame is not None else sys._getframe(1)
    found: list[nn.Module] = []
    while frame is not None:
        module = _unwrapped(frame.f_locals.get("self"))
        if module is not None and all(module is not seen for seen in found):
            found.append(module)
        frame = frame.f_back
    if not found:
        return None
    inner = found[0]
    for root in reversed(found):
        name = next((n for n, m in root.named_modules() if m is inner), None)
        if name is not None:
            return CompiledScope(root, inner, name)
    return None  # unreachable: the innermost module contains itself


def _compiled_on_its_own(module: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def _graph_instances(scope: CompiledScope, modules: dict[str, nn.Module]) -> list[str]:
    """The modules of the model that can run the graph compiled for `scope.module`: those of its
    class (before `separate_instances`). One inside another module compiled on its own
    (`Module.compile`, a torch.compile wrapper) runs inlined in that module's graph, not this one,
    unless the compiled module is inside one too (a graph break compiled it on its own)."""
    cls = _original_class(scope.module)
    compiled = [name for name, m in modules.items() if _compiled_on_its_own(m)]

    def inside_compiled(name: str) -> bool:
        return any(_within(name, c) and name != c for c in compiled)

    nested = inside_compiled(scope.name)
    return [name for name, m in modules.items() if _original_class(m) is cls and (nested or not inside_compiled(name))]


def model_linear_layers(scope: CompiledScope, graph_layers: Sequence[str]) -> list[str] | None:
    """The model's linear layers in forward order: for each module that can run this graph
    (`_graph_instances`), the graph's linear layers (`graph_layers`, names relative to
    `scope.module`, in the graph's order); the model's other nn.Linear modules in registration
    order. None when a graph layer is not a module of the model (the graph's names are not
    relative to the module found on the stack)."""
    modules = dict(scope.root.named_modules())
    if any(scope.model_name(name) not in modules for name in graph_layers):
        return None
    instances = set(_graph_instances(scope, modules))
    order: list[str] = []
    covered: str | None = None
    for name, module in modules.items():  # pre-order: an instance's submodules follow it
        if covered is not None and _within(name, covered):
            continue
        if name in instances:
            covered = name
            order += [layer for graph_name in graph_layers if (layer := _join(name, graph_name)) in modules]
        elif isinstance(module, nn.Linear):
            order.append(name)
    return order


def output_projection(root: nn.Module, layers: Sequence[str]) -> str | None:
    """The model's output projection, named anyhow: its last linear layer (`layers`, in forward
    order) when its weight is an embedding's (tied) or, for an nn.Linear, its out_features are
    the rows of the model's largest embedding (the token embedding's vocabulary)."""
    if not layers:
        return None
    modules = dict(root.named_modules())
    embeddings = [m for m in modules.values() if isinstance(m, nn.Embedding)]
    last = modules[layers[-1]]
    weight = getattr(last, "weight", None)
    if any(weight is e.weight for e in embeddings):
        return layers[-1]
    vocabulary = max((e.num_embeddings for e in embeddings), default=None)
    return layers[-1] if isinstance(last, nn.Linear) and last.out_features == vocabulary else None


def _subclass(cls: type, kept: frozenset[str]) -> type:
    if not kept:
        return cls
    key = (cls, kept)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, ORIGINAL_CLASS: cls,
            "__doc__": f"{cls.__qualname__} whose linear layers {sorted(kept)} an FP4 recipe keeps in high "
                       "precision: its own class, so that dynamo compiles it its own graph (mxcompile.model_layers)"})
    return _SUBCLASSES[key]


def separate_instances(scope: CompiledScope, graph_layers: Sequence[str], kept: set[str]) -> None:
    """When the modules that can run this graph do not all keep the same graph layers (`kept`:
    model names), move each one to the class of its decisions: its original class when it
    keeps none, else the subclass for the layers it keeps. A model compiled whole (one
    instance) is left as it is."""
    modules = dict(scope.root.named_modules())
    decisions = {name: frozenset(g for g in graph_layers if _join(name, g) in kept)
                 for name in _graph_instances(scope, modules)}
    if len(set(decisions.values())) <= 1:
        return
    moved = []
    for name, layers in decisions.items():
        cls = _subclass(_original_class(modules[name]), layers)
        if type(modules[name]) is not cls:
            modules[name].__class__ = cls
            moved.append(name)
    if moved and scope.root not in _WARNED_ROOTS:  # once per model
        _WARNED_ROOTS.add(scope.root)
        warnings.warn(
            f"mxcompile moved {len(moved)} module(s) of your {type(scope.root).__name__} ({', '.join(moved[:3])}"
            f"{', ...' if len(moved) > 3 else ''}) to a subclass of their class with the same name: the FP4 "
            "recipe keeps different layers of them in high precision (high_precision_layers counts the whole "
            "model's layers), and dynamo compiles one graph per class. isinstance checks and state_dict keys "
            "are unchanged; set high_precision_layers to module patterns that match whole blocks, or 0, to keep "
            "the classes.", MXSeparatedLayersWarning, stacklevel=2)


def decides_from_model(config: MXConfig) -> bool:
    """Whether a graph's decisions under `config` depend on its place in the model (an FP4
    recipe that keeps layers in high precision), which torch's compile-cache keys do not see."""
    fp4 = config.fp4
    return fp4 is not None and fp4.high_precision_layers not in (0, 0.0, ())


def recipe_high_precision(config: MXConfig, graph_layers: Sequence[str]) -> dict[str, str]:
    """The recipe's high-precision decisions for one graph's linear layers (`graph_layers`, its
    module names in forward order), with their reasons: decided from the whole model found on
    the stack, each instance that can run this graph moved to the class of its decisions
    (`separate_instances`); from the graph's layers alone when the model is not found (the
    module docstring)."""
    fp4 = config.fp4
    if fp4 is None or not decides_from_model(config) or not graph_layers:
        return {}
    scope = compiled_scope()
    names = scope.module_names(graph_layers) if scope is not None else None
    layers = model_linear_layers(scope, names) if scope is not None and names is not None else None
    if scope is None or names is None or layers is None:
        return fp4.high_precision_modules(graph_layers)
    head = output_projection(scope.root, layers)
    reasons = fp4.high_precision_modules(layers, heads=(head,) if head is not None else ())
    separate_instances(scope, names, set(reasons))
    where = f"; module '{{}}' of the {type(scope.root).__name__} model"
    return {graph_name: reasons[full] + (where.format(full) if full != graph_name else "")
            for graph_name, name in zip(graph_layers, names) if (full := scope.model_name(name)) in reasons}
