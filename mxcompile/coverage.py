"""Which nn.Linear layers of a compiled model never reach the `mxfp8` backend.

The backend only sees what dynamo traces. Dynamo does not start tracing in a frame whose code
lies in torch itself (its skip list, `torch._dynamo.trace_rules`): a torch.nn module's
`forward` (nn.Linear, nn.Sequential, ...) is traced only when it is inlined into a frame that
dynamo is already tracing. Frames restart, and torch.nn forwards then run eagerly in full
precision, in these cases (torch 2.13, checked with a backend that records its calls):

* `Module.compile(backend=...)` compiles `module._call_impl`, which torch does not wrap in a
  traceable frame (`torch.compile(module)` does, see `OptimizedModule._initialize`): on an
  nn.Linear or nn.Sequential the backend is never called.
* `torch.compile(DistributedDataParallel(model))`: DDP's forward graph-breaks on a disabled
  context manager before calling `model`, so `model`'s forward starts a new frame.
* FSDP2 units: `fully_shard` installs `torch._dynamo.disable`d hooks, so every unit's forward
  starts a new frame, whether the root or the unit itself was passed to `torch.compile`.

In none of these cases is any code of the backend run (the backend compiles no graph at all),
so the backend cannot warn at run time: `torch.compile` keeps no per-call hook of a string
backend (`_TorchCompileWrapper` drops `backend_ctx_ctor`). `uncompiled_linears` finds these
layers from the module tree instead; `mxcompile.compile` and the helpers of
`mxcompile.distributed` warn with it, and users of plain `torch.compile` can call it.

The rule it applies: a module's forward is traced when it is inlined (called from a traced
frame without a graph break) or when it starts a frame that dynamo traces (its code is not
in torch, or it was compiled on its own: `torch.compile(module)`, `module.forward =
torch.compile(module.forward)`). Calls of FSDP units and DDP's call of its module break the
graph. It does not model graph breaks inside user code (a user forward whose loop
graph-breaks runs eagerly as a whole; modules it calls start new frames).
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Iterator

from torch import nn

__all__ = ["Usage", "UncompiledLinear", "uncompiled_linears", "warn_uncompiled"]


class Usage(enum.Enum):
    """How the layer's caller kept it from being traced; each has a usage that works."""

    MODULE_COMPILE = "Module.compile(backend=...) on a module whose forward is torch.nn code"
    DDP = "torch.compile(DistributedDataParallel(model)) with a model whose forward is torch.nn code"
    FSDP = "an FSDP2 unit whose forward is torch.nn code, called by a compiled module"
    NOT_TRACED = "called eagerly by torch.nn code that dynamo does not trace"


_FIX = {
    Usage.MODULE_COMPILE: "use `model = torch.compile(model, backend=\"mxfp8\")` (or mxcompile.compile(model)), "
                          "which adds a traceable frame around torch.nn modules",
    Usage.DDP: "compile the model inside DDP: `DistributedDataParallel(torch.compile(model, backend=\"mxfp8\"))`",
    Usage.FSDP: "shard and compile with `mxcompile.distributed.fully_shard(model, mesh, config=...)`, which "
                "compiles every FSDP unit's forward",
    Usage.NOT_TRACED: "compile the module itself with `torch.compile(module, backend=\"mxfp8\")`",
}


@dataclass(frozen=True)
class UncompiledLinear:
    """An nn.Linear that runs outside every graph the backend compiles, and why."""

    module: str  # qualified name under the model given to uncompiled_linears
    usage: Usage
    caller: str  # the module whose call started the untraced frame

    def __post_init__(self) -> None:
        if not isinstance(self.usage, Usage):
            raise ValueError(f"usage must be a Usage, got {self.usage!r}")

    @property
    def fix(self) -> str:
        return _FIX[self.usage]

    def __str__(self) -> str:
        return (f"{self.module or '<root>'} ({self.usage.value}; from {self.caller or '<root>'}) "
                f"runs in full precision: {self.fix}")


def _is_compiled_callable(fn: object) -> bool:
    """torch.compile(fn) returns a wrapper that keeps the original callable."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def _forward_starts_traced_frame(module: nn.Module) -> bool:
    """Whether dynamo traces this module's forward when it is called from an untraced frame."""
    from torch._dynamo import trace_rules

    forward = module.forward
    if _is_compiled_callable(forward):
        return True
    return not trace_rules.check(forward)


def _breaks_graph(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_ddp(module: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def _compiled_on_its_own(module: nn.Module) -> bool:
    """Module.compile or a compiled forward: the user meant this module to be compiled."""
    return getattr(module, "_compiled_call_impl", None) is not None or _is_compiled_callable(module.forward)


def _walk(module: nn.Module, name: str, traced_caller: bool, in_compiled: bool, caller: str,
          usage: Usage) -> Iterator[UncompiledLinear]:
    """Visit `module`, called from a frame that dynamo traces (`traced_caller`) or not;
    `in_compiled`: some module on the path was compiled, so eager layers below are unexpected."""
    from torch._dynamo.eval_frame import OptimizedModule

    def child_name(child: str) -> str:
        return f"{name}.{child}" if name else child

    if isinstance(module, OptimizedModule):  # torch.compile(module): a traced frame of its own
        yield from _walk(module._orig_mod, name, True, True, name, usage)
        return
    if _is_ddp(module):
        yield from _walk(module.module, child_name("module"), False, in_compiled, name, Usage.DDP)
        return
    inlined = traced_caller and not _breaks_graph(module)
    if _breaks_graph(module):
        caller, usage = name, Usage.FSDP
    if getattr(module, "_compiled_call_impl", None) is not None and not inlined:
        # Module.compile: the compiled `_call_impl` frame is in torch, so this is traced only
        # if the forward it calls is.
        caller, usage = name, Usage.MODULE_COMPILE
    in_compiled = in_compiled or _compiled_on_its_own(module)
    traced = inlined or _forward_starts_traced_frame(module)
    if isinstance(module, nn.Linear) and not traced and in_compiled:
        yield UncompiledLinear(name, usage, caller)
    if not traced:
        caller = name
    for child, submodule in module.named_children():
        yield from _walk(submodule, child_name(child), traced, in_compiled, caller, usage)


def uncompiled_linears(model: nn.Module, *, compiled: bool = False) -> list[UncompiledLinear]:
    """The nn.Linear layers of `model` that no compiled graph contains when `model` is called,
    among those under a compiled module (layers the user never compiled are not listed).

    `compiled=True` when `model` itself is about to be passed to torch.compile
    (mxcompile.compile asks before compiling).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"uncompiled_linears takes an nn.Module, got {type(model).__name__}")
    return list(_walk(model, "", compiled, compiled, "", Usage.NOT_TRACED))


def warn_uncompiled(model: nn.Module, *, compiled: bool = False, stacklevel: int = 2) -> list[UncompiledLinear]:
    """One warning naming every layer `uncompiled_linears` finds, grouped by usage with the
    usage that works; returns the layers."""
    found = uncompiled_linears(model, compiled=compiled)
    if found:
        groups: dict[Usage, list[str]] = {}
        for layer in found:
            groups.setdefault(layer.usage, []).append(layer.module or "<root>")
        lines = "\n".join(f"  {usage.value}: {', '.join(names)}; {_FIX[usage]}" for usage, names in groups.items())
        warnings.warn(
            f"mxfp8: {len(found)} nn.Linear layer(s) of {type(model).__name__} are never traced by dynamo, "
            f"so the mxfp8 backend never sees them and they train in full precision:\n{lines}",
            stacklevel=stacklevel + 1,
        )
    return found
