"""The offload / reload ops the memory plan inserts (`mxcompile.passes.memory_plan`).

    mxcompile::offload(x) -> a copy of x in host memory
    mxcompile::reload(x, device) -> a copy of x on device

Offload on CUDA is a plain ``.to("cpu", non_blocking=True)`` on the compute stream, into
pageable memory: correct, but not overlapped with compute as the planner's model assumes
(pinned buffers and a side stream are future work). On CPU the "host" is the same memory, so
an offload is a real copy that saves nothing: it exists to exercise the mechanism. Both ops
stay opaque through lowering; their one implementation serves every device.
"""

from __future__ import annotations

import torch

HOST_DEVICE = torch.device("cpu")


@torch.library.custom_op("mxcompile::offload", mutates_args=())
def offload_op(x: torch.Tensor) -> torch.Tensor:
    """Copy a saved activation to host memory (a new tensor, even on CPU)."""
    return x.to(HOST_DEVICE, copy=True, non_blocking=x.device.type != HOST_DEVICE.type)


@offload_op.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device=HOST_DEVICE)


@torch.library.custom_op("mxcompile::reload", mutates_args=())
def reload_op(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy an offloaded activation back to ``device`` (a new tensor)."""
    return x.to(device, copy=True)


@reload_op.register_fake
def _reload_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


# The overloads the memory plan inserts into graphs.
OFFLOAD = torch.ops.mxcompile.offload.default
RELOAD = torch.ops.mxcompile.reload.default
