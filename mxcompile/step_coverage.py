"""What share of a training step's GEMM FLOPs ran in MX, measured at run time.

The reports say what each compiled graph converted; they cannot see GEMMs that ran outside every
compiled graph: after a graph break inside user or library code (HF gradient checkpointing was
one), dynamo runs the code between graphs eagerly, in full precision, and the backend is never
told. So the first training step after mxcompile compiled its graphs is measured:

* The window opens at the second call, with gradients enabled and outside any backward pass, of
  a compiled graph not measured yet: the first training step after the one that compiled it.
  Not the compile step itself: torch.profiler recording the compilation's fake-tensor ops (with
  shapes) made the process crash while garbage-collecting, now and then (torch 2.13).
* The step ends when a backward pass that ran through a graph of the window is over (an
  autograd hook on each call's compiled backward node counts its run; a backward nested in
  another, as reentrant checkpointing runs, is not the end). The window closes at the first
  point after that which the training loop passes: where `torch.autograd.backward` (which
  `Tensor.backward` calls) returns, an optimizer step (a global optimizer-step pre-hook), or
  `end_measured_step`/`report_of`/`step_coverage_of`; the first two are hooked only while the
  window is open or its profiler awaits its stop (`AfterBackward`). It also closes, with what it saw, when another step begins
  without a backward: a graph called again, outside any backward, on the same first parameter,
  or a graph of another model.
* Where the profiler stops: only outside compiled code (`inside_compiled_code`: no frame dynamo
  rewrote on the stack). Stopping torch.profiler inside a compiled frame, under the "Torch-Compiled
  Region" event it saw begin, corrupted the heap now and then (torch 2.13 CPU: processes died at
  exit). A window closed inside compiled code (a forward-only step, a backward called inside a
  compiled function) switches the profiler's collection off there (torch prints one warning
  line for it) and stops it at the next of the close points above that runs outside.
* In the window, torch.profiler (CPU ops, with shapes) records every op, and each call of an
  mxcompile graph is marked (`GRAPH_CALL_MARKER`). A GEMM (`aten::mm`, `addmm`, `bmm`,
  `baddbmm`, `_grouped_mm`) or attention op (SDPA's forward and its fused backwards) ran
  eagerly when no enclosing event is an mxcompile graph call, a compiled backward, Inductor's
  call of a compiled graph, an mxcompile op, or dynamo's compilation (which runs fake or
  calibration GEMMs). Its FLOPs come from its recorded shapes; the module it belongs to from the
  parameter whose storage it read.
* The compiled graphs' GEMM FLOPs come from their reports: a graph's forward GEMMs once per
  call, its backward GEMMs once per run of its backward (a forward recomputed by non-reentrant
  checkpointing runs no backward of its own).

The share is `StepCoverage.mx_flop_fraction`: converted GEMM FLOPs of the compiled graphs over all
GEMM FLOPs of the step, eager ones included. Under `WARN_BELOW_FRACTION` it warns once
(`MXEagerWarning`) with the modules that ran eagerly, the graph breaks dynamo recorded and what
to do. Graphs compiled by other backends are not counted on either side.

Cost: the profiler runs during one step, the second (`StepCoverage.measure_seconds` is the time
spent reading the profile at its end). After the window closes, a graph call pays one attribute
check and nothing else stays hooked. No window opens while another profiler runs
(`torch.profiler` sessions cannot nest); that graph is then not measured.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["MXEagerWarning", "StepCoverage", "StepMonitor", "eager_gemm_flops"]

WARN_BELOW_FRACTION = 0.90
GRAPH_CALL_MARKER = "mxcompile.compiled_graph"
NO_GRAPH_TASK = -1  # torch._C._current_graph_task_id() outside every backward pass
# Kineto prints two lines ("USDT: ... profiler_start", "... profiler_stop") at every start and stop
# of torch.profiler below this log level, which it reads from the environment once, when a
# profiler first starts in the process (torch 2.13: 5 prints them, 6 does not). A measurement the
# user did not ask for sets it, unless the user did: kineto's own messages are then quiet in
# this process.
KINETO_LOG_LEVEL_ENV, QUIET_KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL", "6"
# Events under which a GEMM is not an eager one: a compiled backward (AOTAutograd's autograd
# node), Inductor's call of its compiled code, an mxcompile op, dynamo's compile (its timed
# regions are named "<stage> (dynamo_timed)").
COMPILED_BACKWARD_EVENT = "CompiledFunctionBackward"
INDUCTOR_CALL_PREFIX = "## Call CompiledFxGraph"
MXCOMPILE_OP_PREFIX = "mxcompile::"
COMPILE_EVENT_SUFFIX = "(dynamo_timed)"

FLOPS_PER_MULTIPLY_ADD = 2
# SDPA's forward is two GEMMs (Q Kᵀ, P V) and its backward four (dV, dP, dQ, dK).
ATTENTION_FORWARD_GEMMS, ATTENTION_BACKWARD_GEMMS = 2, 4
MODULES_SHOWN = 6
GRAPH_BREAKS_SHOWN = 3


class GemmOp(enum.Enum):
    """The aten GEMMs a step's profile is searched for, by profiler event name."""

    MM = "aten::mm"
    ADDMM = "aten::addmm"
    BMM = "aten::bmm"
    BADDBMM = "aten::baddbmm"
    GROUPED_MM = "aten::_grouped_mm"


ATTENTION_FORWARD_OPS = frozenset({"aten::scaled_dot_product_attention"})
ATTENTION_BACKWARD_OPS = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
})
_GEMM_NAMES = {op.value: op for op in GemmOp}
# The first tensor operand of each GEMM (addmm and baddbmm take the bias first).
_FIRST_OPERAND = {GemmOp.MM: 0, GemmOp.ADDMM: 1, GemmOp.BMM: 0, GemmOp.BADDBMM: 1, GemmOp.GROUPED_MM: 0}


class MXEagerWarning(UserWarning):
    """A large share of a training step's GEMM FLOPs ran outside every mxcompile graph."""


def eager_gemm_flops(name: str, shapes: Sequence[Sequence[int] | None]) -> int:
    """FLOPs of one profiled GEMM or attention op from its input shapes (None: not a tensor).
    GEMMs: 2 M N K times the batch; `_grouped_mm`: 2 M N K over all groups (each row, or each
    contraction index, belongs to one group); SDPA: 2 L S D per head and GEMM, D the mean of the
    query/key and value widths. 0 for any other op."""
    if name in ATTENTION_FORWARD_OPS or name in ATTENTION_BACKWARD_OPS:
        first = 1 if name in ATTENTION_BACKWARD_OPS else 0  # the backward's first input is grad_out
        q, k, v = shapes[first:first + 3]
        if q is None or k is None or v is None:
            return 0
        heads = 1
        for size in q[:-2]:
            heads *= size
        gemms = ATTENTION_BACKWARD_GEMMS if name in ATTENTION_BACKWARD_OPS else ATTENTION_FORWARD_GEMMS
        width = (q[-1] + v[-1]) / 2
        return int(FLOPS_PER_MULTIPLY_ADD * gemms * heads * q[-2] * k[-2] * width)
    op = _GEMM_NAMES.get(name)
    if op is None:
        return 0
    first = _FIRST_OPERAND[op]
    a, b = shapes[first], shapes[first + 1]
    if a is None or b is None:
        return 0
    if op is GemmOp.GROUPED_MM and len(a) == 2:  # rows split (2-D x 3-D) or contraction split (2-D x 2-D)
        return FLOPS_PER_MULTIPLY_ADD * a[0] * a[1] * b[-1]
    batch = 1
    for size in a[:-2]:
        batch *= size
    return FLOPS_PER_MULTIPLY_ADD * batch * a[-2] * a[-1] * b[-1]


@dataclass(frozen=True)
class EagerGemm:
    """One GEMM or attention op that ran outside every compiled graph."""

    op: str
    flops: int
    storages: tuple[int, ...]  # storage addresses of its tensor inputs


def _is_compiled_region(name: str) -> bool:
    return (name == GRAPH_CALL_MARKER or name == COMPILED_BACKWARD_EVENT or name.startswith(INDUCTOR_CALL_PREFIX)
            or name.startswith(MXCOMPILE_OP_PREFIX) or name.endswith(COMPILE_EVENT_SUFFIX))


def _input_shapes_and_storages(event: Any) -> tuple[list[list[int] | None], tuple[int, ...]]:
    shapes, storages = [], []
    for value in getattr(event.extra_fields, "inputs", None) or ():
        sizes = getattr(value, "sizes", None)
        shapes.append(list(sizes) if sizes is not None else None)
        storage = getattr(value, "storage_data_ptr", None)
        if storage:
            storages.append(storage)
    return shapes, tuple(storages)


def eager_gemms(roots: Iterable[Any], before_ns: int | None = None) -> list[EagerGemm]:
    """The GEMMs and attention ops of a profiler event tree (`experimental_event_tree()`: events
    with `name`, `start_time_ns`, `children` and `extra_fields.inputs`) that no compiled region
    encloses and that began before `before_ns` (when given); an op counted is not searched below
    (a composite's GEMMs are its own)."""
    found = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        name = event.name
        if _is_compiled_region(name) or (before_ns is not None and event.start_time_ns >= before_ns):
            continue
        if name in _GEMM_NAMES or name in ATTENTION_FORWARD_OPS or name in ATTENTION_BACKWARD_OPS:
            shapes, storages = _input_shapes_and_storages(event)
            found.append(EagerGemm(name, eager_gemm_flops(name, shapes), storages))
            continue
        stack.extend(event.children)
    return found


@dataclass(frozen=True)
class StepCoverage:
    """GEMM FLOPs of one training step: in mxcompile's graphs (converted or kept) and eager."""

    mx_flops: int  # converted GEMM FLOPs of the compiled graphs, per their reports
    compiled_flops: int  # every GEMM FLOP of the compiled graphs
    eager_flops: int  # GEMM FLOPs of ops that ran outside every compiled graph
    eager_gemms: int
    eager_modules: tuple[str, ...]  # modules whose parameters the eager GEMMs read, most FLOPs first
    graph_breaks: tuple[str, ...]  # the graph breaks dynamo recorded in this process, most frequent first
    graph_calls: int  # calls of mxcompile graphs in the step
    measure_seconds: float  # time spent reading the profile at the end of the step

    @property
    def total_flops(self) -> int:
        return self.compiled_flops + self.eager_flops

    @property
    def mx_flop_fraction(self) -> float:
        return self.mx_flops / self.total_flops if self.total_flops else 0.0

    def summary(self) -> str:
        """One line, e.g. 'the step: 5.2% of 3.1e+09 GEMM FLOPs in MX, 84 GEMMs eager (94.8%)'."""
        eager = self.eager_flops / self.total_flops if self.total_flops else 0.0
        return (f"the step: {self.mx_flop_fraction:.1%} of {self.total_flops:.3g} GEMM FLOPs in MX, "
                f"{self.eager_gemms} GEMM(s) eager outside every compiled graph ({eager:.1%})")

    def to_dict(self) -> dict[str, Any]:
        return {"mx_flop_fraction": self.mx_flop_fraction, "mx_flops": self.mx_flops,
                "compiled_flops": self.compiled_flops, "eager_flops": self.eager_flops,
                "eager_gemms": self.eager_gemms, "eager_modules": list(self.eager_modules),
                "graph_breaks": list(self.graph_breaks), "graph_calls": self.graph_calls,
                "measure_seconds": self.measure_seconds}

    def warning(self) -> str:
        modules = ", ".join(self.eager_modules[:MODULES_SHOWN]) or "(no module's parameters: functional GEMMs)"
        if len(self.eager_modules) > MODULES_SHOWN:
            modules += f", ... ({len(self.eager_modules)} in all)"
        breaks = "; ".join(self.graph_breaks) or "none recorded"
        return (f"mxcompile: only {self.mx_flop_fraction:.1%} of a training step's GEMM FLOPs ran in MX "
                f"({self.summary()}): these ran eagerly, in full precision, outside every compiled graph. "
                f"Modules that ran eagerly: {modules}. Graph breaks dynamo recorded: {breaks}. "
                "What to do: run with TORCH_LOGS=graph_breaks to see where the graph breaks, remove the break "
                "(or compile the modules that ran eagerly on their own: torch.compile(module, backend=\"mxfp8\")); "
                "mxcompile.report_of(model) shows this share in each report's totals.")


def _graph_break_reasons() -> tuple[str, ...]:
    from torch._dynamo.utils import counters

    reasons = counters["graph_break"]
    ranked = sorted(reasons, key=lambda reason: -reasons[reason])[:GRAPH_BREAKS_SHOWN]
    return tuple(f"{reason.strip().splitlines()[0]} (x{reasons[reason]})" for reason in ranked)


def _storage_address(param: torch.Tensor) -> int | None:
    """Where a parameter's data lives, as the profiler records it; None for a parameter with no
    storage of its own (an FSDP2 shard is a DTensor: its local shard is read instead)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.is_meta or type(local) is not torch.Tensor and not isinstance(local, nn.Parameter):
        return None
    return local.untyped_storage().data_ptr()


def _module_names(roots: Sequence[nn.Module], gemms: Sequence[EagerGemm]) -> tuple[str, ...]:
    """The modules (of `roots`) whose parameters the eager GEMMs read, most eager FLOPs first."""
    owner: dict[int, str] = {}
    for root in roots:
        for module_name, module in root.named_modules():
            for param in module.parameters(recurse=False):
                address = _storage_address(param)
                if address is not None:
                    owner.setdefault(address, module_name or type(root).__name__)
    flops: dict[str, int] = {}
    for gemm in gemms:
        for storage in gemm.storages:
            if storage in owner:
                flops[owner[storage]] = flops.get(owner[storage], 0) + gemm.flops
    return tuple(sorted(flops, key=lambda name: -flops[name]))


BACKWARD_GRAPH = "backward"  # GemmDecision.graph of a backward GEMM (forward and inference: the rest)
COMPILED_BACKWARD_NODE = "CompiledFunctionBackward"  # the autograd node AOTAutograd gives a compiled graph
BACKWARD_NODE_SEARCH_DEPTH = 3  # autograd nodes (views of outputs) searched for that node


def phase_flops(report: Any) -> tuple[int, int, int, int]:
    """(all, converted) GEMM FLOPs of a report's forward (or inference) graph, then of its
    backward graph."""
    forward = [d for d in report.decisions if d.graph != BACKWARD_GRAPH]
    backward = [d for d in report.decisions if d.graph == BACKWARD_GRAPH]
    converted = report.gemm_flops_converted_of
    return (sum(d.flops for d in forward), converted(forward), sum(d.flops for d in backward), converted(backward))


def _compiled_backward_node(outputs: Any) -> Any:
    """The `CompiledFunctionBackward` node behind a compiled graph's outputs (an output may be a
    view of one, behind a view node), or None when no output needs a gradient."""
    nodes = [o.grad_fn for o in (outputs if isinstance(outputs, (list, tuple)) else (outputs,))
             if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    for _ in range(BACKWARD_NODE_SEARCH_DEPTH):
        for node in nodes:
            if node.name() == COMPILED_BACKWARD_NODE:
                return node
        nodes = [next_node for node in nodes for next_node, _ in node.next_functions if next_node is not None]
    return None


def inside_compiled_code() -> bool:
    """Whether code that dynamo rewrote is on this thread's Python stack: a compiled frame, or
    the eager code it runs between its graphs (dynamo's rewritten code objects, resume functions
    included, are the keys of `orig_code_map`)."""
    from torch._dynamo.utils import orig_code_map

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in orig_code_map:
            return True
        frame = frame.f_back
    return False


class AfterBackward:
    """Calls `callback` after every return of `torch.autograd.backward` (which `Tensor.backward`
    calls) while installed: where a training loop's backward returns, in the loop, outside
    compiled code, with or without an optimizer step after it (gradient accumulation)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                callback()

        self._original, self._wrapper = original, backward

    def install(self) -> None:
        if torch.autograd.backward is self._original:
            torch.autograd.backward = self._wrapper

    def remove(self) -> None:
        if torch.autograd.backward is self._wrapper:  # not if someone wrapped it after us
            torch.autograd.backward = self._original


class StepMonitor:
    """Measures the first training step after the graphs the backend compiled (module docstring).

    The backend runs each call of a compiled graph through `run(graph, call)`; `graph` is any
    object with a `measured` flag and a `report` (its `RecordedGraph`). `on_measured(coverage,
    graphs)` is called when a window's profile is read, with the graphs called in it. A graph's
    forward GEMM FLOPs count once per call, its backward GEMM FLOPs once per run of its backward
    (an autograd hook counts them: a forward recomputed under non-reentrant checkpointing runs no
    backward).

    A window closes (its counts end) where its step ends; the profiler stops there only outside
    compiled code. Closed inside it (a graph call that begins another step), the window switches
    the profiler's collection off and its stop waits for the next close point outside compiled
    code: stopping torch.profiler under a RecordFunction it saw begin (dynamo's "Torch-Compiled
    Region" of the running frame) corrupted the heap (torch 2.13 CPU)."""

    def __init__(self, on_measured: Callable[[StepCoverage, list[Any]], None],
                 roots_of_call: Callable[[], list[nn.Module]]) -> None:
        self._on_measured = on_measured
        self._roots_of_call = roots_of_call
        self._profiler: Any = None  # from the window's start until its profile is read
        self._collecting = False  # the window is open: its graph calls and backward runs count
        self._graphs: dict[int, Any] = {}
        self._forward_calls: dict[int, int] = {}
        self._backward_runs: dict[int, int] = {}
        self._roots: list[nn.Module] = []
        self._backward_seen = False
        self._step_end_ns: int | None = None  # when the last backward pass of the window ended
        self._calls_seen: set[tuple[int, int]] = set()  # (graph, first parameter) called in the window
        self._called: set[int] = set()  # graphs called once already (the compile step is not measured)
        self._optimizer_hook: Any = None  # a close point, while a window is open or awaits its stop
        self._after_backward = AfterBackward(self.finish_ended_step)  # ... and where a backward returns

    @property
    def measuring(self) -> bool:
        """A window is open (its step has not ended)."""
        return self._collecting

    @property
    def stop_pending(self) -> bool:
        """A window closed inside compiled code: its profiler, collecting nothing, waits to stop."""
        return self._profiler is not None and not self._collecting

    def _start(self, graph: Any) -> bool:
        from torch.profiler import ProfilerActivity, profile

        if (torch.autograd._profiler_enabled() or not torch.is_grad_enabled()
                or torch._C._current_graph_task_id() != NO_GRAPH_TASK):
            # Not inside a backward pass either: the engine runs under a copy of the caller's
            # thread-local state, and a profiler started there is not the caller's to stop.
            return False
        os.environ.setdefault(KINETO_LOG_LEVEL_ENV, QUIET_KINETO_LOG_LEVEL)
        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._profiler.start()
        self._collecting = True
        # The close points in the training loop, outside compiled code: the return of the
        # backward and an optimizer step, before the next graph call would close it inside.
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._optimizer_hook = register_optimizer_step_pre_hook(self._optimizer_step)
        self._after_backward.install()
        self._backward_seen, self._calls_seen, self._step_end_ns = False, set(), None
        self._graphs, self._forward_calls, self._backward_runs = {}, {}, {}
        self._roots = self._roots_of_call()
        return True

    def _compiled_flops(self) -> tuple[int, int]:
        """(all, converted) GEMM FLOPs of the compiled graphs' calls in the window."""
        total = converted = 0
        for key, graph in self._graphs.items():
            forward, forward_mx, backward, backward_mx = phase_flops(graph.report)
            calls, runs = self._forward_calls.get(key, 0), self._backward_runs.get(key, 0)
            total += forward * calls + backward * runs
            converted += forward_mx * calls + backward_mx * runs
        return total, converted

    def _optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.finish_ended_step()

    def _close(self) -> None:
        """End the window: its counts stop here; its profile is read now outside compiled code,
        else at the next close point outside it (class docstring), the loop's hooks held till then."""
        from torch.profiler import ProfilerActivity

        self._collecting = False
        if inside_compiled_code():  # the close points stay hooked until the stop
            self._profiler.toggle_collection_dynamic(False, [ProfilerActivity.CPU])
        else:
            self._read_profile()

    def _read_profile(self) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        self._after_backward.remove()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        began = time.perf_counter()
        tree = profiler.profiler.kineto_results.experimental_event_tree()
        gemms = eager_gemms(tree, before_ns=self._step_end_ns)  # what ran after it is the next step's
        compiled, converted = self._compiled_flops()
        graphs = list(self._graphs.values())
        coverage = StepCoverage(
            mx_flops=converted, compiled_flops=compiled,
            eager_flops=sum(g.flops for g in gemms), eager_gemms=len(gemms),
            eager_modules=_module_names(self._roots, gemms), graph_breaks=_graph_break_reasons(),
            graph_calls=sum(self._forward_calls.values()), measure_seconds=time.perf_counter() - began,
        )
        self._graphs, self._roots, self._calls_seen = {}, [], set()
        for graph in graphs:
            graph.measured = True
        if coverage.total_flops:  # a window that saw no GEMM (graphs without one, closed early) says nothing
            self._on_measured(coverage, graphs)

    @property
    def _step_ended(self) -> bool:
        """A backward pass ran through a graph of the window and no backward runs now (a nested
        one, as reentrant checkpointing runs, is not the end of the step)."""
        return self._backward_seen and torch._C._current_graph_task_id() == NO_GRAPH_TASK

    def finish_ended_step(self) -> None:
        """Close the window if its step has ended, and read a closed window's profile, here
        outside compiled code (inside it, only the close). Called where the loop's backward
        returns, at an optimizer step, by `end_measured_step`/`report_of`, and at a graph call.
        Not from the autograd engine: the profiler cannot be stopped there (the engine restores
        the caller's thread-local state afterwards, and with it a profiler that looks enabled)."""
        if self.measuring and self._step_ended:
            self._close()
        elif self.stop_pending and not inside_compiled_code():
            self._read_profile()

    def _mark_step_end(self) -> None:
        # A clock reading, not a profiler event: recording an event from the engine's callback,
        # under its copy of the thread-local state, is what the profiler is not made for.
        self._step_end_ns = time.time_ns()

    def _backward_ran(self, key: int) -> None:
        self._backward_runs[key] = self._backward_runs.get(key, 0) + 1
        self._backward_seen = True
        # Marks where this backward pass ends; the events after the last mark are the next step's.
        torch.autograd.Variable._execution_engine.queue_callback(self._mark_step_end)

    def _new_step(self, graph: Any, first_input: Any) -> bool:
        """Whether this call, outside any backward pass, begins another step: the same graph
        called again on the same first parameter (a block graph called once per block is not),
        so the measured step's backward never came; or a graph of another model is called (the
        window's model may be gone)."""
        if torch._C._current_graph_task_id() != NO_GRAPH_TASK:
            return False  # a recomputation inside the backward
        if (id(graph), id(first_input)) in self._calls_seen:
            return True
        roots = self._roots_of_call()
        return bool(roots and self._roots) and not any(r is s for r in roots for s in self._roots)

    def run(self, graph: Any, call: Callable[[], Any], first_input: Any = None) -> Any:
        """`call()` (one call of `graph`, whose first parameter is `first_input`), measured when
        a window is or should be open."""
        if self.measuring and (self._step_ended or self._new_step(graph, first_input)):
            self._close()  # the step's backward ended, or another step began without one
        if not self.measuring:
            if graph.measured:
                return call()
            if id(graph) not in self._called:  # its first call: the step that compiles, not measured
                self._called.add(id(graph))
                return call()
            if not self._start(graph):
                return call()
        self._calls_seen.add((id(graph), id(first_input)))
        key = id(graph)
        self._graphs[key] = graph
        self._forward_calls[key] = self._forward_calls.get(key, 0) + 1
        with torch.profiler.record_function(GRAPH_CALL_MARKER):
            outputs = call()
        node = _compiled_backward_node(outputs) if self.measuring and torch.is_grad_enabled() else None
        if node is not None:
            node.register_hook(lambda *_: self._backward_ran(key))
        return outputs
