"""Repeated identical blocks (transformer layers): build the full problem from one block.

Usage: describe one block as a :class:`Problem` (its forward steps then its backward steps,
its saved tensors, ``baseline_bytes`` = bytes live during each step that belong to that step
only, e.g. workspace), then

    plan = plan_repeated(block, n_blocks, persistent_bytes=params_grads_optimizer_bytes)

which plans the full model under ``block.budget_bytes`` (the budget of the whole model).
:func:`repeat_block` lays the blocks out as a training step runs them: forward of block 0..n-1,
then backward of block n-1..0, each block's backward steps in the block's own order. Tensor
``name`` of block k is renamed ``"b{k}.name"``. Copies of one block tensor form a tie group:
they get one decision, so the ILP has one block's decision variables while memory is checked
at every step of the full schedule (blocks' activations overlap in time, so the blocks can
not be solved independently; tying them is the dedupe). Tying can cost optimality: e.g. with a
budget that needs only part of the blocks freed, the untied problem could free half of them.
"""

from __future__ import annotations

from .problem import Problem, SavedTensor, Step

BLOCK_NAME_FORMAT = "b{block}.{name}"


def repeat_block(block: Problem, n_blocks: int, *, persistent_bytes: int = 0) -> tuple[Problem, list[list[str]]]:
    """The ``n_blocks``-block problem and its tie groups (one group per block tensor).

    Args:
        block: one block; its ``budget_bytes`` is used as the full problem's budget.
        n_blocks: how many copies (>= 1).
        persistent_bytes: bytes live at every step of the full problem besides the blocks'
            own baselines (all parameters, gradients, optimizer state).
    """
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"n_blocks={n_blocks!r}: give an int >= 1")
    if isinstance(persistent_bytes, bool) or not isinstance(persistent_bytes, int) or persistent_bytes < 0:
        raise ValueError(f"persistent_bytes={persistent_bytes!r}: give a non-negative int")
    n_fwd = block.n_forward_steps
    n_bwd = len(block.steps) - n_fwd
    saved = set(block.tensor_index())

    def rename(k: int, name: str) -> str:
        return BLOCK_NAME_FORMAT.format(block=k, name=name)

    def fwd(k: int, j: int) -> int:
        return k * n_fwd + j

    def bwd(k: int, j: int) -> int:  # j: index into the block's steps, >= n_fwd
        return n_blocks * n_fwd + (n_blocks - 1 - k) * n_bwd + (j - n_fwd)

    steps: list[Step] = [None] * (n_blocks * len(block.steps))  # type: ignore[list-item]
    baseline = [0] * len(steps)
    for k in range(n_blocks):
        for j, step in enumerate(block.steps):
            index = fwd(k, j) if j < n_fwd else bwd(k, j)
            steps[index] = Step(rename(k, step.name), step.phase, step.compute_time_s)
            baseline[index] = block.baseline_bytes[j] + persistent_bytes
    tensors = []
    for k in range(n_blocks):
        for t in block.tensors:
            tensors.append(
                SavedTensor(
                    name=rename(k, t.name),
                    nbytes=t.nbytes,
                    produced_at=fwd(k, t.produced_at),
                    last_forward_use=fwd(k, t.last_forward_use),
                    first_backward_use=bwd(k, t.first_backward_use),
                    last_backward_use=bwd(k, t.last_backward_use),
                    recompute_cost_s=t.recompute_cost_s,
                    recompute_inputs=tuple(rename(k, n) for n in t.recompute_inputs),
                    recomputable=t.recomputable,
                    offloadable=t.offloadable,
                    recompute_work_bytes=t.recompute_work_bytes,
                )
            )
    resident = tuple(rename(k, n) for k in range(n_blocks) for n in block.resident_inputs if n not in saved)
    problem = Problem(
        steps=tuple(steps),
        tensors=tuple(tensors),
        baseline_bytes=tuple(baseline),
        budget_bytes=block.budget_bytes,
        resident_inputs=resident,
        host_link_bandwidth=block.host_link_bandwidth,
    )
    groups = [[rename(k, t.name) for k in range(n_blocks)] for t in block.tensors]
    return problem, groups
