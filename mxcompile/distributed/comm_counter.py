"""Count the bytes torch.distributed collectives move, by wrapping the Python entry points.

Payload bytes per call are the bytes this rank contributes: its shard for an all-gather, the
full input for a reduce-scatter, the tensor for an all-reduce or broadcast. FSDP2 and
`all_gather_mx_weight` call these entry points; DDP's reducer (C++) and the functional
collectives inside compiled graphs (`_c10d_functional.*`, tensor parallelism) do not, and are
not counted.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

# Collective name -> (positional index, keyword name) of the tensor whose bytes are the payload.
_PAYLOAD_ARG: dict[str, tuple[int, str]] = {
    "all_gather_single": (1, "input_tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_to_all_single": (1, "input"),
}
# Aliases that may call each other: both are wrapped, only the outermost call counts.
_KIND = {
    "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce", "broadcast": "broadcast", "all_to_all_single": "all_to_all",
}

__all__ = ["CollectiveCounter", "CollectiveTotals"]


@dataclass
class CollectiveTotals:
    """Calls and payload bytes per collective kind ("all_gather", "reduce_scatter", ...)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "total_bytes": self.total_bytes}


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    index, keyword = _PAYLOAD_ARG[name]
    tensor = args[index] if len(args) > index else kwargs.get(keyword)
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


class CollectiveCounter:
    """Context manager: while active, every wrapped collective adds its payload to `totals`.

        with CollectiveCounter() as counter:
            train_step()
        counter.totals.bytes["all_gather"]
    """

    def __init__(self) -> None:
        self.totals = CollectiveTotals()
        self._saved: dict[str, Callable[..., Any]] = {}
        self._depth = threading.local()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                kind = _KIND[name]
                self.totals.calls[kind] += 1
                self.totals.bytes[kind] += _payload(name, args, kwargs)
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> "CollectiveCounter":
        if self._saved:
            raise RuntimeError("CollectiveCounter is already active; it is not reentrant")
        for name in _PAYLOAD_ARG:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def reset(self) -> None:
        self.totals = CollectiveTotals()
