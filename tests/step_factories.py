"""Step factories that fresh-process tests name as "step_factories:NAME" (tests/ is on the
child's PYTHONPATH there)."""

from __future__ import annotations

from typing import Callable

import torch


def compiled_linear_step() -> Callable[[], None]:
    """A step factory for fresh-process timing tests: a new nn.Linear compiled by Dynamo with a
    recording backend; the step fails if its module ran without being compiled (Dynamo falls
    back to eager silently once a code object's recompile limit is hit)."""
    compiled: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled.append(gm)
        return gm.forward

    fn = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    x = torch.randn(2, 4)

    def step() -> None:
        fn(x)
        if not compiled:
            raise RuntimeError("the step ran without being compiled (Dynamo fell back to eager)")

    return step
