"""Plain-number description of an activation-memory planning problem.

The planner decides, for every tensor the forward saves for the backward, one of

* ``"keep"``: stay on the device from production to the last backward use;
* ``"recompute"``: free it after its last forward use and recompute it in the backward,
  just before its first backward use;
* ``"offload"``: copy it to host memory after production, free the device copy, and
  prefetch it back before its first backward use, overlapped with compute.

Everything here is plain numbers (no torch, no torch.fx): the FX adapter turns the
partitioned forward/backward graphs into a :class:`Problem`, the solvers in this package
turn a :class:`Problem` into a plan.

Schedule
    ``steps`` is the whole training step in execution order: every forward step, then every
    backward step. A step is a unit of scheduling (an op or a fused group of ops) with an
    estimated compute time. Tensor positions are step *indices* into ``steps``.

Memory at a step
    The bytes resident *during* that step (its high-water mark): ``baseline_bytes[t]``
    (parameters, gradients, optimizer state, transient workspace, and every activation that
    is not a decision variable), plus every saved tensor resident at ``t`` under its decision
    (see :mod:`mxcompile.planner.memory` for the exact rules).

All byte counts are ints so that memory comparisons are exact; times are floats in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

KEEP = "keep"
RECOMPUTE = "recompute"
OFFLOAD = "offload"
DECISIONS: tuple[str, ...] = (KEEP, RECOMPUTE, OFFLOAD)

FORWARD = "forward"
BACKWARD = "backward"
PHASES: tuple[str, ...] = (FORWARD, BACKWARD)


class BudgetInfeasibleError(ValueError):
    """No assignment meets ``Problem.budget_bytes``.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_peak_bytes: the smallest peak the solver could reach; a budget of at least this
            many bytes is feasible (the solver found an assignment with that peak).
        min_peak_step: the step index at which that smallest peak occurs.
        exact: True when ``min_peak_bytes`` is proven minimal (ILP solved to optimality),
            False when it is the best the solver found (heuristic, or ILP time limit).
    """

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        min_peak_bytes: int,
        min_peak_step: int,
        exact: bool,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.min_peak_step = min_peak_step
        self.exact = exact


_BYTE_UNITS: tuple[tuple[str, int], ...] = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(nbytes: int | float) -> str:
    """Human-readable binary size, e.g. ``1.25 GiB``."""
    for unit, size in _BYTE_UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def budget_infeasible_error(
    problem: "Problem",
    *,
    min_peak_bytes: int,
    min_peak_step: int,
    exact: bool,
    solver: str,
) -> BudgetInfeasibleError:
    """The error raised when ``problem.budget_bytes`` cannot be met; the message states the
    smallest reachable budget and how to fix the configuration."""
    step = problem.steps[min_peak_step]
    baseline_peak = max(problem.baseline_bytes)
    baseline_step = problem.baseline_bytes.index(baseline_peak)
    how = (
        f"proven minimal by the {solver} solver"
        if exact
        else f"the smallest the {solver} solver found; the true minimum may be lower (try solver='ilp')"
    )
    message = (
        f"memory_budget of {format_bytes(problem.budget_bytes)} ({problem.budget_bytes} bytes) cannot be met: "
        f"the smallest reachable peak is {format_bytes(min_peak_bytes)} ({min_peak_bytes} bytes) at step "
        f"{min_peak_step} ({step.name!r}, {step.phase}), {how}. "
        f"Fix: raise memory_budget to at least {min_peak_bytes} bytes ({format_bytes(min_peak_bytes)})"
    )
    if baseline_peak > problem.budget_bytes:
        message += (
            f"; the baseline alone (parameters, gradients, workspace) needs {format_bytes(baseline_peak)} "
            f"at step {baseline_step}, so activation planning cannot help below that"
        )
    return BudgetInfeasibleError(
        message + ".",
        budget_bytes=problem.budget_bytes,
        min_peak_bytes=min_peak_bytes,
        min_peak_step=min_peak_step,
        exact=exact,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_nonneg_int(where: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where}={value!r}: give a non-negative int")


def _check_nonneg_time(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}={value!r}: give a finite, non-negative number of seconds")


@dataclass(frozen=True)
class Step:
    """One step of the forward-then-backward schedule.

    Attributes:
        name: for messages and plan reasons (e.g. the FX node name); need not be unique.
        phase: ``"forward"`` or ``"backward"``.
        compute_time_s: estimated compute time of the step in seconds. Host transfers overlap
            with it (see :mod:`mxcompile.planner.memory`).
    """

    name: str
    phase: str
    compute_time_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"Step.name={self.name!r}: give a str")
        if self.phase not in PHASES:
            raise ValueError(f"Step {self.name!r}: phase={self.phase!r} is not accepted; accepted: {list(PHASES)}")
        _check_nonneg_time(f"Step {self.name!r}: compute_time_s", self.compute_time_s)


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the forward saves for the backward: one decision variable.

    Attributes:
        name: unique among the problem's tensors.
        nbytes: device bytes of the tensor.
        produced_at: index of the forward step that produces it.
        last_forward_use: index of its last forward use (``>= produced_at``; equal when the
            forward does not read it again).
        first_backward_use: index of the backward step that first reads it.
        last_backward_use: index of the backward step that last reads it; None means the
            same as ``first_backward_use``. It is freed after this step.
        recompute_cost_s: seconds to recompute it from its ``recompute_inputs`` (the cost of
            this tensor's own op(s) only; recomputing inputs that are not resident is charged
            to those inputs, see :mod:`mxcompile.planner.memory`).
        recompute_inputs: what recomputing it reads: names of other saved tensors (whose
            own decision then matters: a chain) or of ``Problem.resident_inputs``.
        recomputable: False for tensors that cannot be recomputed bit-exactly, e.g. outputs
            of random ops whose RNG state is not preserved.
        offloadable: False for tensors that must not leave the device.
        recompute_work_bytes: bytes that replaying its recomputation holds besides the tensor
            itself (the closure's intermediates at their peak), live at the recompute step only.
    """

    name: str
    nbytes: int
    produced_at: int
    last_forward_use: int
    first_backward_use: int
    last_backward_use: int | None = None
    recompute_cost_s: float = 0.0
    recompute_inputs: tuple[str, ...] = ()
    recomputable: bool = True
    offloadable: bool = True
    recompute_work_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SavedTensor.name={self.name!r}: give a non-empty str")
        where = f"SavedTensor {self.name!r}"
        _check_nonneg_int(f"{where}: nbytes", self.nbytes)
        for field_name in ("produced_at", "last_forward_use", "first_backward_use"):
            _check_nonneg_int(f"{where}: {field_name}", getattr(self, field_name))
        if self.last_backward_use is None:
            object.__setattr__(self, "last_backward_use", self.first_backward_use)
        _check_nonneg_int(f"{where}: last_backward_use", self.last_backward_use)
        _check_nonneg_int(f"{where}: recompute_work_bytes", self.recompute_work_bytes)
        if self.last_forward_use < self.produced_at:
            raise ValueError(
                f"{where}: last_forward_use={self.last_forward_use} is before produced_at={self.produced_at}"
            )
        if self.first_backward_use <= self.last_forward_use:
            raise ValueError(
                f"{where}: first_backward_use={self.first_backward_use} must come after "
                f"last_forward_use={self.last_forward_use}"
            )
        if self.last_backward_use < self.first_backward_use:
            raise ValueError(
                f"{where}: last_backward_use={self.last_backward_use} is before "
                f"first_backward_use={self.first_backward_use}"
            )
        _check_nonneg_time(f"{where}: recompute_cost_s", self.recompute_cost_s)
        inputs = (self.recompute_inputs,) if isinstance(self.recompute_inputs, str) else self.recompute_inputs
        inputs = tuple(inputs)
        for inp in inputs:
            if not isinstance(inp, str):
                raise ValueError(f"{where}: recompute_inputs entry {inp!r} is not a name (str)")
        if self.name in inputs:
            raise ValueError(f"{where}: recompute_inputs lists the tensor itself")
        if len(set(inputs)) != len(inputs):
            raise ValueError(f"{where}: recompute_inputs={inputs!r} has duplicates")
        object.__setattr__(self, "recompute_inputs", inputs)
        for field_name in ("recomputable", "offloadable"):
            if not isinstance(getattr(self, field_name), bool):
                raise ValueError(f"{where}: {field_name}={getattr(self, field_name)!r}: give True or False")


@dataclass(frozen=True)
class Problem:
    """A complete planning problem.

    Attributes:
        steps: the schedule; every forward step precedes every backward step.
        tensors: the saved tensors (decision variables).
        baseline_bytes: bytes resident at each step that are not decision variables
            (parameters, gradients, workspace, unsaved activations); one int per step.
        budget_bytes: the device-memory budget; the peak over every step must not exceed it.
        resident_inputs: names that ``recompute_inputs`` may reference that are always
            resident (parameters, graph inputs the caller holds); their bytes are part of
            ``baseline_bytes``.
        host_link_bandwidth: bytes per second of the device-host link, one direction
            (e.g. ``DeviceProfile.host_link_bandwidth``). None disables offloading.
    """

    steps: tuple[Step, ...]
    tensors: tuple[SavedTensor, ...]
    baseline_bytes: tuple[int, ...]
    budget_bytes: int
    resident_inputs: tuple[str, ...] = ()
    host_link_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("steps", "tensors", "baseline_bytes", "resident_inputs"):
            value = getattr(self, field_name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ValueError(f"Problem.{field_name}={value!r}: give a sequence")
            object.__setattr__(self, field_name, tuple(value))
        for i, step in enumerate(self.steps):
            if not isinstance(step, Step):
                raise ValueError(f"Problem.steps[{i}]={step!r}: give a Step")
        for i, tensor in enumerate(self.tensors):
            if not isinstance(tensor, SavedTensor):
                raise ValueError(f"Problem.tensors[{i}]={tensor!r}: give a SavedTensor")
        n_steps = len(self.steps)
        n_forward = self.n_forward_steps
        if any(step.phase != BACKWARD for step in self.steps[n_forward:]):
            first_bad = next(i for i in range(n_forward, n_steps) if self.steps[i].phase != BACKWARD)
            raise ValueError(
                f"Problem.steps[{first_bad}] ({self.steps[first_bad].name!r}) is a forward step after a "
                "backward step; list every forward step first, then every backward step"
            )
        if len(self.baseline_bytes) != n_steps:
            raise ValueError(
                f"Problem.baseline_bytes has {len(self.baseline_bytes)} entries; give one per step ({n_steps})"
            )
        for t, value in enumerate(self.baseline_bytes):
            _check_nonneg_int(f"Problem.baseline_bytes[{t}]", value)
        if not _is_int(self.budget_bytes) or self.budget_bytes <= 0:
            raise ValueError(f"Problem.budget_bytes={self.budget_bytes!r}: give a positive int (bytes)")
        if self.host_link_bandwidth is not None:
            bw = self.host_link_bandwidth
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
                raise ValueError(
                    f"Problem.host_link_bandwidth={bw!r}: give positive bytes per second, or None to disable offload"
                )
        for name in self.resident_inputs:
            if not isinstance(name, str):
                raise ValueError(f"Problem.resident_inputs entry {name!r} is not a name (str)")
        self._check_tensors(n_forward, n_steps)

    def _check_tensors(self, n_forward: int, n_steps: int) -> None:
        names: dict[str, int] = {}
        for i, tensor in enumerate(self.tensors):
            if tensor.name in names:
                raise ValueError(
                    f"Problem.tensors[{i}].name={tensor.name!r} is used twice (also tensors[{names[tensor.name]}])"
                )
            names[tensor.name] = i
        clash = sorted(set(names) & set(self.resident_inputs))
        if clash:
            raise ValueError(f"Problem.resident_inputs names {clash} that are also saved tensors")
        resident = set(self.resident_inputs)
        for tensor in self.tensors:
            where = f"SavedTensor {tensor.name!r}"
            for field_name in ("produced_at", "last_forward_use"):
                index = getattr(tensor, field_name)
                if index >= n_forward:
                    raise ValueError(
                        f"{where}: {field_name}={index} is not a forward step (forward steps are 0..{n_forward - 1})"
                    )
            for field_name in ("first_backward_use", "last_backward_use"):
                index = getattr(tensor, field_name)
                if not n_forward <= index < n_steps:
                    raise ValueError(
                        f"{where}: {field_name}={index} is not a backward step "
                        f"(backward steps are {n_forward}..{n_steps - 1})"
                    )
            for inp in tensor.recompute_inputs:
                if inp in resident:
                    continue
                if inp not in names:
                    raise ValueError(
                        f"{where}: recompute_inputs names {inp!r}, which is neither a saved tensor nor in "
                        "Problem.resident_inputs"
                    )
                producer = self.tensors[names[inp]]
                if producer.produced_at > tensor.produced_at:
                    raise ValueError(
                        f"{where}: recompute_inputs names {inp!r}, produced at step {producer.produced_at}, "
                        f"after this tensor (step {tensor.produced_at})"
                    )
        self._check_acyclic(names)

    def _check_acyclic(self, names: dict[str, int]) -> None:
        state = [0] * len(self.tensors)  # 0 new, 1 on stack, 2 done
        for root in range(len(self.tensors)):
            if state[root]:
                continue
            stack: list[tuple[int, int]] = [(root, 0)]
            state[root] = 1
            while stack:
                node, pos = stack[-1]
                inputs = self.tensors[node].recompute_inputs
                if pos == len(inputs):
                    state[node] = 2
                    stack.pop()
                    continue
                stack[-1] = (node, pos + 1)
                nxt = names.get(inputs[pos])
                if nxt is None:
                    continue
                if state[nxt] == 1:
                    raise ValueError(
                        f"SavedTensor {self.tensors[nxt].name!r}: recompute_inputs form a cycle through "
                        f"{self.tensors[node].name!r}"
                    )
                if state[nxt] == 0:
                    state[nxt] = 1
                    stack.append((nxt, 0))

    @property
    def n_forward_steps(self) -> int:
        """Number of forward steps (they are steps 0..n_forward_steps-1)."""
        count = 0
        for step in self.steps:
            if step.phase != FORWARD:
                break
            count += 1
        return count

    def tensor_index(self) -> dict[str, int]:
        """Name -> index into ``tensors``."""
        return {tensor.name: i for i, tensor in enumerate(self.tensors)}

    def transfer_time_s(self, tensor: SavedTensor) -> float | None:
        """One-direction host-link transfer time of ``tensor``: nbytes / host_link_bandwidth,
        or None when offloading is disabled."""
        if self.host_link_bandwidth is None:
            return None
        return tensor.nbytes / self.host_link_bandwidth

    def allowed_decisions(self, tensor: SavedTensor) -> tuple[str, ...]:
        """The decisions open to ``tensor`` (keep is always open)."""
        allowed = [KEEP]
        if tensor.recomputable:
            allowed.append(RECOMPUTE)
        if tensor.offloadable and self.host_link_bandwidth is not None:
            allowed.append(OFFLOAD)
        return tuple(allowed)
