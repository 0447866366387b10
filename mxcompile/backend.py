"""The `mxfp8` torch.compile backend.

    dynamo FX graph
      -> AOTAutograd: joint forward+backward graph (or an inference graph without autograd)
      -> passes.run_pipeline: the ordered, named passes rewrite it and record their decisions
      -> passes.run_partition_stage: min-cut partition into forward and backward (it sees MX copies
         as cheaper to save), with the memory plan when config.memory_budget is set
      -> lowering: Inductor's inner compiler (CPU), with the mxcompile ops decomposed

`explain` runs the same pipeline and stops before lowering.

Every graph the backend compiles leaves its `Report` (the passes' decisions; no graph text, so
training compiles stay cheap) in a bounded history read by `reports()` and `report_of(model)`,
logs one line to the "mxcompile" logger, and warns once when it keeps more than
KEPT_FLOP_WARNING_FRACTION of its GEMM FLOPs in high precision.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._dynamo.utils import counters, dynamo_timed
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.output_code import OutputCode

from .checkpointed_layers import LayerCompiles, layer_compiles, modules_on_stack
from .compile_cache import load_report, report_key, store_report, tagged
from .config import AttentionChunking, MXConfig
from .cost.graph_costs import saved_quantized_operands
from .coverage import warn_uncompiled
from .distributed.fsdp import unsharded_parameters
from .distributed.shard_check import misaligned_input_dims, misaligned_placeholders
from .distributed.subclass_inputs import param_placeholder_indices, static_input_indices
from .lowering import inductor_compiler
from .model_layers import decides_from_model
from .ops.native import build as native_build
from .passes import PassError, run_partition_stage, run_pipeline
from .passes.graph_facts import GraphInfo, concrete_int, graph_module_names
from .passes.meta_keys import GRAPH_INFO_KEY
from .planner.fx_adapter import MemoryModel
from .report import GraphSnapshot, RecordedGraph, Report, ReportHistory
from .step_coverage import WARN_BELOW_FRACTION, MXEagerWarning, StepCoverage, StepMonitor

Compiler = Callable[[fx.GraphModule, Sequence[Any]], Callable]


logger = logging.getLogger("mxcompile")

# Reports of the last RETAINED_REPORTS graphs compiled in this process; older ones are dropped.
RETAINED_REPORTS = 256
_HISTORY = ReportHistory(RETAINED_REPORTS)
# A compiled graph that keeps more than this share of its GEMM FLOPs in high precision warns.
KEPT_FLOP_WARNING_FRACTION = 0.05
KEPT_REASONS_SHOWN = 3
# Keys of torch._dynamo.utils.compilation_time_metrics (filled by dynamo_timed) for the backend's
# own stages, next to torch's (benchmarks/compile_time.py reads them).
PASSES_TIMER = "mxcompile.passes"
PARTITION_TIMER = "mxcompile.partition"


class MXKeptWarning(UserWarning):
    """A compiled graph left a large share of its GEMM FLOPs in high precision."""


class MXPatternWarning(UserWarning):
    """An include/exclude pattern matches no module of a compiled graph."""


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm whose graph can be rewritten without touching gm (node meta is shared)."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(output[0] if isinstance(output, tuple) else output)
    clone = fx.GraphModule(gm, graph)
    clone.meta.update(gm.meta)
    return clone


def _tensor_bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for size in value.shape:
        numel *= concrete_int(size) or 0
    return numel * value.element_size()


def saved_values(fw: fx.GraphModule, num_fwd_outputs: int) -> list[Any]:
    """The values a partitioned forward graph returns for the backward (its outputs after the
    user outputs): nodes, and whatever else the partitioner put there."""
    output = next(n for n in fw.graph.nodes if n.op == "output")
    return pytree.tree_leaves(output.args[0])[num_fwd_outputs:]


def saved_tensors(
    fw: fx.GraphModule, num_fwd_outputs: int, param_input_indices: Sequence[int]
) -> list[dict[str, Any]]:
    """The activations a partitioned forward graph saves for the backward, with their bytes.
    Parameters and buffers that the backward reads are left out: they are alive anyway."""
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i] for i in param_input_indices if i < len(placeholders)}
    rows = []
    for node in saved_values(fw, num_fwd_outputs):
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor) and node not in params:
            rows.append({"name": node.name, "dtype": str(value.dtype),
                         "shape": [concrete_int(s) for s in value.shape],
                         "bytes": _tensor_bytes(value)})
    return rows


def _readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class MXBudgetWarning(UserWarning):
    """torch's activation_memory_budget holds a value mxcompile's planner cannot take."""


def honour_torch_memory_budget(config: MXConfig) -> MXConfig:
    """`config` with torch's documented knob, `torch._functorch.config.activation_memory_budget`
    (what torchtitan's memory-budget checkpointing policy sets), as its `memory_budget` fraction
    when the config has none: torch's fraction scales the same range, from the most aggressive
    recomputation to keeping everything. Its default, 1.0, changes nothing; 0.0 (recompute
    everything) is no fraction of that range, so it is ignored with a warning naming the option."""
    fraction = functorch_config.activation_memory_budget
    if config.memory_budget is not None or fraction >= 1.0:
        return config
    if fraction <= 0.0:
        warnings.warn(f"torch._functorch.config.activation_memory_budget={fraction} (recompute everything) is "
                      "ignored by mxcompile, whose planner takes a fraction in (0, 1]: set "
                      "options={'memory_budget': 0.01} (or bytes, '2GiB') for its most aggressive plans",
                      MXBudgetWarning, stacklevel=3)
        return config
    logger.info("mxcompile: torch._functorch.config.activation_memory_budget=%s taken as memory_budget=%s "
                "(the memory plan replaces torch's own budgeted partition)", fraction, fraction)
    return config.replace(memory_budget=float(fraction))


def _min_cut_without_torch_budget(*args: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partition with its own activation budget off: with a memory_budget the
    planner decides what to recompute, after this partition (passes/memory_plan.py)."""
    with functorch_config.patch(activation_memory_budget=1.0):
        return min_cut_rematerialization_partition(*args, **kwargs)


def memory_model_of(lower: Compiler) -> MemoryModel:
    """What a step lowered by `lower` allocates: Inductor fuses pointwise chains; any other
    lowering (the eager one) runs op by op."""
    return MemoryModel.FUSED_POINTWISE if lower is inductor_compiler else MemoryModel.OP_BY_OP


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: MXConfig,
    *,
    lower: Compiler = inductor_compiler,
    report: Report | None = None,
    describe: bool | None = None,
    cacheable: bool = False,
    memory_model: MemoryModel | None = None,
) -> Callable:
    """Compile one dynamo graph: AOTAutograd, the pass pipeline, partition, lowering.

    The passes' decisions go into `report` (a new one when not given). With `describe`
    (default: whether a report was given, as by explain, the CLI and tests) the graphs are also
    described: the joint graph is partitioned once more without the rewrite, for the saved bytes
    and the before/after graphs. A plain training compile skips that extra work.

    `cacheable` (only with Inductor's lowering, which returns torch's `OutputCode`, and without
    `describe`) lets AOTAutograd's cache serve the graph; then the passes may not run at all and
    `report` stays empty. The caller must compile under `compile_cache.tagged(config)`.

    `memory_model` (default: that of `lower`, `memory_model_of`) is how the memory planner
    models what the step allocates: `explain` lowers op by op but plans for Inductor, as
    `backend="mxfp8"` compiles.
    """
    describe = report is not None if describe is None else describe
    if cacheable and (describe or lower is not inductor_compiler):
        raise ValueError("cacheable=True needs lower=inductor_compiler and describe=False")
    report = report if report is not None else Report(config.to_dict())
    module_names = graph_module_names(gm)
    for message in config.unmatched_module_patterns(module_names) if module_names else ():
        warnings.warn(message, MXPatternWarning, stacklevel=2)
    # DTensor inputs (tensor parallelism) whose shards cut MX blocks; seen before AOTAutograd
    # flattens them into local tensors.
    sharded = misaligned_input_dims(example_inputs, config.block_size)

    def rewrite(graph: fx.GraphModule, name: str) -> bool:
        """Run the pipeline on `graph`; False (graph untouched) when a pass failed and
        config.fallback allows running the unrewritten graph."""
        candidate = clone_graph_module(graph)
        try:
            with dynamo_timed(PASSES_TIMER):
                results = run_pipeline(candidate, config, name)
        except PassError as err:
            if not config.fallback:
                raise
            warnings.warn(f"{err}; running this graph without the MXFP8 rewrite "
                          "(set options={'fallback': False} to raise instead)", stacklevel=2)
            report.fallbacks.append(str(err))
            return False
        for result in results:
            report.add_pass_result(result)
        graph.graph = candidate.graph
        graph.recompile()
        return True

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        params = param_placeholder_indices(joint, tuple(kwargs.get("static_lifetime_input_indices") or ()))
        joint.meta[GRAPH_INFO_KEY] = GraphInfo(
            "joint", num_fwd_outputs, params, tuple(misaligned_placeholders(joint, sharded).items()))
        if describe:
            fw_before, bw_before = min_cut_rematerialization_partition(
                clone_graph_module(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        rewrite(joint, "joint")
        with dynamo_timed(PARTITION_TIMER):
            fw, bw = run_partition_stage(  # plain min-cut unless config.memory_budget is set
                joint, joint_inputs, config=config, report=report,
                partition_fn=min_cut_rematerialization_partition if config.memory_budget is None
                else _min_cut_without_torch_budget,
                num_fwd_outputs=num_fwd_outputs, param_input_indices=params, clone=clone_graph_module,
                memory_model=memory_model if memory_model is not None else memory_model_of(lower), **kwargs)
        # What the forward saves (a walk over its outputs), in every report: `report_of(model)`
        # shows it too. What it would save without the rewrite needs the partition above.
        after = saved_tensors(fw, num_fwd_outputs, params)
        report.saved_bytes_after += sum(r["bytes"] for r in after)
        report.saved_tensors_after.extend(after)
        report.saved_quantized.extend(saved_quantized_operands(saved_values(fw, num_fwd_outputs)))
        if describe:
            before = saved_tensors(fw_before, num_fwd_outputs, params)
            report.saved_bytes_before += sum(r["bytes"] for r in before)
            report.graphs.append(GraphSnapshot("forward", _readable(fw_before), _readable(fw)))
            report.graphs.append(GraphSnapshot("backward", _readable(bw_before), _readable(bw)))
        return fw, bw

    def inference(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        # AOTAutograd gives the partition its static inputs (parameters, buffers), not the
        # inference compiler: they are the dynamo graph's, so the FP4 recipes find the linear
        # layers of a graph compiled without gradients (a reentrant checkpoint's forward).
        params = param_placeholder_indices(graph, static_input_indices(example_inputs))
        graph.meta[GRAPH_INFO_KEY] = GraphInfo(
            "inference", param_input_indices=params,
            misaligned_shards=tuple(misaligned_placeholders(graph, sharded).items()))
        before = _readable(graph) if describe else ""
        rewrite(graph, "inference")
        if describe:
            report.graphs.append(GraphSnapshot("inference", before, _readable(graph)))
        return lower(graph, inputs)

    compilers = (lower, lower, inference)
    if cacheable:  # AOTAutograd looks up and stores only graphs whose compilers say they return OutputCode
        compilers = tuple(SerializableAOTDispatchCompiler(OutputCode, c) for c in compilers)
    fw_compiler, bw_compiler, inference_compiler = compilers
    return aot_module_simplified(
        gm, example_inputs,
        fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
        partition_fn=partition, decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


def compile_and_record(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: MXConfig, *, lower: Compiler = inductor_compiler
) -> Callable:
    """`compile_graph` without the description work, then the graph's report is kept in the
    history, logged in one line and, when it keeps too much in high precision, warned about.

    With Inductor's lowering and no memory budget, torch's compile caches serve the graph when
    they can (keyed with `compile_cache.cache_tag(config)`); the report of a graph they serve is
    the one stored when it was compiled, and its fallback warnings are given again."""
    config = honour_torch_memory_budget(config)
    # HF gradient checkpointing that dynamo could not trace: its layers compiled on their own
    # (checkpointed_layers.py), their attention with the least scratch (AttentionChunking). The
    # model being compiled is on the stack, as its forward runs.
    layer_config = config.replace(attention_chunking=AttentionChunking.LEAST_MEMORY)
    pending = layer_compiles(modules_on_stack(), (layer_config, lower),
                             functools.partial(compile_and_record, config=layer_config, lower=lower))
    report = Report(config.to_dict())
    # A memory plan depends on the device profile measured on this machine, and an FP4 recipe's
    # high-precision layers on the graph's place in the model (model_layers.py), neither of which
    # torch's AOTAutograd cache key covers: such graphs are compiled afresh every time (Inductor's
    # FX graph cache still serves their lowered code).
    cacheable = lower is inductor_compiler and config.memory_budget is None and not decides_from_model(config)
    key = report_key(gm, example_inputs, config) if cacheable else ""
    hits_before = counters["aot_autograd"]["autograd_cache_hit"]
    with tagged(config) if cacheable else contextlib.nullcontext():
        compiled = compile_graph(gm, example_inputs, config, lower=lower, report=report, describe=False,
                                 cacheable=cacheable)
    served = counters["aot_autograd"]["autograd_cache_hit"] > hits_before  # the passes did not run
    if cacheable and not served:
        store_report(key, report)
    elif served:
        report = load_report(key) or report
        for fallback in report.fallbacks:
            warnings.warn(f"{fallback}; running this graph without the MXFP8 rewrite (loaded from the "
                          "compile cache; set options={'fallback': False} to raise instead)", stacklevel=2)
    index, recorded = _HISTORY.record(report, example_inputs)
    recorded.measured = not config.measure_first_step  # a graph marked measured opens no window
    logger.info("mxcompile: compiled graph %d: %s", index, report.summary())
    total = report.gemm_flops_total
    by_recipe = report.gemm_flops_kept_by_recipe  # an FP4 recipe's high-precision layers and attention
    kept = total - report.gemm_flops_converted - by_recipe
    if total and kept > KEPT_FLOP_WARNING_FRACTION * total:
        recipe_note = (f", besides the {by_recipe / total:.1%} its recipe keeps by design (high_precision_layers, "
                       "its default attention='off')" if by_recipe else "")
        warnings.warn(
            f"mxcompile kept {kept / total:.1%} of graph {index}'s GEMM FLOPs in high precision{recipe_note} "
            f"({report.summary()}); top reasons: {'; '.join(report.top_kept_reasons(KEPT_REASONS_SHOWN, beyond_recipe=True))}. "
            "See mxcompile.reports() or mxcompile.report_of(model) for every decision.",
            MXKeptWarning, stacklevel=2)
    return _noting_calls(compiled, recorded, pending)


def _record_step_coverage(coverage: StepCoverage, graphs: list[RecordedGraph]) -> None:
    """A measured training step (step_coverage.py): its share goes into the reports of
    the graphs that ran in it, the log, and a warning when too little of it ran in MX."""
    for graph in graphs:
        graph.report.step_coverage = coverage
    logger.info("mxcompile: %s (measured in %.3f s)", coverage.summary(), coverage.measure_seconds)
    if coverage.mx_flop_fraction < WARN_BELOW_FRACTION:  # the monitor reports only windows with GEMMs
        warnings.warn(coverage.warning(), MXEagerWarning, stacklevel=2)


# Measures the first training step after the graphs compiled in this process (step_coverage.py).
_STEP_MONITOR = StepMonitor(_record_step_coverage, roots_of_call=modules_on_stack)


def _noting_calls(compiled: Callable, recorded: RecordedGraph, layer_changes: list[LayerCompiles]) -> Callable:
    """`compiled`, noting each call's parameters in the report history
    (`RecordedGraph.note_call`): one graph can serve every block of a model. AOTAutograd's
    function takes the graph inputs either as arguments or, behind dynamo's input-flattening
    wrapper, as one list (which it clears); graph inputs are never lists themselves. Until a
    training step that ran the graph was measured, its calls go through the step monitor. The
    first call applies `layer_changes` (HF-checkpointed layers found while compiling it)."""

    def run(*args: Any) -> Any:
        boxed = len(args) == 1 and isinstance(args[0], list)
        recorded.note_call(args[0] if boxed else args)
        while layer_changes:  # empty after the first call
            layer_changes.pop().apply(stacklevel=2)
        if recorded.measured:
            return compiled(*args)
        inputs = args[0] if boxed else args
        first_parameter = next((a for a in inputs if isinstance(a, torch.nn.Parameter)), None)
        return _STEP_MONITOR.run(recorded, lambda: compiled(*args), first_parameter)

    return functools.wraps(compiled)(run)


def reports() -> list[Report]:
    """The reports of the graphs `torch.compile(..., backend="mxfp8")` compiled in this process,
    oldest first: the last RETAINED_REPORTS of them (older ones are dropped). `explain` does
    not add to them."""
    _STEP_MONITOR.finish_ended_step()  # a measured step whose backward ended: its share in the reports
    return _HISTORY.all()


def report_of(model: torch.nn.Module) -> list[Report]:
    """The retained reports of the graphs compiled for `model` (the module or what
    torch.compile returned for it), oldest first: those whose graphs took its parameters or
    buffers. Recompiles (new shapes, train/eval) add one each."""
    module = getattr(model, "_orig_mod", model)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"report_of takes an nn.Module or a compiled one, got {type(model).__name__}; "
                         "use mxcompile.reports() for compiled functions")
    _STEP_MONITOR.finish_ended_step()
    return _HISTORY.of_module(module, also=unsharded_parameters(module))  # FSDP2 units: the graphs ran with these


def step_coverage_of(model: torch.nn.Module) -> StepCoverage | None:
    """The measured training step of `model` (the module or what torch.compile returned), the
    first after compiling: the share of all its GEMM FLOPs that ran in MX, the GEMMs that ran eagerly outside every
    compiled graph included (step_coverage.py). None until that step's backward has ended."""
    measured = [r.step_coverage for r in report_of(model) if r.step_coverage is not None]
    return measured[-1] if measured else None


def end_measured_step() -> None:
    """Close the first-step measurement (`measure_first_step`, step_coverage.py) if its step has
    ended, and stop its profiler if the measurement closed inside compiled code; call it from your
    training loop, outside compiled code. A loop rarely needs it: the measurement closes by itself
    where the measured step's `backward()` returns and at an optimizer step. It is for the rest:
    gradients from `torch.autograd.grad` with no `torch.optim` optimizer, or forward calls with
    gradients on and no backward, after which the profiler waits, collecting nothing, for a
    close point outside compiled code (before you start a torch.profiler of your own, say).
    `report_of` and `step_coverage_of` call it, and so does `MXReportCallback` at the end of every
    Trainer step. Once the measurement is over it is one attribute check."""
    _STEP_MONITOR.finish_ended_step()


def clear_reports() -> None:
    """Forget the retained reports; the log's graph numbers start again at 0."""
    _HISTORY.clear()


def mxfp8_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    *,
    config: MXConfig | None = None,
) -> Callable:
    """The dynamo backend behind `torch.compile(model, backend="mxfp8", options={...})`."""
    if mode not in (None, "default"):
        raise ValueError(f"mode={mode!r} is not supported by the mxfp8 backend; accepted: None, 'default'")
    if config is not None and options:
        raise ValueError("give either config or options to the mxfp8 backend, not both")
    config = config if config is not None else MXConfig.from_options(options)
    if any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs):
        native_build.build_in_background()  # the quantize ops' CPU kernels, while this graph compiles
    return compile_and_record(gm, example_inputs, config)


def configured_backend(config: MXConfig | None, torch_compile_kwargs: dict[str, Any], caller: str) -> Callable:
    """The mxfp8 backend bound to `config` (default `MXConfig()`), for `torch.compile` or
    `Module.compile`; `caller` names the function in the errors about its arguments."""
    if "backend" in torch_compile_kwargs or "options" in torch_compile_kwargs:
        raise ValueError(f"{caller} sets backend and options itself; pass config=MXConfig(...)")
    config = config if config is not None else MXConfig()
    if not isinstance(config, MXConfig):
        raise ValueError(f"config must be an MXConfig, got {type(config).__name__}")
    backend = functools.partial(mxfp8_backend, config=config)
    backend.__name__ = "mxfp8"  # type: ignore[attr-defined]  (dynamo names backends in its logs)
    return backend


def compile(model: Any, config: MXConfig | None = None, **torch_compile_kwargs: Any) -> Any:
    """Typed alternative to torch.compile(model, backend="mxfp8", options=...)."""
    backend = configured_backend(config, torch_compile_kwargs, "mxcompile.compile")
    if isinstance(model, torch.nn.Module):  # layers dynamo would never trace: say so now
        warn_uncompiled(model, compiled=True)
    return torch.compile(model, backend=backend, **torch_compile_kwargs)
