"""Training-step time in one run (CPU, or a GPU with --device cuda): torch.compile's default
backend in bf16 autocast and in fp32, the mxfp8 backend (MX attention on, and off; on a GPU
also with the Triton MX GEMM kernel forced, `gemm_kernel="triton"`), and torchao's emulated
MXFP8 training recipe.

    python benchmarks/train_step.py                  # built-in GPT: width 512, 6 layers, seq 256, batch 8
    python benchmarks/train_step.py --model llama    # HF Llama: hidden 512, 4 layers, seq 256, batch 4
    python benchmarks/train_step.py --quick          # tiny shapes, a smoke test
    python benchmarks/train_step.py --device cuda --d-model 2048 --seq 1024   # on a GPU
    python benchmarks/train_step.py --profile 15     # then each variant's top operators in one step
    python benchmarks/train_step.py --profile 30 --kernel-names   # ... naming Inductor's C++ kernels

Every variant is compiled and warmed up first; then --rounds rounds each time --steps steps of
every variant in turn, so that load on the machine hits all variants alike. Prints the median
step time over all rounds, its ratios to the bf16 and the fp32 step, and compile + warm-up
time. Targets: mxfp8 <= 1.3x bf16 with MX attention, <= 1.15x without.

On a CPU without native bf16 GEMMs (no AVX512-BF16 or AMX) ATen emulates bf16 matrix
products, tens of times slower than fp32, so the bf16 baseline is slow there; mxfp8 multiplies
its exact dequantized operands in fp32 on such CPUs (`mxcompile.ops.mx_mm.gemm_operand_dtype`).
The fp32 column is then the fair high-precision baseline, and the script says so.

torchao's column follows its documented MXFP8 training recipe
(`MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)`, applied with
`quantize_` to the nn.Linear layers, then `torch.compile`), the emulated kernels being the only
ones that run on CPU. Its training-op wrappers reject the mixed dtypes of bf16 autocast (fp32
weights, bf16 activations: "expected m1 and m2 to have the same dtype"), so, as in torchao's
examples, its model is cast to bf16 and runs without autocast. If it fails, the table prints the
one-line reason instead of a time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch

from mxcompile.examples.gpt import GPT, GPTConfig, lm_loss
from mxcompile.ops.mx_mm import cpu_has_native_bf16_gemm

TARGETS = {"mxfp8": 1.3, "mxfp8, attention off": 1.15}
BF16_VARIANT, FP32_VARIANT = "bf16 (inductor)", "fp32 (inductor)"
# (name, backend, options, bf16 autocast)
VARIANTS = (
    (BF16_VARIANT, "inductor", None, True),
    (FP32_VARIANT, "inductor", None, False),
    ("mxfp8", "mxfp8", None, True),
    ("mxfp8, attention off", "mxfp8", {"attention": "off"}, True),
)
# On a GPU without MX tensor cores the mxfp8 variants run dequantized GEMMs (gemm_kernel "auto");
# this one runs the Triton MX GEMM kernel instead, side by side.
TRITON_GEMM_VARIANT = ("mxfp8, Triton MX GEMM", "mxfp8", {"gemm_kernel": "triton"}, True)
# torchao's training-op wrappers, and the errors a prototype path raises on CPU.
TORCHAO_ERRORS = (RuntimeError, AssertionError, NotImplementedError, TypeError, ValueError)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model to train and how one step computes its loss from the compiled model."""

    name: str
    model: torch.nn.Module
    batch: torch.Tensor
    loss: Callable[[Callable, torch.Tensor], torch.Tensor]


def gpt_workload(args: argparse.Namespace) -> Workload:
    config = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    return Workload(f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch}",
                    model, idx, lambda compiled, ids: lm_loss(compiled(ids), ids))


def llama_workload(args: argparse.Namespace) -> Workload:
    """HF transformers' LlamaForCausalLM from a small config (random weights, nothing downloaded)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    return Workload(f"HF Llama hidden={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch}",
                    model, ids, lambda compiled, batch: compiled(input_ids=batch, labels=batch).loss)


def make_step(work: Workload, model: torch.nn.Module, compiled: Callable, autocast: bool) -> Callable[[], float]:
    """One optimizer step; `loss.item()` waits for the device, so a host clock times it whole."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device_type = work.batch.device.type

    def step() -> float:
        with torch.autocast(device_type, torch.bfloat16, enabled=autocast):
            loss = work.loss(compiled, work.batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def torchao_step(work: Workload) -> tuple[Callable[[], float] | None, str]:
    """torchao's emulated MXFP8 training recipe (see the module docstring), or why it can't run."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
    except ImportError as err:
        return None, f"torchao not importable: {err}"
    model = copy.deepcopy(work.model).to(torch.bfloat16)
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    try:
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    except TORCHAO_ERRORS as err:
        return None, _first_line(err)
    return make_step(work, model, torch.compile(model), autocast=False), ""


def _first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text.splitlines()[0][:160]


# In the name of every C++ kernel Inductor generates on the CPU (one profiler event per kernel
# call with torch._inductor.config.cpp.enable_kernel_profile; some carry a "graph_N_" prefix).
CPP_KERNEL_MARK = "cpp_fused"


def print_profile(name: str, step: Callable[[], float], device: torch.device, rows: int) -> None:
    """One step under torch.profiler: the `rows` operators with the most self time on `device`
    (the GPU's kernel time on CUDA, the host's on the CPU), and on the CPU the self time of all
    of Inductor's generated kernels together (named ones only with --kernel-names)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    print(f"\n{name}: one step, operators by {sort_by}")
    print(events.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60))
    kernels = [e for e in events if CPP_KERNEL_MARK in e.key]
    if kernels:
        total_ms = sum(e.self_cpu_time_total for e in kernels) / 1e3
        print(f"{name}: Inductor's generated C++ kernels, {len(kernels)} distinct, {total_ms:.1f} ms self time in all")


def _time(step: Callable[[], float], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, help="default: 6 (gpt), 4 (llama)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, help="default: 8 (gpt), 4 (llama)")
    parser.add_argument("--vocab", type=int, default=1024, help="llama's vocabulary size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 (no autocast) baseline")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round of 2 steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-triton-gemm", action="store_true",
                        help=f"with --device cuda, skip the {TRITON_GEMM_VARIANT[0]!r} variant")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile one step per variant and print its N costliest operators")
    parser.add_argument("--kernel-names", action="store_true",
                        help="with --profile on the CPU: Inductor's C++ kernels appear in the profile under their "
                             "names (torch._inductor.config.cpp.enable_kernel_profile), with their total; "
                             "compiles without the compile caches")
    args = parser.parse_args(argv)
    if args.kernel_names and not args.profile:
        parser.error("--kernel-names names kernels in the profile: give --profile N too")
    if args.kernel_names:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        # Read when Inductor generates code, so it must be set before the first compile; the
        # kernels then record a profiler event per call (timed steps include that cost). The
        # setting is not part of the compile caches' keys: code cached without it would load
        # unnamed, so both caches are off (every variant compiles cold).
        inductor_config.cpp.enable_kernel_profile = True
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
                     "run on a GPU machine with a CUDA build of torch, or use --device cpu")
    llama = args.model == "llama"
    args.layers = args.layers or (4 if llama else 6)
    args.batch = args.batch or (4 if llama else 8)
    if args.quick:
        args.d_model, args.layers, args.heads, args.seq, args.batch, args.vocab = 64, 2, 2, 64, 2, 256
        args.warmup, args.steps, args.rounds = 2, 2, 1
    device = torch.device(args.device)
    work = llama_workload(args) if llama else gpt_workload(args)
    work = dataclasses.replace(work, model=work.model.to(device), batch=work.batch.to(device))
    if device.type == "cuda":
        print(f"{work.name}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
        native_bf16 = True
    else:
        print(f"{work.name}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
        native_bf16 = cpu_has_native_bf16_gemm()
        print(f"bf16 GEMMs native on this CPU (AVX512-BF16 or AMX): {native_bf16}")
    steps: dict[str, Callable[[], float] | None] = {}
    notes: dict[str, str] = {}
    variants = VARIANTS + ((TRITON_GEMM_VARIANT,) if device.type == "cuda" and not args.no_triton_gemm else ())
    for name, backend, options, autocast in variants:
        if args.no_fp32 and name == FP32_VARIANT:
            continue
        model = copy.deepcopy(work.model)
        steps[name] = make_step(work, model, torch.compile(model, backend=backend, options=options), autocast)
    if not args.no_torchao:
        steps["torchao MX (emulated)"], notes["torchao MX (emulated)"] = torchao_step(work)

    warmup: dict[str, float] = {}
    for name, step in steps.items():
        if step is None:
            continue
        started = time.perf_counter()
        try:
            for _ in range(args.warmup):
                step()
        except TORCHAO_ERRORS as err:
            if not name.startswith("torchao"):
                raise
            steps[name], notes[name] = None, _first_line(err)
            continue
        warmup[name] = time.perf_counter() - started

    times: dict[str, list[float]] = {name: [] for name, step in steps.items() if step is not None}
    for _ in range(args.rounds):
        for name in times:
            times[name] += _time(steps[name], args.steps)

    reference = statistics.median(times[BF16_VARIANT])
    fp32 = statistics.median(times[FP32_VARIANT]) if FP32_VARIANT in times else None
    print(f"median of {args.rounds} rounds x {args.steps} steps; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"\n{'variant':24} {'step ms':>9} {'/bf16':>7} {'/fp32':>7} {'compile+warmup s':>17}")
    for name in steps:
        if name not in times:
            print(f"{name:24} {'-':>9} {'-':>7} {'-':>7} {'-':>17}  {notes.get(name, '')}")
            continue
        median = statistics.median(times[name])
        ratio = median / reference
        to_fp32 = f"{median / fp32:6.2f}x" if fp32 else f"{'-':>7}"
        verdict = f"target <= {TARGETS[name]}x: {'met' if ratio <= TARGETS[name] else 'MISSED'}" if name in TARGETS else ""
        print(f"{name:24} {median * 1e3:9.1f} {ratio:6.2f}x {to_fp32} {warmup[name]:17.1f}  {verdict}")
    for name in times if args.profile else ():
        print_profile(name, steps[name], device, args.profile)
    if not native_bf16:
        print("\nThis CPU has no native bf16 GEMM: the bf16 baseline's GEMMs are emulated (tens of times slower "
              "than fp32), while mxfp8 multiplies its exact dequantized operands in fp32 here "
              "(mxcompile.ops.mx_mm.gemm_operand_dtype). Compare with the /fp32 column too.")


if __name__ == "__main__":
    main()
