"""Hugging Face gradient checkpointing in MX: each checkpointed layer compiled on its own.

With `model.gradient_checkpointing_enable()` (or the Trainer's `gradient_checkpointing=True`),
every HF decoder layer calls `self._gradient_checkpointing_func(partial(forward, self, ...),
*args)`: `torch.utils.checkpoint.checkpoint`, reentrant or not. Dynamo cannot trace that call
as its checkpoint higher-order op (torch 2.13, transformers 5.25: HF's output-capture context
variable is mutated inside the checkpointed region, and a `logger.warning_once` breaks the
graph), so it breaks the graph in the layer loop and runs the whole loop eagerly, in full
precision; `torch.utils.checkpoint.checkpoint` is itself `torch._disable_dynamo`, so nothing
under it is compiled either. The backend never sees those GEMMs.

mxcompile changes the form, as torchtitan compiles its blocks: each checkpointed layer's
`_gradient_checkpointing_func` is wrapped (`layer_compiled_checkpoint`) so that HF's own
checkpoint function (its kwargs, `use_reentrant`, offloading: unchanged) runs the layer's
forward through one `torch.compile`d function with the same mxcompile backend. The
checkpointing stays: only the layer inputs are saved, and the backward recomputes the layer,
now a compiled MX graph (reentrant: an inference graph in the forward, the joint graph in the
recomputation; non-reentrant: the joint graph both times).

The backend finds the layers (`layer_compiles`) when it compiles a graph, among the modules
that are the `self` of the Python frames on the stack (`modules_on_stack`): dynamo compiles the
graphs of a model while its forward runs, so the model is one of them, whichever way it was
compiled (`torch.compile`, `Module.compile`, `mxcompile.compile`). It swaps their checkpoint
functions at the graph's first run (`LayerCompiles.apply`), before the layers run, and warns
once per model (`MXCheckpointingWarning`), naming them.

An FP4 recipe decides a layer graph's high-precision layers from the whole model
(model_layers.py), but the runner's graphs are compiled where no model may be on the stack (a
reentrant checkpoint compiles the joint graph in the backward): `layer_of_runner` finds the
layer a runner frame runs, `model_of` the model whose layers `LayerCompiles.apply` swapped.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch import nn

__all__ = [
    "layer_compiled_checkpoint",
    "MXCheckpointingWarning",
    "checkpointed_layers",
    "LayerCompiles",
    "layer_compiles",
    "layer_of_runner",
    "model_of",
    "modules_on_stack",
]

# HF's protocol (transformers' `GradientCheckpointingLayer` and `_set_gradient_checkpointing`):
# a layer checkpoints when this flag is True, through the function in CHECKPOINT_FUNCTION.
CHECKPOINT_FLAG = "gradient_checkpointing"
CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
LAYER_NAMES_SHOWN = 4


class MXCheckpointingWarning(UserWarning):
    """mxcompile changed how HF's gradient-checkpointed layers are compiled, so that they run in MX."""


def _run_layer(function: Callable[..., Any], *args: Any) -> Any:
    """What each checkpointed layer's compiled function runs: HF's `partial(forward, layer,
    **kwargs)` on the layer's positional inputs. One code object for every layer, so dynamo
    compiles one graph that every layer of the same structure shares."""
    return function(*args)


def layer_of_runner(code: types.CodeType, local_values: dict[str, Any]) -> tuple[int, nn.Module] | None:
    """The layer that a `_run_layer` frame runs (`code` and `local_values`: the frame's, as
    dynamo traces it) and its index among the positional arguments of its `function`, HF's
    partial(forward, layer, **kwargs); None for a frame of any other code."""
    function = local_values.get("function")
    if code is not _run_layer.__code__ or not isinstance(function, functools.partial):
        return None
    return next(((i, a) for i, a in enumerate(function.args) if isinstance(a, nn.Module)), None)


# layer -> its model, for the layers whose checkpoint function `LayerCompiles.apply` swapped
# (weak both ways: the model holds the layer, so a strong value would keep the key alive).
_MODELS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()


def model_of(layer: nn.Module) -> nn.Module | None:
    """The model whose checkpointed layer `layer` is (`LayerCompiles.root`), None if unknown."""
    root = _MODELS.get(layer)
    return root() if root is not None else None


# backend settings -> the compiled `_run_layer` for them. Dynamo guards each compiled entry on
# its backend object, so every layer (and every model) compiled with the same settings must get
# the same runner, or each would compile its own graph and soon hit dynamo's recompile limit.
_RUNNERS: dict[Hashable, Callable] = {}


def _layer_runner(backend_key: Hashable, backend: Callable) -> Callable:
    if backend_key not in _RUNNERS:
        _RUNNERS[backend_key] = torch.compile(_run_layer, backend=backend)
    return _RUNNERS[backend_key]


def _checkpoint_compiled_layer(checkpoint: Callable[..., Any], run_layer: Callable[..., Any],
                               function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """HF's checkpoint call with the layer's forward compiled by `run_layer`: `checkpoint` is the
    function HF's partial wraps (torch.utils.checkpoint.checkpoint), `kwargs` its keywords."""
    return checkpoint(run_layer, function, *args, **kwargs)


def layer_compiled_checkpoint(hf_function: Callable[..., Any], run_layer: Callable[..., Any]) -> functools.partial:
    """What stands in for a layer's HF `_gradient_checkpointing_func` (`hf_function`, usually
    functools.partial(checkpoint, use_reentrant=...)): a partial with the same keywords, so the
    checkpoint runs exactly as HF's would, on the compiled forward. Same keywords, because
    dynamo guards the layer frames it traced on them (a guard on `keywords["use_reentrant"]`)."""
    if isinstance(hf_function, functools.partial) and not hf_function.args:
        return functools.partial(_checkpoint_compiled_layer, hf_function.func, run_layer, **hf_function.keywords)
    return functools.partial(_checkpoint_compiled_layer, hf_function, run_layer)


def _is_layer_compiled(function: Any) -> bool:
    return isinstance(function, functools.partial) and function.func is _checkpoint_compiled_layer


def checkpointed_layers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of `root`'s layers that HF gradient checkpointing is on for and that
    still call HF's own checkpoint function (not yet `layer_compiled_checkpoint`'s)."""
    found = []
    for name, module in root.named_modules():
        function = getattr(module, CHECKPOINT_FUNCTION, None)
        if getattr(module, CHECKPOINT_FLAG, False) is True and callable(function) and not _is_layer_compiled(function):
            found.append((name, module))
    return found


def modules_on_stack(frame: types.FrameType | None = None) -> list[nn.Module]:
    """The outermost nn.Modules among the `self` of the Python frames from `frame` (default:
    the caller's) to the bottom of the stack, a torch.compile wrapper as the module it wraps;
    a module inside another one found is left out."""
    from torch._dynamo.eval_frame import OptimizedModule

    frame = frame if frame is not None else sys._getframe(1)
    found: dict[int, nn.Module] = {}
    while frame is not None:
        module = frame.f_locals.get("self")
        if isinstance(module, OptimizedModule):
            module = module._orig_mod
        if isinstance(module, nn.Module):
            found.setdefault(id(module), module)
        frame = frame.f_back
    inner = {id(sub) for m in found.values() for sub in m.modules() if sub is not m}
    return [m for key, m in found.items() if key not in inner]


@dataclass(frozen=True)
class LayerCompiles:
    """The checkpointed layers of one model (`root`) to route through one layer runner."""

    root: nn.Module
    layers: tuple[tuple[str, nn.Module], ...]
    run_layer: Callable[..., Any]

    def apply(self, *, stacklevel: int = 2) -> list[str]:
        """Swap each layer's checkpoint function (those still HF's) and warn once naming them;
        returns their names."""
        layers = [(name, layer) for name, layer in self.layers
                  if not _is_layer_compiled(getattr(layer, CHECKPOINT_FUNCTION, None))]
        for _, layer in layers:
            _MODELS[layer] = weakref.ref(self.root)
            setattr(layer, CHECKPOINT_FUNCTION, layer_compiled_checkpoint(getattr(layer, CHECKPOINT_FUNCTION),
                                                                          self.run_layer))
        names = _innermost([name for name, _ in layers])
        if names:
            shown = ", ".join(names[:LAYER_NAMES_SHOWN]) + (f", ... ({len(names)} in all)"
                                                           if len(names) > LAYER_NAMES_SHOWN else "")
            warnings.warn(
                f"mxcompile: {type(self.root).__name__} uses Hugging Face gradient checkpointing, which dynamo "
                f"cannot trace (its layers would run eagerly in full precision); each checkpointed layer is "
                f"compiled on its own with the same mxcompile settings instead, still checkpointed by HF's "
                f"function: {shown}", MXCheckpointingWarning, stacklevel=stacklevel + 1)
        return [name for name, _ in layers]


def _innermost(names: list[str]) -> list[str]:
    """The names with no other name below them (HF flags a model's container, e.g. `model`,
    beside its layers; the layers are what a user recognises)."""
    return [n for n in names if not any(other != n and (not n or other.startswith(n + ".")) for other in names)]


def layer_compiles(roots: list[nn.Module], backend_key: Hashable, backend: Callable) -> list[LayerCompiles]:
    """For each of `roots` with HF-checkpointed layers, those layers and the layer runner of
    `backend` (`backend_key` identifies its settings: every model compiled with the same
    settings shares one runner). Nothing is changed until `LayerCompiles.apply`: the backend
    applies them at the first run of the graph it compiled, not while dynamo still builds the
    guards of the frame it is tracing, which read the checkpoint function."""
    return [LayerCompiles(root, tuple(layers), _layer_runner(backend_key, backend))
            for root in roots if (layers := checkpointed_layers(root))]
