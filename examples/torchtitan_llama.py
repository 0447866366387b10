"""Train torchtitan's llama3 with `backend="mxfp8"`, as torchtitan's trainer parallelizes it:
per-block `block.compile(backend=..., fullgraph=True)` (torchtitan's `apply_compile`) and FSDP2
(`apply_fsdp_to_decoder`), both applied by torchtitan's own `parallelize_llama`.

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_llama.py --steps 20
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_llama.py --steps 20 --compile-lm-head

On CPU it runs on gloo ranks; on GPUs (one per rank) on NCCL (not tried). Rank 0 prints, per
step, the global batch's loss (torchtitan's CrossEntropyLoss: each rank's token sum over the
global token count, summed over the ranks) beside two single-process runs of the same initial
weights on the same global batches: eager fp32, and torchtitan's `apply_compile` with the same
backend (no FSDP). Then the first step's gradients compared, and what the backend converted:
`mxcompile.report_of(block)` for each transformer block (every block runs the one shared block
graph) and the converted fraction of the model's GEMM FLOPs. `--compile-lm-head` also compiles
the output projection (outside the blocks, it otherwise runs eagerly in high precision).
torchtitan's own MXFP8 converter (torchao `MXFP8Linear`) is tried beside it: where it is
accepted (sm100+), the same steps are trained with it and its losses printed in the same table
(never run so far); elsewhere its refusal is printed. `--json FILE` writes everything as JSON
(read by tests/integrations/test_torchtitan.py). docs/torchtitan.md has the results.

What torchtitan 0.3 needs here:
* torchtitan picks its device type at import (`torchtitan.tools.utils.device_type`): "cuda"
  whenever no accelerator is found. Without CUDA the mesh is built with "cpu" instead.
* torchtitan sets FSDP2's gradient divide factor to 1 (it scales the loss by the global token
  count), so FSDP2 reduce-scatters with PREMUL_SUM, which gloo refuses;
  `set_force_sum_reduction_for_comms(True)` on every FSDP unit makes it a SUM (without CUDA).
* Its default `parallelism.spmd_backend="spmd_types"` fails in torch 2.13's `fully_shard`
  ("When dp_mesh_dims is provided, all parameters must be DTensors ..."): "partial_dtensor" is
  used (`--spmd-backend`).

The model is small (`--dim 64 --layers 2 --heads 2`: head_dim 32, so attention's GEMMs are
whole MX blocks; torchtitan's debug model has head_dim 16, which keeps attention in high
precision, reported as such: `--heads 4`). Attention is torchtitan's `ScaledDotProductAttention`:
its default FlexAttention is refused by torchtitan's `apply_compile` for any backend other than
inductor and aot_eager (the message is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import mxcompile

DATA_SEED = 1234
MODEL_SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2, help="head_dim = dim / heads (32 or more converts attention)")
    p.add_argument("--ffn", type=int, default=128, help="feed-forward hidden size (a multiple of 32)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="FSDP2's compute dtype of parameters (torchtitan's training.mixed_precision_param)")
    p.add_argument("--backend", default="mxfp8", help="torchtitan's compile.backend")
    p.add_argument("--lowering", choices=["inductor", "eager"], default="inductor",
                   help="inductor: compile.backend is the backend's name, as a user writes it; eager: the same "
                        "mxfp8 passes and reports with the graphs run op by op, without Inductor's compile time "
                        "(the CI test)")
    p.add_argument("--spmd-backend", default="partial_dtensor",
                   choices=["spmd_types", "full_dtensor", "partial_dtensor"],
                   help="torchtitan's parallelism.spmd_backend (its default: spmd_types)")
    p.add_argument("--compile-lm-head", action="store_true",
                   help="also compile the output projection with the backend, so that it runs in MX too")
    p.add_argument("--no-torchao", action="store_true", help="skip torchtitan's torchao MXFP8 converter")
    p.add_argument("--json", default=None, help="write the results of rank 0 here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- torchtitan set-up

def use_cpu_device_type() -> None:
    """torchtitan's device type is chosen at import: without CUDA it is still "cuda"."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, parallel_dims, dist_utils):
        module.device_type = "cpu"


def model_config(args: argparse.Namespace, attention: str = "sdpa"):
    """A small torchtitan llama3 config, built with torchtitan's own layer builder (as its
    debug model is). attention: "sdpa" (torchtitan's ScaledDotProductAttention, causal) or
    "flex" (its default)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.llama3 import (
        Llama3Model, _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init,
    )

    head_dim = args.dim // args.heads
    layers = _build_llama3_layers(
        n_layers=args.layers, dim=args.dim, n_heads=args.heads, hidden_dim=args.ffn,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=4 * args.seq, theta=500000, scaling="llama"),
        attn_backend="flex", fuse_qkv=True,
    )
    if attention == "sdpa":
        # torchtitan's get_attention_config refuses "sdpa" for language models (it cannot take
        # per-document masks); with one document per sequence, causal SDPA is the same attention.
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=args.dim, vocab_size=args.vocab,
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=args.dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=args.dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=args.dim, out_features=args.vocab,
                              param_init=_output_linear_init(args.dim)),
        layers=layers,
    )
    # What torchtitan's trainer does before building (Llama3Model.Config.update_from_config,
    # whose import of torchtitan.trainer needs the data-loading stack): the sharding declarations
    # that the "spmd_types" and "full_dtensor" SPMD backends apply in parallelize_llama.
    set_llama3_sharding_config(config, enable_sp=parallelism_config(args).enable_sequence_parallel)
    return config


def parallelism_config(args: argparse.Namespace):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=args.world, spmd_backend=args.spmd_backend)


def build_model(config, device: torch.device) -> torch.nn.Module:
    """Built and initialised by torchtitan's init on every rank from the same seed, so that the
    single-process references start from the weights that FSDP2 then shards."""
    torch.manual_seed(MODEL_SEED)
    with torch.device(device):
        model = config.build()
        model.init_states(buffer_device=device)
    return model.train()


def parallelize(model: torch.nn.Module, args: argparse.Namespace, world: int, backend: Any,
                dump_folder: str) -> Any:
    """torchtitan's parallelize_llama with dp_shard = world (per-block compile, then FSDP2)."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    parallelism = parallelism_config(args)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    compile_config = CompileConfig(enable=True, components=["model"], backend=backend)
    training = TrainingConfig(mixed_precision_param=args.param_dtype, mixed_precision_reduce="float32")
    return parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                             compile_config=compile_config, ac_config=None, dump_folder=dump_folder)


def force_sum_reduction(model: torch.nn.Module) -> int:
    """gloo has no PREMUL_SUM: reduce-scatter with SUM, then divide (the same gradients)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return len(units)


class OneProcess:
    """The ParallelDims that torchtitan's apply_compile reads on one process (tp_enabled only)."""
    tp_enabled = False


def compile_backend(args: argparse.Namespace) -> Any:
    """What torchtitan's compile.backend is set to: the backend's name, or (--lowering eager) the
    backend's recording path with the graphs run op by op."""
    if args.lowering == "inductor" or args.backend != "mxfp8":
        return args.backend
    import functools

    from mxcompile.backend import compile_and_record
    from mxcompile.config import MXConfig
    from mxcompile.lowering import eager_compiler

    return functools.partial(compile_and_record, config=MXConfig(), lower=eager_compiler)


def compile_lm_head(model: torch.nn.Module, backend: Any) -> None:
    """The output projection is outside the blocks that torchtitan compiles. Its forward is
    torch.nn.Linear's, in which dynamo starts no frame (`Module.compile` would compile nothing):
    compile the bound forward, which keeps FSDP2's hooks on `__call__`."""
    model.lm_head.forward = torch.compile(model.lm_head.forward, backend=backend, fullgraph=True)


def flex_attention_refusal(args: argparse.Namespace, backend: str) -> str | None:
    """torchtitan's own check: FlexAttention under a backend other than inductor/aot_eager."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    with torch.device("meta"):
        model = model_config(args, attention="flex").build()
    try:
        apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=OneProcess())
    except ValueError as exc:
        return str(exc)
    return None


def torchao_converter() -> tuple[Any, str | None]:
    """torchtitan's MXFP8 converter (torchao MXFP8Linear): the converter, or its refusal."""
    from torchtitan.components.quantization import MXFP8LinearConverter

    try:
        return MXFP8LinearConverter(MXFP8LinearConverter.Config(model_compile_enabled=True)), None
    except (ValueError, ImportError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- training

def global_batches(args: argparse.Namespace, world: int) -> torch.Tensor:
    """(steps, world * batch, seq + 1) token ids, the same on every rank: arithmetic sequences
    modulo the vocabulary (random start and stride 1..4), so that the loss can fall."""
    g = torch.Generator().manual_seed(DATA_SEED)
    rows = args.steps * world * args.batch
    start = torch.randint(0, args.vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 5, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return tokens.view(args.steps, world * args.batch, args.seq + 1)


def loss_function(vocab: int):
    """torchtitan's CrossEntropyLoss, as its trainer uses it: the sum over this rank's tokens
    divided by the global token count. FSDP2 sums the ranks' gradients (apply_fsdp_to_decoder
    sets its gradient divide factor to 1), so the gradients are those of the global mean."""
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=vocab))


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (FSDP2's DTensor shards gathered: a
    collective, so every rank calls this for a sharded model)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().cpu().clone()
            for name, p in model.named_parameters()}


def grad_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The worst per-parameter relative norm error |g - ref| / |ref| and its parameter."""
    errors = {name: ((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
              for name, ref in reference.items()}
    worst = max(errors, key=errors.get)
    return {"worst": errors[worst], "worst_param": worst, "per_param": errors}


def train(model: torch.nn.Module, batches: list[torch.Tensor], lr: float, vocab: int, global_tokens: int,
          *, sum_over_ranks: bool) -> dict:
    """AdamW steps; per step the loss (summed over the ranks for data parallelism: the global
    batch's mean loss, as torchtitan logs it) and wall time; the first step's full gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = loss_function(vocab)
    valid = torch.tensor(global_tokens, dtype=torch.float32, device=batches[0].device)
    losses, times, first_grads = [], [], None
    for step, tokens in enumerate(batches):
        start = time.perf_counter()
        loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], valid)
        loss.backward()
        if step == 0:
            first_grads = full_grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if sum_over_ranks:
            dist.all_reduce(value)
        losses.append(value.item())
        times.append(time.perf_counter() - start)
    return {"losses": losses, "step_s": times, "grads": first_grads}


def _totals(reports: list) -> dict[str, Any]:
    totals = [r.totals() for r in reports]
    return {"graphs": len(reports), **{key: sum(t[key] for t in totals)
                                       for key in ("gemms", "converted", "gemm_flops", "gemm_flops_converted")}}


def reports_of(module: torch.nn.Module) -> list:
    """mxcompile.report_of(module). Between steps FSDP2 registers the sharded (DTensor)
    parameters, while the compiled graphs ran with the unsharded ones, which report_of looks
    for: unshard to ask (asked while sharded, it finds a graph only through a buffer that the
    graph took, here the first block's RoPE cache)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return mxcompile.report_of(module)
    module.unshard()
    try:
        return mxcompile.report_of(module)
    finally:
        module.reshard()


def conversion(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """What the backend converted, per transformer block (each finds the one shared block
    graph) and for the output projection."""
    blocks = {}
    for name, block in model.layers.named_children():
        reports = reports_of(block)
        blocks[name] = {**_totals(reports), "report_ids": [id(r) for r in reports],
                        "graphs_found_while_sharded": len(mxcompile.report_of(block)), "decisions": [
            {"graph": d.graph, "kind": d.kind, "module": d.module, "decision": d.decision, "reason": d.reason}
            for r in reports for d in r.decisions]}
    head = _totals(reports_of(model.lm_head))
    # The output projection's GEMMs (forward, dX, dW: 3 x 2 x tokens x dim x vocab per rank and
    # step), in MX or not, for the fraction of the whole model's GEMM FLOPs.
    head["analytic_gemm_flops"] = 3 * 2 * args.batch * args.seq * args.dim * args.vocab
    # Every block ran the shared block graph once per step: its report counts one block's GEMMs.
    converted = sum(b["gemm_flops_converted"] for b in blocks.values()) + head["gemm_flops_converted"]
    total = sum(b["gemm_flops"] for b in blocks.values()) + head["analytic_gemm_flops"]
    return {"blocks": blocks, "lm_head": head, "model_converted_flop_fraction": converted / total}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.world = world
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        use_cpu_device_type()
        device = torch.device("cpu")
    results: dict[str, Any] = {"world_size": world, "args": vars(args), "device": str(device),
                               "torch": torch.__version__}
    import torchtitan
    results["torchtitan"] = getattr(torchtitan, "__version__", None)

    results["flex_attention"] = flex_attention_refusal(args, args.backend)
    converter, results["torchao_converter"] = (None, "skipped (--no-torchao)") if args.no_torchao \
        else torchao_converter()

    batches = [b.to(device) for b in global_batches(args, world)]
    local = [b[rank * args.batch:(rank + 1) * args.batch] for b in batches]
    global_tokens = world * args.batch * args.seq

    backend = compile_backend(args)
    dump = os.environ.get("TMPDIR", "/tmp")
    if rank == 0:
        # Single-process references, same initial weights, the global batches: eager fp32, and
        # the same backend through torchtitan's own apply_compile (per-block compile, no FSDP).
        from torchtitan.config import CompileConfig
        from torchtitan.distributed.compile import apply_compile

        reference = build_model(model_config(args), device)
        results["eager"] = train(reference, batches, args.lr, args.vocab, global_tokens, sum_over_ranks=False)
        reference = build_model(model_config(args), device)
        apply_compile(reference, compile_config=CompileConfig(enable=True, components=["model"], backend=backend),
                      parallel_dims=OneProcess())
        if args.compile_lm_head:
            compile_lm_head(reference, backend)
        results["mxfp8_one_process"] = train(reference, batches, args.lr, args.vocab, global_tokens,
                                             sum_over_ranks=False)
        del reference

    start = time.perf_counter()
    model = build_model(model_config(args), device)
    model = parallelize(model, args, world, backend, dump)  # torchtitan's parallelize_llama
    if args.compile_lm_head:
        compile_lm_head(model, backend)
    results["fsdp_units"] = force_sum_reduction(model) if not on_cuda else None
    results["mxfp8"] = train(model, local, args.lr, args.vocab, global_tokens, sum_over_ranks=True)
    results["mxfp8"]["wall_s"] = time.perf_counter() - start
    results["reports"] = conversion(model, args)

    if converter is not None:  # torchtitan's torchao MXFP8 training (sm100+), same steps and data
        # Not run here: the converter refuses CPUs and GPUs below sm100.
        ao_model = build_model(converter.convert(model_config(args)), device)
        ao_model = parallelize(ao_model, args, world, "inductor", dump)
        results["torchao"] = train(ao_model, local, args.lr, args.vocab, global_tokens, sum_over_ranks=True)

    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    results["first_step_grads"] = {
        "fsdp_vs_one_process": grad_error(results["mxfp8"]["grads"], results["mxfp8_one_process"]["grads"]),
        "one_process_vs_eager": grad_error(results["mxfp8_one_process"]["grads"], results["eager"]["grads"]),
    }
    for run in ("eager", "mxfp8_one_process", "mxfp8", "torchao"):
        results.get(run, {}).pop("grads", None)
    for comparison in results["first_step_grads"].values():
        comparison.pop("per_param")
    print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def print_summary(results: dict[str, Any]) -> None:
    args = results["args"]
    print(f"torchtitan {results['torchtitan']}, torch {results['torch']}, {results['world_size']} ranks on "
          f"{results['device']}; llama3 dim {args['dim']}, {args['layers']} layers, head_dim "
          f"{args['dim'] // args['heads']}, vocab {args['vocab']}; {args['batch']} x {args['seq']} tokens per rank; "
          f"compile.backend={args['backend']!r}, param dtype {args['param_dtype']}")
    print(f"FlexAttention under backend={args['backend']!r}: "
          + (f"refused by torchtitan: {results['flex_attention']}" if results["flex_attention"] else "accepted"))
    print("torchtitan MXFP8 converter (torchao): "
          + (f"refused: {results['torchao_converter']}" if results["torchao_converter"] else "runs"))
    eager, one, mx = results["eager"]["losses"], results["mxfp8_one_process"]["losses"], results["mxfp8"]["losses"]
    ao = results.get("torchao", {}).get("losses")
    name = args["backend"]
    print("losses (2 ranks: the sum of the ranks' losses, each its tokens' sum over the global token count); "
          f"lowering: {args['lowering']}")
    fsdp_column = f"{name}, FSDP2 x{results['world_size']}"
    print(f"{'step':>4}  {'eager fp32':>10}  {name + ', 1 process':>18}  {fsdp_column:>16}"
          f"  {'vs eager':>9}  {'vs 1 process':>12}" + (f"  {'torchao MXFP8Linear':>20}" if ao else ""))
    for step, (e, o, m) in enumerate(zip(eager, one, mx), start=1):
        print(f"{step:>4}  {e:>10.6f}  {o:>18.6f}  {m:>16.6f}  {(m - e) / e:>+9.4%}  {(m - o) / o:>+12.2e}"
              + (f"  {ao[step - 1]:>20.6f}" if ao else ""))
    grads = results["first_step_grads"]
    print(f"first step's gradients, worst relative norm error of a parameter: 2 ranks vs 1 process "
          f"{grads['fsdp_vs_one_process']['worst']:.2e} ({grads['fsdp_vs_one_process']['worst_param']}); "
          f"1 process {name} vs eager fp32 {grads['one_process_vs_eager']['worst']:.2e} "
          f"({grads['one_process_vs_eager']['worst_param']})")
    print(f"step times (s), rank 0: {', '.join(f'{t:.2f}' for t in results['mxfp8']['step_s'])} "
          f"(the first includes compilation)")
    reports = results["reports"]
    for name, block in reports["blocks"].items():
        fraction = block["gemm_flops_converted"] / block["gemm_flops"] if block["gemm_flops"] else 0.0
        print(f"block {name}: report_of finds {block['graphs']} graph(s); {block['converted']}/{block['gemms']} "
              f"GEMMs in MX, {fraction:.1%} of {block['gemm_flops']} GEMM FLOPs")
    kept = {(d["kind"], d["module"], d["reason"]) for b in reports["blocks"].values()
            for d in b["decisions"] if d["decision"] != "mxfp8"}
    for kind, module, reason in sorted(kept):
        print(f"  kept: {kind} {module}: {reason}")
    head = reports["lm_head"]
    print(f"output projection (lm_head): " + (
        f"compiled, {head['converted']}/{head['gemms']} GEMMs in MX" if head["graphs"] else
        "not compiled, runs eagerly in high precision (--compile-lm-head compiles it)"))
    print(f"GEMM FLOPs of the whole model in MX (blocks + output projection, per rank and step): "
          f"{reports['model_converted_flop_fraction']:.1%}")

if __name__ == "__main__":
    main()
