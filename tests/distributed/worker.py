"""Multi-process scenarios for tests/distributed, run under torchrun with 2 CPU ranks (gloo):

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/worker.py \
        --out results.json --scenarios reference,ddp,fsdp,fsdp_mx,fsdp_nvfp4,ddp_nvfp4,tp,tp_misaligned,all_gather

Each scenario trains the tiny built-in GPT for STEPS AdamW steps compiled with the mxfp8
pipeline (`--lowering eager`: AOTAutograd + passes + partition, graphs run op by op; `inductor`:
the full backend) and records, on rank 0, losses, the first step's gradients compared with the
single-process reference (same initial weights, the concatenation of the ranks' batches), the
GEMM decisions of every rank and the bytes of the collectives.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mxcompile.backend import compile_graph
from mxcompile.config import MXConfig
from mxcompile.examples.gpt import GPT, gpt_factory, lm_loss
from mxcompile.lowering import eager_compiler, inductor_compiler
from mxcompile.report import Report

import usage_scenarios  # this folder: torchrun puts the script's folder on sys.path

MODEL_SIZE = "tiny"
STEPS = 3
BATCH_PER_RANK = 2
LR = 1e-3
DATA_SEED = 1234
MODEL_SEED = 0
MEASURED_STEP = 1  # collectives are counted on this (0-based) step: after the first, warm
MISALIGNED_K = 65  # in_features that DTensor shards as [0, 33) and [33, 65) on 2 ranks
MISALIGNED_N = 64
ALL_GATHER_SHAPE = (128, 96)  # (N, K) of the weight all-gathered by all_gather_mx_weight
OCTAVES = 24  # more than e4m3's range below a block maximum (about 17 octaves)
ROW_STRIDE, COL_STRIDE = 7, 5  # coprime with OCTAVES: every residue appears within a block
_BLOCK_PREFIX = re.compile(r"^blocks\.\d+\.")

SCENARIOS = ("reference", "ddp", "fsdp", "fsdp_mx", "fsdp_nvfp4", "ddp_nvfp4", "tp", "tp_misaligned", "all_gather",
             "usages", "llama")
SCENARIOS_4_RANKS = ("llama_2d",)  # run only when asked: --nproc-per-node 4 --scenarios llama_2d


def make_backend(config: MXConfig, report: Report, lowering: str) -> Callable[..., Any]:
    lower = {"eager": eager_compiler, "inductor": inductor_compiler}[lowering]
    return functools.partial(compile_graph, config=config, lower=lower, report=report)


def token_batches(world: int) -> torch.Tensor:
    """(STEPS, world * BATCH_PER_RANK, block_size + 1) token ids, the same on every rank."""
    block = gpt_factory(MODEL_SIZE)[0].config.block_size
    generator = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, 256, (STEPS, world * BATCH_PER_RANK, block + 1), generator=generator)


def rank_rows(step_tokens: torch.Tensor, rank: int) -> torch.Tensor:
    return step_tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]


def new_model() -> GPT:
    return gpt_factory(MODEL_SIZE, seed=MODEL_SEED)[0]


def summarize(report: Report) -> list[dict[str, Any]]:
    return [
        {"graph": d.graph, "kind": d.kind, "decision": d.decision, "format": d.format, "op": d.op,
         "module": _BLOCK_PREFIX.sub("", d.module), "full_module": d.module,
         "k": d.shapes[0][-1] if d.kind != "attention" else None, "reason": d.reason}
        for d in report.decisions
    ]


def full_grads(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (DTensor shards gathered; a collective)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name.removeprefix(prefix)] = grad.detach().clone()
    return grads


def train(forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, batches: list[torch.Tensor],
          *, mean_over_ranks: bool, grad_prefix: str = "", counter: Any = None) -> dict[str, Any]:
    """STEPS AdamW steps; losses (averaged over ranks for data parallelism), the first step's
    full gradients and the collectives of step MEASURED_STEP (when a counter is given)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads, comm = [], None, None
    for step, tokens in enumerate(batches):
        if counter is not None and step == MEASURED_STEP:
            counter.reset()
        loss = lm_loss(forward(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if step == 0:
            first_grads = full_grads(model, grad_prefix)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if counter is not None and step == MEASURED_STEP:
            comm = counter.totals.as_dict()
        value = loss.detach().clone()
        if mean_over_ranks:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return {"losses": losses, "grads": first_grads, "comm": comm}


def compare_grads(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    if set(grads) != set(reference):
        raise AssertionError(f"parameter names differ: {sorted(set(grads) ^ set(reference))}")
    worst_rel, worst_name, max_abs = 0.0, "", 0.0
    for name, ref in reference.items():
        diff = (grads[name].double() - ref.double()).norm().item()
        rel = diff / max(ref.double().norm().item(), torch.finfo(torch.float64).tiny)
        max_abs = max(max_abs, (grads[name] - ref).abs().max().item())
        if rel >= worst_rel:
            worst_rel, worst_name = rel, name
    return {"worst_rel_norm_err": worst_rel, "worst_param": worst_name, "max_abs_err": max_abs,
            "bitwise_equal": all(torch.equal(grads[n], reference[n]) for n in reference)}


def gather_decisions(report: Report) -> list[list[dict[str, Any]]]:
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, summarize(report))
    return per_rank


# Scenarios ----------------------------------------------------------------------------------

def run_reference(batches: torch.Tensor, lowering: str) -> dict[str, Any]:
    """Single process, global batch (rank 0 only; the other ranks wait)."""
    result: dict[str, Any] = {}
    if dist.get_rank() == 0:
        report = Report({})
        model = new_model()
        compiled = torch.compile(model, backend=make_backend(MXConfig(), report, lowering))
        result = train(compiled, model, list(batches), mean_over_ranks=False)
        result["decisions"] = [summarize(report)]
    dist.barrier()
    return result


def run_ddp(batches: torch.Tensor, lowering: str, config: MXConfig | None = None) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    report = Report({})
    model = new_model()
    ddp = DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend=make_backend(config or MXConfig(), report, lowering))
    rank = dist.get_rank()
    result = train(compiled, model, [rank_rows(b, rank) for b in batches], mean_over_ranks=True)
    result["decisions"] = gather_decisions(report)
    return result


def run_fsdp(batches: torch.Tensor, lowering: str, config: MXConfig) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from mxcompile.distributed import CollectiveCounter, compile_fsdp2, shard_gpt_fsdp2
    from mxcompile.distributed.mx_all_gather import MXAllGatherWeight

    report = Report({})
    model = new_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mx_decisions = shard_gpt_fsdp2(model, mesh, config=config)
    compile_fsdp2(model, backend=make_backend(config, report, lowering))
    rank = dist.get_rank()
    with CollectiveCounter() as counter:
        result = train(model, model, [rank_rows(b, rank) for b in batches], mean_over_ranks=True,
                       counter=counter)
    result["decisions"] = gather_decisions(report)
    result["mx_weights"] = mx_decisions
    result["gather_counts"] = {
        name: {"forward": p._local_tensor.stats.forward, "backward": p._local_tensor.stats.backward}
        for name, p in model.named_parameters()
        if isinstance(getattr(p, "_local_tensor", None), MXAllGatherWeight)
    }
    result["param_numel"] = {name: p.numel() for name, p in model.named_parameters()}
    return result


# The FP4 scenarios: every switch of the nvfp4 recipe on but the high-precision layers (0):
# compile_fsdp2 compiles a graph per unit, the written-out copy one graph, and the rule counts
# each graph's layers.
NVFP4_SCENARIO_OPTIONS = {"high_precision_layers": 0}


def data_parallel_nvfp4(batches: torch.Tensor, lowering: str, config: MXConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """The first step's loss and gradients of data parallelism written out: every rank's
    unsharded copy compiled alike on its own rows, the gradients averaged over ranks. Not one
    process: NVFP4's tensor scale comes from each rank's local amax and the stochastic-rounding
    draws from its local operands, so data parallelism changes the quantization; DDP and FSDP2
    must change nothing more than the order of fp32 sums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = new_model()
    compiled = torch.compile(model, backend=make_backend(config, Report({}), lowering))
    tokens = rank_rows(batches[0], rank)
    loss = lm_loss(compiled(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    expected = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        expected[name] = param.grad / world
    dist.all_reduce(loss)
    torch._dynamo.reset()
    return loss.item() / world, expected


def run_nvfp4(batches: torch.Tensor, lowering: str, layout: str) -> dict[str, Any]:
    """DDP ("ddp") or FSDP2 with its high-precision all-gather ("fsdp") under the nvfp4 recipe,
    against `data_parallel_nvfp4`."""
    config = MXConfig.for_recipe("nvfp4", NVFP4_SCENARIO_OPTIONS)
    first_loss, expected = data_parallel_nvfp4(batches, lowering, config)
    result = run_ddp(batches, lowering, config) if layout == "ddp" else run_fsdp(batches, lowering, config)
    grads = result.pop("grads")
    result["first_loss_data_parallel"] = first_loss
    result["grads_vs_data_parallel"] = compare_grads(grads, expected)
    return result


def run_tp(batches: torch.Tensor, lowering: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mxcompile.distributed import gpt_tensor_parallel_plan, sharded_contraction_problems

    report = Report({})
    model = new_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, gpt_tensor_parallel_plan(model))
    compiled = torch.compile(model, backend=make_backend(MXConfig(), report, lowering))
    result = train(compiled, model, list(batches), mean_over_ranks=False)
    result["decisions"] = gather_decisions(report)
    result["problems"] = [str(p) for p in sharded_contraction_problems(model)]
    return result


class _MisalignedPair(nn.Module):
    """Linear(64, 65) ColwiseParallel then Linear(65, 64) RowwiseParallel: DTensor shards the
    65-long axis as [0, 33) and [33, 65) on 2 ranks (the dX GEMM of the first and the
    forward GEMM of the second contract over it)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(MISALIGNED_N, MISALIGNED_K, bias=False)
        self.down = nn.Linear(MISALIGNED_K, MISALIGNED_N, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def run_tp_misaligned(lowering: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mxcompile.distributed import sharded_contraction_problems

    torch._dynamo.reset()
    torch.manual_seed(MODEL_SEED)
    model = _MisalignedPair()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # The column shard stays a DTensor: a plain local output of uneven width could not be
    # told apart from an even shard by RowwiseParallel.
    parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False),
                                     "down": RowwiseParallel()})
    report = Report({})
    x = torch.randn(MISALIGNED_N, MISALIGNED_N, generator=torch.Generator().manual_seed(DATA_SEED))
    x.requires_grad_()  # so that up's dX GEMM (contracting the cut axis) exists
    torch.compile(model, backend=make_backend(MXConfig(), report, lowering))(x).sum().backward()
    return {"current": gather_decisions(report),
            "problems": [str(p) for p in sharded_contraction_problems(model)]}


def graded_weight(shape: tuple[int, int]) -> torch.Tensor:
    """Magnitudes 2**-(a_i + b_j) with a_i, b_j cycling through OCTAVES octaves within every
    block of 32 along either axis: quantizing along the wrong axis or with blocks cut at the
    wrong place changes values (iid Gaussian data would not show it)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    rows = torch.exp2(-((torch.arange(shape[0]) * ROW_STRIDE) % OCTAVES).float()).unsqueeze(1)
    cols = torch.exp2(-((torch.arange(shape[1]) * COL_STRIDE) % OCTAVES).float()).unsqueeze(0)
    return torch.randn(shape, generator=generator) * rows * cols


def run_all_gather() -> dict[str, Any]:
    from mxcompile.distributed import CollectiveCounter, all_gather_mx_weight
    from mxcompile.numerics import quantize_mx

    rank, world = dist.get_rank(), dist.get_world_size()
    full = graded_weight(ALL_GATHER_SHAPE)
    shard = full.chunk(world, dim=0)[rank].contiguous()
    result: dict[str, Any] = {}
    for axis in (1, 0):
        for dtype in (torch.float32, torch.bfloat16):
            with CollectiveCounter() as counter:
                gathered = all_gather_mx_weight(shard.to(dtype), axis=axis)
            expected = quantize_mx(full.to(dtype), axis=axis)
            result[f"axis{axis}_{str(dtype).removeprefix('torch.')}"] = {
                "data_equal": torch.equal(gathered.data.view(torch.uint8), expected.data.view(torch.uint8)),
                "scale_equal": torch.equal(gathered.scale_bytes, expected.scale_bytes),
                "bytes": counter.totals.bytes["all_gather"],
                "shard_numel": shard.numel(),
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(SCENARIOS) - set(SCENARIOS_4_RANKS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {list(SCENARIOS + SCENARIOS_4_RANKS)}")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    batches = token_batches(dist.get_world_size())
    results: dict[str, Any] = {"world_size": dist.get_world_size(), "lowering": args.lowering}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name in scenarios:
        torch._dynamo.reset()
        if name == "reference":
            result = run_reference(batches, args.lowering)
        elif name == "ddp":
            result = run_ddp(batches, args.lowering)
        elif name == "fsdp":
            result = run_fsdp(batches, args.lowering, MXConfig(fsdp_all_gather="bf16"))
        elif name == "fsdp_mx":
            result = run_fsdp(batches, args.lowering, MXConfig(fsdp_all_gather="mxfp8"))
        elif name == "fsdp_nvfp4":
            result = run_nvfp4(batches, args.lowering, "fsdp")
        elif name == "ddp_nvfp4":
            result = run_nvfp4(batches, args.lowering, "ddp")
        elif name == "tp":
            result = run_tp(batches, args.lowering)
        elif name == "tp_misaligned":
            result = run_tp_misaligned(args.lowering)
        elif name == "usages":
            result = usage_scenarios.run_usages(lambda config, report: make_backend(config, report, args.lowering))
        elif name == "llama_2d":
            result = usage_scenarios.run_llama_2d(lambda config, report: make_backend(config, report, args.lowering))
        elif name == "llama":
            result = usage_scenarios.run_llama(lambda config, report: make_backend(config, report, args.lowering))
        else:
            result = run_all_gather()
        if "grads" in result:
            grads[name] = result.pop("grads")
        results[name] = result
    if dist.get_rank() == 0:
        reference = grads.get("reference")
        for name, g in grads.items():
            if name != "reference" and reference is not None:
                results[name]["grads_vs_reference"] = compare_grads(g, reference)
        if "fsdp" in grads and "fsdp_mx" in grads:
            results["fsdp_mx"]["grads_vs_fsdp"] = compare_grads(grads["fsdp_mx"], grads["fsdp"])
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
