"""Activation-memory budgets on CPU: the mxfp8 backend's planner against torch's
``activation_memory_budget``, measured peaks and step times side by side, in one run.

    python benchmarks/memory_plan.py            # gpt-small and llama-small, budgets 1.0 0.75 0.5 0.3
    python benchmarks/memory_plan.py --quick    # gpt-tiny, budgets 1.0 and 0.5, eager lowering: a smoke test

For each model and budget fraction f:

* mxfp8: ``torch.compile(model, backend="mxfp8", options={"memory_budget": f})``; the plan
  (budget bytes, predicted peak, estimated recompute time) comes from ``report.memory_plan``
  of :func:`mxcompile.measure.steps.plan_report` on the same model and inputs (the plan the
  step makes, for its lowering's allocations). Planner wall time is timed in that call by wrapping the solver calls
  (``plan_activation_memory``, ``budget_curve``) and the whole ``plan_and_partition`` step
  (planning, applying the plan, modelling the result) at run time; the report carries no time.
* torch: ``torch.compile(model)`` (Inductor) with ``torch._functorch.config.activation_memory_budget = f``.

How peaks are measured (:mod:`mxcompile.measure.fresh_process`): every (backend, budget) runs in a fresh
Python process with ``MALLOC_MMAP_THRESHOLD_`` set (large buffers come from mmap and go back
to the OS on free); after compiling and warming up, the child resets its peak RSS (``5`` to
``/proc/self/clear_refs``), reads VmRSS, runs one forward+backward and loss (one compiled graph;
grads set to None first, so they count) and reads VmHWM: the RSS step peak = VmHWM - VmRSS
before the step (activations, gradients, transients, plus allocator slack and Python noise).
It then runs one more step under ``torch.profiler`` (``profile_memory=True``): the peak of live
tensor storage the step allocated, which is what the planner models and what the flags use.
The parameters and inputs are allocated before the step, so the peak to hold against a planner
budget (whose baseline includes them) is that peak + parameter and input bytes.

Matched budgets (the comparison with torch). The two fractions are defined differently (below),
so equal f is not equal bytes. Each torch fraction f is converted to the bytes torch's step
ends up using: its measured tensor-storage peak plus the parameter and input bytes (the plan's
``input_bytes``). The mxfp8 backend is then run again with exactly that byte budget
(``memory_budget="<n>B"``) and its peak measured the same way. The matched table prints, per
torch fraction: the budget bytes, torch's peak and mxfp8's peak (both with the parameters and
inputs), and whether mxfp8's peak is within the budget -- which, the budget being torch's peak,
is also whether it is at or under torch's -- plus both step times at that equal memory.

How the fractional budgets are defined -- they differ, so equal f is not equal bytes:

* mxcompile (``AdapterResult.budget_for_fraction``, :mod:`mxcompile.planner.fx_adapter`):
  budget = min_peak + f * (keep-everything peak - min_peak), where min_peak is the lowest peak
  the planner can reach; 1.0 is the modelled keep-everything peak, 0.0 the lowest reachable
  one. Both include the parameters, the inputs, transients and gradients.
* torch (``activation_memory_budget``): a fraction of the bytes of the activations the default
  min-cut partition saves for the backward; torch's own knapsack picks what to recompute.

Step times: median of ``--steps`` + 1 steps after compiling and ``--warmup`` steps, timed in the
child that measures the peak (the peak measurement's warmup steps and the measured step), so
under the same mmap setting: times compare between rows, not with an ordinary process.
Measured overhead = step time at f - step time with no budget, same backend. torch's default
budget is 1.0, so its no-budget run is also its f = 1.0 row.

On a machine whose cores are shared, run with ``OMP_NUM_THREADS=1``: with more OpenMP threads
than free cores, the threads wait on each other and a step can take 10-20x longer, at random.

Also times the planner alone on a 24-layer synthetic GPT-like problem
(:func:`mxcompile.planner.synthetic.transformer_problem`, as benchmarks/planner_speed.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

FRACTIONS = (1.0, 0.75, 0.5, 0.3)
QUICK_FRACTIONS = (1.0, 0.5)
MODELS = ("gpt-small", "llama-small")
QUICK_MODELS = ("gpt-tiny",)
QUICK_BATCH = 4  # large enough that the step's buffers (mmapped above 64 KiB) show in the RSS peak
SYNTHETIC_LAYERS = 24
PLAN_SOLVER = "auto"  # what the backend uses (the ILP for small problems, the heuristic for large)
MONOTONE_TOLERANCE_BYTES = 2**20  # measured peaks may wobble by allocator noise
MIB = 2**20
MX_FACTORY = "mxcompile.measure.steps:mxfp8_budget_step"
TORCH_FACTORY = "mxcompile.measure.steps:torch_budget_step"


@dataclass
class Measured:
    """One child-process measurement (or its error)."""

    step_peak_bytes: int | None = None  # RSS: VmHWM - VmRSS before the step
    tensor_peak_bytes: int | None = None  # live tensor storage the step allocated (profiler)
    step_s: float | None = None
    compile_s: float | None = None
    error: str = ""


@dataclass
class Planned:
    """What explain's report.memory_plan says for one budget, and the planner's wall time."""

    budget_bytes: int | None = None
    keep_all_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    realized_peak_bytes: int | None = None
    min_peak_bytes: int | None = None
    recompute_time_s: float | None = None
    param_bytes: int = 0
    input_bytes: int = 0  # parameters + the caller's inputs (the report's input_bytes)
    graphs: int = 0
    solve_s: float = 0.0
    plan_and_partition_s: float = 0.0
    explain_s: float = 0.0
    error: str = ""


@dataclass
class ModelResult:
    model: str
    fractions: tuple[float, ...]
    mx: dict[float | None, Measured] = field(default_factory=dict)
    torch: dict[float | None, Measured] = field(default_factory=dict)
    plans: dict[float, Planned] = field(default_factory=dict)
    # Per torch fraction: the matched byte budget (torch's peak + parameters and inputs), and
    # the mxfp8 step measured under it (see "Matched budgets" in the module docstring).
    matched_budget: dict[float, int] = field(default_factory=dict)
    matched: dict[float, Measured] = field(default_factory=dict)


def _short(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    tail = [line for line in lines if "Error" in line] or lines or [type(err).__name__]
    return tail[-1][:300]


def measure(factory: str, kwargs: dict[str, Any], *, warmup: int, steps: int) -> Measured:
    from mxcompile.measure.steps import measure_step

    try:
        peak, timing = measure_step(factory, kwargs, warmup_steps=warmup, time_steps=steps)
    except (RuntimeError, OSError, ValueError) as err:
        return Measured(error=_short(err))
    return Measured(peak.step_peak_bytes, getattr(peak, "tensor_peak_bytes", None), timing["median_s"],
                    timing["first_s"])


@contextlib.contextmanager
def _planner_timers() -> Iterator[dict[str, float]]:
    """Wrap the planner's entry points as the backend calls them, adding their wall time to
    ``spent["solve"]`` (solver calls) and ``spent["plan_and_partition"]`` (the whole step)."""
    import mxcompile.backend as backend_module
    import mxcompile.passes.memory_plan as plan_module

    spent = {"solve": 0.0, "plan_and_partition": 0.0}
    targets = [(plan_module, "plan_activation_memory", "solve"), (plan_module, "budget_curve", "solve"),
               (backend_module, "run_partition_stage", "plan_and_partition")]
    originals = []
    for module, name, key in targets:
        function = getattr(module, name, None)
        if function is None:
            continue

        def timed(*args: Any, _function: Any = function, _key: str = key, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - started

        originals.append((module, name, function))
        setattr(module, name, timed)
    try:
        yield spent
    finally:
        for module, name, function in originals:
            setattr(module, name, function)


def plan_for(model: str, fraction: float, batch_size: int, lower: str) -> Planned:
    import warnings

    import torch

    from mxcompile.measure.steps import plan_report

    try:
        torch._dynamo.reset()
        started = time.perf_counter()
        with _planner_timers() as spent, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an over-budget warning shows in the table instead
            report = plan_report(model, fraction, batch_size, lower)
        explain_s = time.perf_counter() - started
        torch._dynamo.reset()
    except Exception as err:  # noqa: BLE001  (a failing cell is reported in the table, not fatal)
        return Planned(error=_short(err))
    plan = report.memory_plan or {}
    graphs = plan.get("graphs") or ([plan] if plan else [])
    if not graphs:
        return Planned(error="report.memory_plan is empty (no graph was planned)", explain_s=explain_s)

    def total(key: str) -> Any:
        values = [g.get(key) for g in graphs]
        return None if any(v is None for v in values) else sum(values)

    return Planned(
        budget_bytes=total("budget_bytes"), keep_all_peak_bytes=total("keep_all_peak_bytes"),
        predicted_peak_bytes=total("predicted_peak_bytes"), realized_peak_bytes=total("realized_peak_bytes"),
        min_peak_bytes=total("min_peak_bytes"), recompute_time_s=total("recompute_time_s"),
        param_bytes=total("param_bytes") or 0, input_bytes=total("input_bytes") or 0, graphs=len(graphs),
        solve_s=spent["solve"], plan_and_partition_s=spent["plan_and_partition"], explain_s=explain_s,
    )


def run_model(model: str, fractions: tuple[float, ...], *, batch_size: int, warmup: int, steps: int,
              lower: str = "inductor", jobs: int = 1, log: Any = print) -> ModelResult:
    """Measure ``model`` at no budget and at each fraction, both backends, and plan it with
    explain. ``jobs > 1`` runs that many measuring children at once (and the explain calls
    alongside): faster, but the step times then share the CPUs (peaks are per process)."""
    result = ModelResult(model, fractions)
    common = {"model": model, "batch_size": batch_size, "lower": lower}
    tasks = []  # (backend, fraction, factory, kwargs)
    for fraction in (None, *fractions):
        tasks.append(("mxfp8", fraction, MX_FACTORY, {**common, "memory_budget": fraction}))
        if fraction != 1.0:  # torch's default budget is 1.0: its no-budget run is its 1.0 row
            tasks.append(("torch", fraction, TORCH_FACTORY, {**common, "activation_memory_budget": fraction}))

    def run(task: tuple[str, float | None, str, dict[str, Any]]) -> Measured:
        who, fraction, factory, kwargs = task
        started = time.perf_counter()
        measured = measure(factory, kwargs, warmup=warmup, steps=steps)
        log(f"  {model} {who} budget {fraction if fraction is not None else 'none'}: "
            f"{time.perf_counter() - started:.0f} s{' (' + measured.error + ')' if measured.error else ''}")
        return measured

    def plans() -> None:
        for fraction in fractions:
            started = time.perf_counter()
            result.plans[fraction] = plan_for(model, fraction, batch_size, lower)
            log(f"  {model} explain budget {fraction}: {time.perf_counter() - started:.0f} s")

    def run_all(batch: list[tuple[str, float | None, str, dict[str, Any]]], also: Any = None) -> list[Measured]:
        if jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(run, task) for task in batch]
                if also is not None:
                    also()
                return [future.result() for future in futures]
        done = [run(task) for task in batch]
        if also is not None:
            also()
        return done

    for (who, fraction, _, _), item in zip(tasks, run_all(tasks, plans)):
        (result.mx if who == "mxfp8" else result.torch)[fraction] = item
    result.torch[1.0] = result.torch[None]
    held = next((p.input_bytes for p in result.plans.values() if not p.error), None)
    for fraction in fractions:
        peak = result.torch[fraction].tensor_peak_bytes
        if peak is not None and held is not None:
            result.matched_budget[fraction] = peak + held
    matched_tasks = [("mxfp8", f"{budget}B", MX_FACTORY, {**common, "memory_budget": f"{budget}B"})
                     for budget in result.matched_budget.values()]
    for fraction, item in zip(result.matched_budget, run_all(matched_tasks)):
        result.matched[fraction] = item
    return result


# --------------------------------------------------------------------------- table


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else str(value)


def _ms(value: float | None, sign: bool = False) -> str:
    return "-" if value is None else (f"{value * 1e3:+.0f}" if sign else f"{value * 1e3:.0f}")


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _flag(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _monotone(peaks: list[int | None]) -> str:
    """Whether the measured peaks (budgets falling; failed cells skipped) never rise by more
    than the noise tolerance."""
    known = [p for p in peaks if p is not None]
    if len(known) < 2:
        return "-"
    verdict = _flag(all(b <= a + MONOTONE_TOLERANCE_BYTES for a, b in zip(known, known[1:])))
    return verdict + (f" ({len(known)} of {len(peaks)} budgets measured)" if len(known) < len(peaks) else "")


COLUMNS = (("budget", 6), ("budget MiB", 10), ("pred MiB", 8), ("mx MiB", 6), ("mx RSS", 6), ("torch MiB", 9),
           ("torch RSS", 9), ("mx+p/bud", 8), ("in bud", 6), ("rc est ms", 9),
           ("mx ms", 6), ("mx +ms", 6), ("torch ms", 8), ("torch +ms", 9), ("solve s", 7), ("plan s", 6))
MATCHED_COLUMNS = (("torch f", 7), ("budget B", 10), ("torch+p B", 10), ("mx+p B", 10), ("in bud", 6),
                   ("torch ms", 8), ("mx ms", 6))


def _peak(measured: Measured) -> int | None:
    """The peak the flags use: tensor storage (what the planner models), else the RSS peak."""
    return measured.tensor_peak_bytes if measured.tensor_peak_bytes is not None else measured.step_peak_bytes


def table(result: ModelResult) -> list[str]:
    """The side-by-side table of one model, its flags and its errors, as lines."""
    lines = [" ".join(f"{name:>{width}}" for name, width in COLUMNS)]
    mx_base, torch_base = result.mx[None], result.torch[None]
    errors = []
    for fraction in (None, *result.fractions):
        mx, tc = result.mx[fraction], result.torch[fraction]
        plan = result.plans.get(fraction, Planned())
        for who, item in (("mxfp8", mx), ("torch", tc), ("explain", plan)):
            if item.error:
                errors.append(f"{fraction if fraction is not None else 'none'} {who}: {item.error}")
        label = "none" if fraction is None else f"{fraction:.2f}"
        held = plan.input_bytes or plan.param_bytes  # parameters + inputs: resident before the step
        with_held = None if _peak(mx) is None or fraction is None else _peak(mx) + held
        in_budget = None if with_held is None or plan.budget_bytes is None else with_held <= plan.budget_bytes
        mx_over = None if mx.step_s is None or mx_base.step_s is None else mx.step_s - mx_base.step_s
        torch_over = None if tc.step_s is None or torch_base.step_s is None else tc.step_s - torch_base.step_s
        cells = (
            label, _mib(plan.budget_bytes), _mib(plan.predicted_peak_bytes),
            _mib(mx.tensor_peak_bytes), _mib(mx.step_peak_bytes), _mib(tc.tensor_peak_bytes), _mib(tc.step_peak_bytes),
            _ratio(with_held, plan.budget_bytes), _flag(in_budget),
            _ms(plan.recompute_time_s), _ms(mx.step_s), _ms(mx_over, sign=True) if fraction is not None else "-",
            _ms(tc.step_s), _ms(torch_over, sign=True) if fraction is not None else "-",
            "-" if fraction is None or plan.error else f"{plan.solve_s:.2f}",
            "-" if fraction is None or plan.error else f"{plan.plan_and_partition_s:.2f}",
        )
        lines.append(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS)))
    order = list(result.fractions)  # budgets falling
    lines.append(
        f"monotone peak as the budget falls (within {MONOTONE_TOLERANCE_BYTES // MIB} MiB): "
        f"mxfp8 tensors {_monotone([result.mx[f].tensor_peak_bytes for f in order])}, "
        f"RSS {_monotone([result.mx[f].step_peak_bytes for f in order])}; "
        f"torch tensors {_monotone([result.torch[f].tensor_peak_bytes for f in order])}, "
        f"RSS {_monotone([result.torch[f].step_peak_bytes for f in order])}")
    any_plan = next((p for p in result.plans.values() if not p.error), Planned())
    graphs = max((p.graphs for p in result.plans.values()), default=0)
    lines.append(f"parameters {any_plan.param_bytes / MIB:.2f} MiB, with inputs {any_plan.input_bytes / MIB:.2f} MiB; "
                 f"modelled keep-everything peak {_mib(any_plan.keep_all_peak_bytes)} MiB, lowest reachable "
                 f"{_mib(any_plan.min_peak_bytes)} MiB; planned dynamo graphs: {graphs}"
                 + (" (budgets, peaks and times summed over graphs)" if graphs > 1 else ""))
    lines.append("matched budgets (torch's fraction -> the bytes its step used; mxfp8 run with that byte budget):")
    lines.extend(matched_table(result, any_plan.input_bytes))
    errors.extend(f"matched {f:.2f} mxfp8: {m.error}" for f, m in result.matched.items() if m.error)
    lines.extend(f"error: {e}" for e in errors)
    return lines


def matched_table(result: ModelResult, held: int) -> list[str]:
    """One row per torch fraction: the byte budget it maps to, torch's and mxfp8's peaks (with
    the ``held`` parameter and input bytes) and whether mxfp8's is within it (see the module
    docstring, "Matched budgets"). Bytes are exact, not rounded."""
    lines = [" ".join(f"{name:>{width}}" for name, width in MATCHED_COLUMNS)]
    for fraction in result.fractions:
        budget = result.matched_budget.get(fraction)
        mx = result.matched.get(fraction, Measured())
        torch_peak = _peak(result.torch[fraction])
        mx_held = None if _peak(mx) is None else _peak(mx) + held
        cells = (f"{fraction:.2f}", _bytes(budget), _bytes(None if torch_peak is None else torch_peak + held),
                 _bytes(mx_held), _flag(None if mx_held is None or budget is None else mx_held <= budget),
                 _ms(result.torch[fraction].step_s), _ms(mx.step_s))
        lines.append(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, MATCHED_COLUMNS)))
    return lines


LEGEND = """\
budget MiB, pred MiB: mxcompile's budget for f (AdapterResult.budget_for_fraction) and the plan's
  predicted peak, both including parameters and inputs (report.memory_plan of mxcompile.measure.steps.plan_report);
  rc est ms: the plan's estimated recompute time (CPU roofline profile)
mx MiB, torch MiB: measured peak of live tensor storage the step allocated (torch.profiler memory
  events, fresh process): what the planner models; parameters and inputs excluded
mx RSS, torch RSS: measured resident-set step peak (VmHWM - VmRSS before the step): adds allocator
  slack, fragmentation and Python noise
mx+p/bud, in bud: (mx MiB + parameter and input bytes) / budget, and whether it is <= 1
  (torch MiB at the same f is not a matched budget: the fractions differ, see --help)
matched budgets: torch f, torch's fraction; budget B, torch's measured tensor peak + parameter
  and input bytes; torch+p B, mx+p B: the two measured peaks with the parameters and inputs;
  in bud: mx+p B <= budget B, i.e. mxfp8 at or under torch at that equal memory; ms: step times
mx ms, torch ms: median step time; +ms: minus the same backend's no-budget step time (measured
  overhead); torch's default budget is 1.0, so its 1.00 row is its no-budget run
solve s: planner solver wall time (plan_activation_memory + budget_curve); plan s: the whole
  plan_and_partition step (partition, plan, apply, model the result), both within explain"""


def synthetic_planner(fractions: tuple[float, ...], n_layers: int = SYNTHETIC_LAYERS) -> list[str]:
    """Planner wall time on an ``n_layers`` GPT-like synthetic problem, one line per budget."""
    from mxcompile.planner import plan_activation_memory
    from mxcompile.planner.synthetic import transformer_problem

    lines = []
    for fraction in fractions:
        problem, _ = transformer_problem(n_layers, budget_fraction=fraction)
        started, cpu = time.perf_counter(), time.process_time()
        plan = plan_activation_memory(problem, solver=PLAN_SOLVER)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        lines.append(
            f"  {n_layers} layers, {len(problem.tensors)} tensors, {len(problem.steps)} steps, f={fraction:g}: "
            f"{plan.solver} {wall:.2f} s wall ({cpu:.2f} s CPU), peak/budget "
            f"{plan.peak_bytes / problem.budget_bytes:.3f}, +{plan.extra_time_s * 1e3:.2f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, ModelResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"default {list(MODELS)}")
    parser.add_argument("--fractions", nargs="+", type=float, default=None, help=f"default {list(FRACTIONS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps before the measured one (median of all)")
    parser.add_argument("--lower", choices=("inductor", "eager"), default=None,
                        help="inductor (default) or eager: both backends skip Inductor code generation "
                             "(mxfp8 with eager lowering, torch with aot_eager_decomp_partition; same partitioners)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="measuring children run at once; > 1 is faster but the step times share the CPUs")
    parser.add_argument("--quick", action="store_true",
                        help=f"gpt-tiny, budgets 1.0 and 0.5, batch {QUICK_BATCH}, 2 timed steps, eager lowering")
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.fractions = args.fractions or list(QUICK_FRACTIONS)
        args.batch, args.steps, args.lower = QUICK_BATCH, 1, args.lower or "eager"
    args.lower = args.lower or "inductor"
    models = tuple(args.models or MODELS)
    fractions = tuple(sorted(set(args.fractions or FRACTIONS), reverse=True))

    import torch

    started = time.perf_counter()
    print(f"activation-memory budgets on CPU, {args.lower} lowering, batch {args.batch}, {args.jobs} job(s), "
          f"{torch.get_num_threads()} threads "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), torch {torch.__version__}")
    results = {}
    for model in models:
        results[model] = run_model(model, fractions, batch_size=args.batch, warmup=args.warmup, steps=args.steps,
                                   lower=args.lower, jobs=args.jobs, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"\n== {model} ==")
        print("\n".join(table(results[model])), flush=True)
    print("\n" + LEGEND)
    print(f"\nplanner alone ({PLAN_SOLVER} solver) on a synthetic GPT-like problem:")
    print("\n".join(synthetic_planner(fractions)))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    outcome = main()
    failed = any(m.error for r in outcome.values() for m in (*r.mx.values(), *r.torch.values(), *r.plans.values(),
                                                          *r.matched.values()))
    sys.exit(1 if failed else 0)
