"""Step factories for :func:`mxcompile.measure.fresh_process.measure_step_peak`, and step timing
in the same child process.

A factory is named ``"mxcompile.measure.steps:<function>"``; called in the measuring child with
JSON keyword arguments, it returns a zero-argument callable that runs one forward+backward,
gradients set to None first (so they count in the step's peak):

* :func:`torch_budget_step`: the model compiled with torch.compile's default backend
  (Inductor), ``torch._functorch.config.activation_memory_budget`` set to the fraction;
* :func:`mxfp8_budget_step`: the model compiled with ``backend="mxfp8"`` and
  ``options={"memory_budget": budget}`` (a fraction, or bytes as ``"<n>B"``);
* both take ``lower="eager"`` to skip Inductor code generation (same partitioners and
  budgets, much faster to compile, slower and more memory-hungry steps): for smoke tests;
* :func:`hf_checkpointing_step`: ``llama-small`` with Hugging Face gradient checkpointing on
  (or off), compiled with Inductor or ``backend="mxfp8"`` (issue 46's memory comparison);
* :func:`plan_report`: the report (``memory_plan``) of the plan a step compiled with a memory
  budget makes, for either lowering, without compiling it with Inductor;
* :func:`timed_step`: wraps any factory; compiles and warms it up, then times every further
  step into a JSON file. :func:`measure_step` measures the peak and the step time (median)
  in one child and returns both (:func:`mxcompile.measure.timing.time_step` times a step in
  the current process).

Models (:data:`MODELS`): ``"gpt-tiny"`` and ``"gpt-small"`` (:func:`mxcompile.examples.gpt.gpt_factory`),
``"llama-small"`` (a small randomly initialised HF ``LlamaForCausalLM``; needs
``transformers``, a development dependency, not a runtime one) and ``"mlp-12"`` (issue 37's
new user's model: a plain ``nn.Sequential`` of 12 ``Linear(1024, 1024)`` + GELU, input
``batch_size`` x 512 rows of 1024 fp32 (4096 x 1024 at the default batch, :func:`mlp12`), loss
``out.square().mean()``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, ContextManager, Mapping

from ..examples._common import check_choice, check_positive_int
from .fresh_process import DEFAULT_TIMEOUT_S, factory_parts, measure_step_peak, resolve_factory
from .memory import Step

MODELS = ("gpt-tiny", "gpt-small", "llama-small", "mlp-12")
LOWERINGS = ("inductor", "eager")
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEED = 0

# llama-small: about gpt-small's size (4 layers, width 256, seq 128), every GEMM dimension a
# multiple of 32 (MX block size), grouped-query attention (2 kv heads for 4 heads).
LLAMA_SMALL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
LLAMA_SEQ = 128


def _check_fraction(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value!r} is not accepted; give a fraction in (0, 1] or None")


def llama_small(*, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = DEFAULT_SEED) -> tuple[Any, Any]:
    """A seeded small ``LlamaForCausalLM`` (random weights, nothing downloaded) and (batch, seq)
    token ids. Raises ImportError naming ``pip install transformers`` when it is missing."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "model 'llama-small' needs Hugging Face transformers: pip install transformers "
            "(or pip install -e '.[dev]')"
        ) from err
    import torch

    from ..examples._common import seeded

    config = transformers.LlamaConfig(**LLAMA_SMALL, attn_implementation="sdpa")
    model = seeded(seed, lambda: transformers.LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, LLAMA_SEQ), generator=generator)
    return model, ids


# mlp-12: issue 37's model. Rows of its input per unit of batch_size, so that the default batch
# (DEFAULT_BATCH_SIZE = 8) gives the 4096 x 1024 input.
MLP12_LAYERS = 12
MLP12_WIDTH = 1024
MLP12_ROWS_PER_BATCH = 512


def mlp12(*, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = DEFAULT_SEED) -> tuple[Any, Any]:
    """``(module, x)``: a seeded ``nn.Sequential`` of ``MLP12_LAYERS`` ``Linear(1024, 1024)`` + GELU
    wrapped so that ``forward(x)`` returns ``out.square().mean()``, and an fp32 input of
    ``batch_size * MLP12_ROWS_PER_BATCH`` rows (4096 at the default batch)."""
    import torch

    from ..examples._common import seeded

    class SquareMeanLoss(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return self.inner(x).square().mean()

    def build() -> Any:
        layers: list[Any] = []
        for _ in range(MLP12_LAYERS):
            layers += [torch.nn.Linear(MLP12_WIDTH, MLP12_WIDTH), torch.nn.GELU()]
        return SquareMeanLoss(torch.nn.Sequential(*layers))

    module = seeded(seed, build)
    x = torch.randn(batch_size * MLP12_ROWS_PER_BATCH, MLP12_WIDTH, generator=torch.Generator().manual_seed(seed))
    return module, x


def _loss_module(model: Any) -> Any:
    """``model`` (an HF causal LM) wrapped so that ``forward(ids)`` returns its training loss
    (labels = ids): one module whose compiled graph is the whole loss, for the step and explain."""
    import torch

    class LossOf(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any) -> Any:
            return self.inner(input_ids=ids, labels=ids).loss

    return LossOf(model)


def build_model(model: str, batch_size: int = DEFAULT_BATCH_SIZE) -> tuple[Any, tuple[Any, ...]]:
    """``(module, args)`` for the model named ``model`` (one of :data:`MODELS`): a module whose
    ``forward(*args)`` returns the scalar training loss (next-token loss, targets = the input
    ids), so that one compiled graph covers the whole step and the memory planner plans all
    that the step allocates. ``mxcompile.explain(module, *args, ...)`` traces exactly the
    graph the step compiles."""
    check_choice("model", model, MODELS)
    check_positive_int("batch_size", batch_size)
    if model.startswith("gpt-"):
        from ..examples.gpt import LanguageModelLoss, gpt_factory

        inner, (ids,) = gpt_factory(model.removeprefix("gpt-"), batch_size=batch_size, seed=DEFAULT_SEED)
        return LanguageModelLoss(inner), (ids,)
    if model == "mlp-12":
        module, x = mlp12(batch_size=batch_size)
        return module, (x,)
    inner, ids = llama_small(batch_size=batch_size)
    return _loss_module(inner), (ids,)


def _train_step(module: Any, compiled: Any, args: tuple[Any, ...],
                during: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Step:
    """A step that sets ``module``'s grads to None and runs ``compiled(*args).backward()``,
    inside ``during()`` (e.g. a config patch that must hold while the step compiles)."""
    def step() -> None:
        with during():
            module.zero_grad(set_to_none=True)
            compiled(*args).backward()

    return step


def torch_budget_step(model: str = "gpt-tiny", activation_memory_budget: float | None = None,
                      batch_size: int = DEFAULT_BATCH_SIZE, lower: str = "inductor") -> Step:
    """One forward+backward of ``model`` compiled with the default backend (Inductor) and
    ``torch._functorch.config.activation_memory_budget = activation_memory_budget`` (None
    leaves torch's default, 1.0), patched only while a step runs (the first step compiles).
    ``lower="eager"`` uses ``aot_eager_decomp_partition`` instead (the same min-cut
    partitioner and budget, no Inductor code generation: fast to compile, for smoke tests)."""
    _check_fraction("activation_memory_budget", activation_memory_budget)
    check_choice("lower", lower, LOWERINGS)
    import torch
    import torch._functorch.config as functorch_config

    module, args = build_model(model, batch_size)
    backend = "inductor" if lower == "inductor" else "aot_eager_decomp_partition"
    compiled = torch.compile(module, backend=backend)
    if activation_memory_budget is None:
        return _train_step(module, compiled, args)
    budget = functools.partial(functorch_config.patch, activation_memory_budget=float(activation_memory_budget))
    return _train_step(module, compiled, args, during=budget)


BACKENDS = ("inductor", "mxfp8")


def hf_checkpointing_step(backend: str = "mxfp8", checkpointing: bool = True, use_reentrant: bool = False,
                          measure_first_step: bool = False, batch_size: int = DEFAULT_BATCH_SIZE) -> Step:
    """One training step of ``llama-small`` called as HF models are (``model(input_ids=...,
    labels=...)``), with ``model.gradient_checkpointing_enable(use_reentrant=...)`` when
    ``checkpointing``, compiled with ``torch.compile(model, backend=backend)``: under Inductor
    dynamo runs the checkpointed layers eagerly (it cannot trace HF's checkpointed call); under
    mxfp8 each is compiled on its own (mxcompile/checkpointed_layers.py). ``measure_first_step``
    is mxfp8's option of that name (the run-time MX share of the first step)."""
    check_choice("backend", backend, BACKENDS)
    import torch

    model, ids = llama_small(batch_size=batch_size)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": bool(use_reentrant)})
    options = {"options": {"measure_first_step": bool(measure_first_step)}} if backend == "mxfp8" else {}
    compiled = torch.compile(model, backend=backend, **options)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(input_ids=ids, labels=ids).loss.backward()

    return step


def _memory_budget(memory_budget: float | str) -> Any:
    from ..config import MemoryBudget

    if isinstance(memory_budget, str):
        return MemoryBudget.parse(memory_budget)
    _check_fraction("memory_budget", memory_budget)
    return MemoryBudget.of_fraction(memory_budget)


def plan_report(model: str, memory_budget: float | str, batch_size: int = DEFAULT_BATCH_SIZE,
                lower: str = "inductor") -> Any:
    """The :class:`~mxcompile.report.Report` of ``model``'s step under ``memory_budget`` (as
    :func:`mxfp8_budget_step` takes it), its memory plan made for the allocations of ``lower``:
    one forward through the pipeline with eager lowering, as ``mxcompile.explain`` runs it
    (which plans for Inductor)."""
    check_choice("lower", lower, LOWERINGS)
    import torch

    from ..backend import compile_graph, memory_model_of
    from ..config import MXConfig
    from ..lowering import eager_compiler, inductor_compiler
    from ..report import Report

    module, args = build_model(model, batch_size)
    config = MXConfig(memory_budget=_memory_budget(memory_budget))
    report = Report(config.to_dict())
    lowered_by = inductor_compiler if lower == "inductor" else eager_compiler
    backend = functools.partial(compile_graph, config=config, lower=eager_compiler, report=report,
                                memory_model=memory_model_of(lowered_by))
    with torch.enable_grad():
        torch.compile(module, backend=backend)(*args)
    return report


def mxfp8_budget_step(model: str = "gpt-tiny", memory_budget: float | str | None = None,
                      batch_size: int = DEFAULT_BATCH_SIZE, lower: str = "inductor") -> Step:
    """One forward+backward of ``model`` compiled with ``backend="mxfp8"`` and
    ``options={"memory_budget": memory_budget}`` (None: no budget, no plan): a fraction in
    (0, 1] or a byte string such as ``"123456B"`` (:meth:`MemoryBudget.parse`).
    ``lower="eager"`` runs the same pipeline with eager lowering (no Inductor code
    generation: fast to compile, for smoke tests). The run-time MX share is off
    (``measure_first_step``): its profiler would run in the step measured here, the second."""
    check_choice("lower", lower, LOWERINGS)
    import torch

    from ..backend import compile_graph
    from ..config import MXConfig
    from ..lowering import eager_compiler

    budget = None if memory_budget is None else _memory_budget(memory_budget)
    module, args = build_model(model, batch_size)
    options = {"measure_first_step": False, **({} if budget is None else {"memory_budget": budget})}
    if lower == "inductor":
        compiled = torch.compile(module, backend="mxfp8", options=options)
    else:
        compiled = torch.compile(module, backend=functools.partial(
            compile_graph, config=MXConfig.from_options(options), lower=eager_compiler))
    return _train_step(module, compiled, args)


def timed_step(factory: str, factory_kwargs: Mapping[str, Any] | None = None, *, timing_path: str,
               warmup_steps: int = 1, max_timed: int | None = None) -> Step:
    """A factory wrapping ``factory`` that times its steps in the same child.

    Builds the step, runs it ``warmup_steps`` times (the first compiles; untimed), and returns
    a step that appends the wall time of each of its first ``max_timed`` calls (all if None)
    to the JSON at ``timing_path`` (``{"first_s", "warmup_s", "times_s"}``). Under
    :func:`measure_step_peak` the timed calls are its warmup steps and the measured step (the
    timing is a few ``perf_counter`` reads and a small file write after the step); later calls
    (its profiled step, slowed by the profiler) are left untimed.
    """
    check_positive_int("warmup_steps", warmup_steps)
    if max_timed is not None:
        check_positive_int("max_timed", max_timed)
    step = resolve_factory(factory)(**dict(factory_kwargs or {}))
    started = time.perf_counter()
    step()
    timing: dict[str, Any] = {"first_s": time.perf_counter() - started}
    for _ in range(warmup_steps - 1):
        step()
    timing.update(warmup_s=time.perf_counter() - started, times_s=[])

    def write() -> None:
        with open(timing_path, "w") as handle:
            json.dump(timing, handle)

    write()

    def timed() -> None:
        if max_timed is not None and len(timing["times_s"]) >= max_timed:
            step()
            return
        t0 = time.perf_counter()
        step()
        timing["times_s"].append(time.perf_counter() - t0)
        write()

    return timed


def measure_step(factory: str, factory_kwargs: Mapping[str, Any] | None = None, *, warmup_steps: int = 1,
                 time_steps: int = 3, timeout_s: float | None = None) -> tuple[Any, dict[str, Any]]:
    """Time and measure one step factory in one fresh process: ``(PeakMeasurement, timing)``.

    The child builds the step and runs ``warmup_steps`` untimed steps (the first compiles);
    then :func:`~mxcompile.measure.fresh_process.measure_step_peak` runs ``time_steps`` more steps (its
    warmup) and the measured one, all timed (any later step it runs, e.g. under the profiler
    for the tensor-storage peak, is not). ``timing`` holds ``first_s`` (build excluded:
    compile + first step), ``warmup_s``, ``times_s`` (``time_steps + 1`` values) and
    ``median_s``. The steps run with the child's ``MALLOC_MMAP_THRESHOLD_`` (large buffers
    mmapped and returned on free), so times compare between factories measured this way,
    not with an ordinary process.
    """
    check_positive_int("time_steps", time_steps)
    factory_parts(factory)
    handle, path = tempfile.mkstemp(prefix="mxcompile-step-timing-", suffix=".json")
    os.close(handle)
    try:
        peak = measure_step_peak(
            f"{__name__}:timed_step",
            factory_kwargs={"factory": factory, "factory_kwargs": dict(factory_kwargs or {}), "timing_path": path,
                            "warmup_steps": warmup_steps, "max_timed": time_steps + 1},
            warmup_steps=time_steps,
            timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
        )
        with open(path) as stream:
            timing = json.load(stream)
    finally:
        os.unlink(path)
    timing["median_s"] = statistics.median(timing["times_s"])
    return peak, timing


__all__ = [
    "LLAMA_SMALL",
    "LOWERINGS",
    "MODELS",
    "build_model",
    "llama_small",
    "measure_step",
    "mlp12",
    "mxfp8_budget_step",
    "timed_step",
    "torch_budget_step",
]
