"""Scenarios of worker.py for issue 17: the ways users combine torch.distributed with
`backend="mxfp8"` on a plain torch.nn model, and the generic helpers on a small HF Llama.

Every scenario runs one training step (or a few) on every rank and reports, on rank 0, what
the backend compiled, the warnings mxcompile gave, and the first step's gradients compared
with two single-process references computed on each rank from the same initial weights and
the global batch: the MX pipeline (`torch.compile(model)` with the same backend) and plain
fp32 eager.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mxcompile.config import MXConfig
from mxcompile.report import Report

SEQ_IN, SEQ_HIDDEN = 128, 256  # the nn.Sequential(Linear(128, 256), GELU(), Linear(256, 128))
ROWS_PER_RANK = 32  # a whole MX block of tokens per rank: the dW GEMM's blocks are global blocks
SEED = 0
DATA_SEED = 4321

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
# 4 kv heads of 16: k_proj and v_proj have N = 64, 32 rows per rank, so every shard is whole
# MX blocks along N and K (tensor parallelism then converts every GEMM as on one process).
LLAMA_SEQ, LLAMA_BATCH_PER_RANK, LLAMA_STEPS, LLAMA_LR = 16, 2, 2, 1e-3

Backend = Callable[..., Any]


def _sequential() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(SEQ_IN, SEQ_HIDDEN), nn.GELU(), nn.Linear(SEQ_HIDDEN, SEQ_IN))


def _global_rows(world: int) -> torch.Tensor:
    return torch.randn(world * ROWS_PER_RANK, SEQ_IN, generator=torch.Generator().manual_seed(DATA_SEED))


def _local_rows(rows: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return rows[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _step(forward: Callable[[torch.Tensor], torch.Tensor], params: dict[str, nn.Parameter],
          rows: torch.Tensor) -> dict[str, torch.Tensor]:
    forward(rows).square().mean().backward()
    return {name: _full(p.grad) for name, p in params.items()}


def _rel_err(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(((grads[n].double() - r.double()).norm() / r.double().norm()).item() for n, r in reference.items())


def _caught(fn: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if str(w.message).startswith("mxfp8:")]


def run_usages(make_backend: Callable[[MXConfig, Report], Backend]) -> dict[str, Any]:
    """The four usages of the issue plus `mxcompile.distributed.fully_shard`, each on a fresh
    copy of the same nn.Sequential, one step on 2 ranks of 32 rows each."""
    import mxcompile
    from mxcompile.coverage import uncompiled_linears
    from mxcompile.distributed import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = dist.get_world_size()
    rows = _global_rows(world)
    local = _local_rows(rows)
    mesh = init_device_mesh("cpu", (world,))

    reference = _sequential()
    mx_reference = _step(torch.compile(reference, backend=make_backend(MXConfig(), Report({}))),
                         dict(reference.named_parameters()), rows)
    plain = _sequential()
    fp32_reference = _step(plain, dict(plain.named_parameters()), rows)

    def record(build: Callable[[nn.Module, Backend], tuple[Callable, nn.Module]],
               warn: Callable[[], Any] | None = None, inputs: torch.Tensor | None = None) -> dict[str, Any]:
        """One step of `build(model, backend)`'s (forward, root) on `inputs` (default: this
        rank's rows); `warn` builds the same layout with mxcompile.compile, whose warnings are
        recorded."""
        torch._dynamo.reset()
        report = Report({})
        model = _sequential()
        forward, root = build(model, make_backend(MXConfig(), report))
        # After fully_shard (it replaces parameters); torch.compile'd children add _orig_mod.
        params = {name.replace("_orig_mod.", ""): p for name, p in model.named_parameters()}
        grads = _step(forward, params, local if inputs is None else inputs)
        return {
            "converted": sum(d.decision == "mxfp8" for d in report.decisions),
            "vs_mx_reference": _rel_err(grads, mx_reference),
            "vs_fp32": _rel_err(grads, fp32_reference),
            "flagged": [(u.module, u.usage.name) for u in uncompiled_linears(root)],
            "mxcompile_warnings": _caught(warn) if warn is not None else None,
        }

    def compile_ddp(model, backend):
        compiled = torch.compile(DDP(model), backend=backend)
        return compiled, compiled

    def ddp_compile(model, backend):
        wrapped = DDP(torch.compile(model, backend=backend))
        return wrapped, wrapped

    def fsdp_root(model, backend):
        for unit in (model[0], model[2], model):
            torch_fully_shard(unit, mesh=mesh)
        compiled = torch.compile(model, backend=backend)
        return compiled, compiled

    def fsdp_per_linear(model, backend):  # torchtitan's style: compile each unit, put it back
        for index in (0, 2):
            torch_fully_shard(model[index], mesh=mesh)
        for index in (0, 2):
            model[index] = torch.compile(model[index], backend=backend)
        return model, model

    def helper(model, backend):
        result = fully_shard(model, mesh, config=MXConfig(fsdp_all_gather="mxfp8"), backend=backend)
        helper_units.update(result.units)
        return model, model

    helper_units: dict[str, str] = {}

    def tensor_parallel(model, backend):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from mxcompile.distributed import parallelize_module, tensor_parallel_plan

        plan = tensor_parallel_plan(model, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        tp_problems.extend(str(p) for p in parallelize_module(model, mesh, plan))
        compiled = torch.compile(model, backend=backend)
        return compiled, compiled

    tp_problems: list[str] = []

    def fsdp_model() -> nn.Module:
        model = _sequential()
        for unit in (model[0], model[2], model):
            torch_fully_shard(unit, mesh=mesh)
        return model

    results = {
        "compile_ddp": record(compile_ddp, lambda: mxcompile.compile(DDP(_sequential()))),
        "ddp_compile": record(ddp_compile),
        "fsdp_root": record(fsdp_root, lambda: mxcompile.compile(fsdp_model())),
        "fsdp_per_linear": record(fsdp_per_linear, lambda: [mxcompile.compile(m) for m in fsdp_model()[::2]]),
    }
    helper_warnings = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["fully_shard"] = record(helper)
        helper_warnings = [str(w.message) for w in caught if str(w.message).startswith("mxfp8:")]
    results["fully_shard"]["mxcompile_warnings"] = helper_warnings
    results["fully_shard"]["units"] = helper_units
    # Tensor parallelism runs every rank on the global batch (each rank holds a shard of the weights).
    results["tensor_parallel"] = record(tensor_parallel, inputs=rows)
    results["tensor_parallel"]["problems"] = tp_problems
    return results


# HF Llama -------------------------------------------------------------------------------------

def _llama() -> nn.Module:
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _llama_batches(world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, LLAMA["vocab_size"], (LLAMA_STEPS, world * LLAMA_BATCH_PER_RANK, LLAMA_SEQ + 1),
                         generator=generator)


def _llama_train(forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, batches: list[torch.Tensor],
                 *, mean_over_ranks: bool) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    losses, first = [], None
    for step, tokens in enumerate(batches):
        logits = forward(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if step == 0:
            first = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if mean_over_ranks:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return {"losses": losses, "grads": first}


def _logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(input_ids=ids).logits


def run_llama(make_backend: Callable[[MXConfig, Report], Backend]) -> dict[str, Any]:
    """HF Llama: single-process MX reference, `fully_shard` (MX all-gather) and
    `parallelize_module` with `tensor_parallel_plan` on 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mxcompile.distributed import fully_shard, parallelize_module, tensor_parallel_plan

    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _llama_batches(world)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}

    torch._dynamo.reset()
    report = Report({})
    model = _llama()
    reference = _llama_train(_logits(torch.compile(model, backend=make_backend(MXConfig(), report))), model,
                             list(batches), mean_over_ranks=False)
    out["reference"] = {"losses": reference["losses"],
                        "converted": sum(d.decision == "mxfp8" for d in report.decisions)}

    torch._dynamo.reset()
    report = Report({})
    model = _llama()
    config = MXConfig(fsdp_all_gather="mxfp8")
    result = fully_shard(model, mesh, config=config, backend=make_backend(config, report))
    rows = slice(rank * LLAMA_BATCH_PER_RANK, (rank + 1) * LLAMA_BATCH_PER_RANK)
    fsdp = _llama_train(_logits(model), model, [b[rows] for b in batches], mean_over_ranks=True)
    out["fsdp"] = {"losses": fsdp["losses"], "grads_rel_err": _rel_err(fsdp["grads"], reference["grads"]),
                   "units": dict(result.units), "all_gather": dict(result.all_gather),
                   "converted": sum(d.decision == "mxfp8" for d in report.decisions)}

    torch._dynamo.reset()
    report = Report({})
    model = _llama()
    plan = tensor_parallel_plan(model, {
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    })
    problems = parallelize_module(model, mesh, plan)
    tp = _llama_train(_logits(torch.compile(model, backend=make_backend(MXConfig(), report))), model,
                      list(batches), mean_over_ranks=False)
    out["tp"] = {"losses": tp["losses"], "grads_rel_err": _rel_err(tp["grads"], reference["grads"]),
                 "plan": sorted(plan), "problems": [str(p) for p in problems],
                 "converted": sum(d.decision == "mxfp8" for d in report.decisions)}
    return out


LLAMA_PLAN_PATTERNS = ("model.layers.*.self_attn.[qkv]_proj", "model.layers.*.self_attn.o_proj",
                       "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj")
MESH_2D = (2, 2)  # (dp, tp)


def _llama_tp_plan(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mxcompile.distributed import tensor_parallel_plan

    colwise, rowwise = ColwiseParallel(), RowwiseParallel()
    styles = [colwise, rowwise, colwise, colwise, rowwise]
    return tensor_parallel_plan(model, dict(zip(LLAMA_PLAN_PATTERNS, styles, strict=True)))


def run_llama_2d(make_backend: Callable[[MXConfig, Report], Backend]) -> dict[str, Any]:
    """HF Llama on a (dp=2, tp=2) mesh of 4 ranks: `parallelize_module` over tp, then
    `fully_shard` over dp (MX all-gather requested), against one process on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from mxcompile.distributed import all_gather_decisions, fully_shard, parallelize_module

    if dist.get_world_size() != MESH_2D[0] * MESH_2D[1]:
        raise SystemExit(f"llama_2d needs {MESH_2D[0] * MESH_2D[1]} ranks, got {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", MESH_2D, mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    batches = _llama_batches(MESH_2D[0])

    torch._dynamo.reset()
    model = _llama()
    reference = _llama_train(_logits(torch.compile(model, backend=make_backend(MXConfig(), Report({})))), model,
                             list(batches), mean_over_ranks=False)

    torch._dynamo.reset()
    report = Report({})
    model = _llama()
    problems = parallelize_module(model, mesh["tp"], _llama_tp_plan(model))
    config = MXConfig(fsdp_all_gather="mxfp8")
    result = fully_shard(model, mesh["dp"], config=config, backend=make_backend(config, report))
    rows = slice(dp_rank * LLAMA_BATCH_PER_RANK, (dp_rank + 1) * LLAMA_BATCH_PER_RANK)
    run = _llama_train(_logits(model), model, [b[rows] for b in batches], mean_over_ranks=True)
    return {"reference_losses": reference["losses"], "losses": run["losses"],
            "grads_rel_err": _rel_err(run["grads"], reference["grads"]),
            "problems": [str(p) for p in problems], "all_gather": dict(result.all_gather),
            "explained_all_gather": all_gather_decisions(model),
            "converted": sum(d.decision == "mxfp8" for d in report.decisions)}
