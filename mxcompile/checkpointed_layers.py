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
`_gradient_checkpointing_func` is wrapped (`LayerCompiledCheckpoint`) so that HF's own
checkpoint function (its kwargs, `use_reentrant`, offloading: unchanged) runs the layer's
forward through one `torch.compile`d function with the same mxcompile backend. The
checkpointing stays: only the layer inputs are saved, and the backward recomputes the layer,
now a compiled MX graph (reentrant: an inference graph in the forward, the joint graph in the
recomputation; non-reentrant: the joint graph both times).

The backend applies it (`compile_checkpointed_layers`) when it compiles a graph: the modules it
looks at are the `self` of the Python frames on the stack (`modules_on_stack`): dynamo compiles
the graphs of a model while its forward runs, so the model is one of them, whichever way it was
compiled (`torch.compile`, `Module.compile`, `mxcompile.compile`). It warns once per call that
changes layers (`MXCheckpointingWarning`), naming them.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Callable, Hashable

import torch
from torch import nn

__all__ = [
    "LayerCompiledCheckpoint",
    "MXCheckpointingWarning",
    "checkpointed_layers",
    "compile_checkpointed_layers",
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


# backend settings -> the compiled `_run_layer` for them. Dynamo guards each compiled entry on
# its backend object, so every layer (and every model) compiled with the same settings must get
# the same runner, or each would compile its own graph and soon hit dynamo's recompile limit.
_RUNNERS: dict[Hashable, Callable] = {}


def _layer_runner(backend_key: Hashable, backend: Callable) -> Callable:
    if backend_key not in _RUNNERS:
        _RUNNERS[backend_key] = torch.compile(_run_layer, backend=backend)
    return _RUNNERS[backend_key]


class LayerCompiledCheckpoint:
    """Stands in for a layer's HF `_gradient_checkpointing_func`: calls HF's checkpoint
    function, unchanged, on the layer's forward compiled by `run_layer`."""

    def __init__(self, checkpoint: Callable[..., Any], run_layer: Callable[..., Any]) -> None:
        self.checkpoint = checkpoint  # HF's function: functools.partial(checkpoint, use_reentrant=...)
        self.run_layer = run_layer

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(self.run_layer, function, *args, **kwargs)


def checkpointed_layers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of `root`'s layers that HF gradient checkpointing is on for and that
    still call HF's own checkpoint function (not yet a `LayerCompiledCheckpoint`)."""
    found = []
    for name, module in root.named_modules():
        function = getattr(module, CHECKPOINT_FUNCTION, None)
        if getattr(module, CHECKPOINT_FLAG, False) is True and callable(function) \
                and not isinstance(function, LayerCompiledCheckpoint):
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


def compile_checkpointed_layers(roots: list[nn.Module], backend_key: Hashable, backend: Callable,
                                *, stacklevel: int = 2) -> list[str]:
    """Route every HF-checkpointed layer under `roots` through the layer runner of `backend`
    (`LayerCompiledCheckpoint`); returns the names of the layers changed, and warns once for
    them (`MXCheckpointingWarning`). `backend_key` identifies the backend's settings, so that
    every model compiled with the same settings shares one runner."""
    changed = []
    for root in roots:
        layers = checkpointed_layers(root)
        if not layers:
            continue
        run_layer = _layer_runner(backend_key, backend)
        for name, layer in layers:
            setattr(layer, CHECKPOINT_FUNCTION,
                    LayerCompiledCheckpoint(getattr(layer, CHECKPOINT_FUNCTION), run_layer))
        names = [name for name, _ in layers]
        changed.extend(names)
        shown = ", ".join(names[:LAYER_NAMES_SHOWN]) + (f", ... ({len(names)} in all)"
                                                       if len(names) > LAYER_NAMES_SHOWN else "")
        warnings.warn(
            f"mxcompile: {type(root).__name__} uses Hugging Face gradient checkpointing, which dynamo cannot "
            f"trace (its layers would run eagerly in full precision); each checkpointed layer is compiled on "
            f"its own with the same mxcompile settings instead, still checkpointed by HF's function: {shown}",
            MXCheckpointingWarning, stacklevel=stacklevel + 1)
    return changed
