"""Synthetic transformer-like planning problems, for tests and benchmarks.

One block = one pre-norm transformer layer: ten forward steps (ln1, qkv, attn, o_proj, add1,
ln2, fc1, act, fc2+dropout, add2) then their ten backward steps in reverse, with the ten
tensors such a layer saves. Step times are roofline estimates (matmuls at ``matmul_flops``,
elementwise ops at ``memory_bandwidth``); backward matmuls cost twice the forward.
"""

from __future__ import annotations

from dataclasses import replace

from .memory import build_tables, evaluate_codes
from .problem import BACKWARD, FORWARD, Problem, SavedTensor, Step
from .repeat import repeat_block

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, dense
H100_HBM_BYTES_PER_S = 3.35e12
PCIE5_X16_BYTES_PER_S = 64e9  # one direction
BACKWARD_MATMUL_FACTOR = 2.0  # dX and dW GEMMs
BACKWARD_ATTENTION_FACTOR = 2.5  # flash-attention backward vs forward
ELEMENTWISE_PASSES = 3.0  # reads + writes of an elementwise op, in activation sizes
PARAM_AND_GRAD_BYTES = 4  # bf16 parameter + bf16 gradient per parameter (optimizer state sharded away)
LSE_BYTES = 4  # fp32 logsumexp per token and head
_FORWARD_OPS = ("ln1", "qkv", "attn", "o_proj", "add1", "ln2", "fc1", "act", "fc2_dropout", "add2")


def transformer_block(
    *,
    tokens: int = 8192,
    hidden: int = 4096,
    heads: int = 32,
    ffn_mult: int = 4,
    elem_bytes: int = 2,
    matmul_flops: float = H100_BF16_DENSE_FLOPS,
    memory_bandwidth: float = H100_HBM_BYTES_PER_S,
    host_link_bandwidth: float | None = PCIE5_X16_BYTES_PER_S,
    budget_bytes: int = 2**62,
) -> Problem:
    """One transformer layer as a planning problem (see the module docstring)."""
    act = tokens * hidden * elem_bytes
    ffn = act * ffn_mult

    def mm(n_in: int, n_out: int) -> float:
        return 2.0 * tokens * n_in * n_out / matmul_flops

    def ew(nbytes: int) -> float:
        return ELEMENTWISE_PASSES * nbytes / memory_bandwidth

    attn = 2.0 * tokens * tokens * hidden / matmul_flops  # causal: half of 4 T^2 d
    fwd_times = (
        ew(act), mm(hidden, 3 * hidden), attn, mm(hidden, hidden), ew(act),
        ew(act), mm(hidden, ffn_mult * hidden), ew(ffn), mm(ffn_mult * hidden, hidden), ew(act),
    )
    bwd_factor = {"qkv": BACKWARD_MATMUL_FACTOR, "o_proj": BACKWARD_MATMUL_FACTOR, "fc1": BACKWARD_MATMUL_FACTOR,
                  "fc2_dropout": BACKWARD_MATMUL_FACTOR, "attn": BACKWARD_ATTENTION_FACTOR}
    steps = [Step(op, FORWARD, t) for op, t in zip(_FORWARD_OPS, fwd_times)]
    for op, t in reversed(list(zip(_FORWARD_OPS, fwd_times))):
        steps.append(Step(op + "_bwd", BACKWARD, t * bwd_factor.get(op, 1.0)))
    n_fwd = len(_FORWARD_OPS)

    def bwd(op: str) -> int:
        return n_fwd + (n_fwd - 1 - _FORWARD_OPS.index(op))

    def fw(op: str) -> int:
        return _FORWARD_OPS.index(op)

    tensors = (
        SavedTensor("x_in", act, fw("ln1"), fw("add1"), bwd("ln1"), recomputable=False),
        SavedTensor("ln1_out", act, fw("ln1"), fw("qkv"), bwd("qkv"), recompute_cost_s=fwd_times[fw("ln1")],
                    recompute_inputs=("x_in",)),
        SavedTensor("qkv", 3 * act, fw("qkv"), fw("attn"), bwd("attn"), recompute_cost_s=fwd_times[fw("qkv")],
                    recompute_inputs=("ln1_out", "w_qkv")),
        SavedTensor("attn_out", act, fw("attn"), fw("o_proj"), bwd("o_proj"), recompute_cost_s=attn,
                    recompute_inputs=("qkv",)),
        SavedTensor("lse", tokens * heads * LSE_BYTES, fw("attn"), fw("attn"), bwd("attn"), recompute_cost_s=attn,
                    recompute_inputs=("qkv",)),
        SavedTensor("h1", act, fw("add1"), fw("add2"), bwd("ln2"),
                    recompute_cost_s=fwd_times[fw("o_proj")] + fwd_times[fw("add1")],
                    recompute_inputs=("x_in", "attn_out", "w_o")),
        SavedTensor("ln2_out", act, fw("ln2"), fw("fc1"), bwd("fc1"), recompute_cost_s=fwd_times[fw("ln2")],
                    recompute_inputs=("h1",)),
        SavedTensor("fc1_out", ffn, fw("fc1"), fw("act"), bwd("act"), recompute_cost_s=fwd_times[fw("fc1")],
                    recompute_inputs=("ln2_out", "w_fc1")),
        SavedTensor("act_out", ffn, fw("act"), fw("fc2_dropout"), bwd("fc2_dropout"),
                    recompute_cost_s=fwd_times[fw("act")], recompute_inputs=("fc1_out",)),
        SavedTensor("dropout_mask", tokens * hidden, fw("fc2_dropout"), fw("fc2_dropout"), bwd("add2"),
                    recomputable=False),
    )
    baseline = tuple(act for _ in steps)  # one activation-sized workspace per step
    return Problem(
        steps=tuple(steps),
        tensors=tensors,
        baseline_bytes=baseline,
        budget_bytes=budget_bytes,
        resident_inputs=("w_qkv", "w_o", "w_fc1"),
        host_link_bandwidth=host_link_bandwidth,
    )


def transformer_problem(
    n_layers: int, *, budget_fraction: float = 0.5, **block_options
) -> tuple[Problem, list[list[str]]]:
    """``n_layers`` blocks; the budget is ``persistent + budget_fraction * (keep-everything
    peak - persistent)``. Returns the problem and its tie groups (one per block tensor)."""
    block = transformer_block(**block_options)
    hidden = block_options.get("hidden", 4096)
    persistent = n_layers * 12 * hidden * hidden * PARAM_AND_GRAD_BYTES
    problem, groups = repeat_block(block, n_layers, persistent_bytes=persistent)
    tables = build_tables(problem)
    keep_peak = evaluate_codes(tables, [0] * len(problem.tensors)).peak_bytes
    budget = int(persistent + budget_fraction * (keep_peak - persistent))
    return replace(problem, budget_bytes=budget), groups


RANDOM_STEP_TIMES_MS = (0.0, 0.5, 1.0, 2.0, 3.0)
RANDOM_RECOMPUTE_MS = (0.0, 0.25, 1.0, 2.0, 5.0)
RANDOM_BANDWIDTHS = (None, 8e3, 32e3, 1e6)  # bytes/s against tensors of at most 64 bytes
RANDOM_MAX_BYTES = 64
RANDOM_MAX_BASELINE = 32
_MS = 1e-3


def random_problem(rng, n_tensors: int, *, max_forward: int = 8, max_backward: int = 8) -> Problem:
    """A small random problem (chains, non-recomputable and non-offloadable tensors, tight
    offload windows) drawn from ``rng`` (a ``random.Random``); ``budget_bytes`` is left huge
    for the caller to set."""
    n_fwd = rng.randint(1, max_forward)
    n_bwd = rng.randint(1, max_backward)
    n_steps = n_fwd + n_bwd
    steps = tuple(
        Step(f"s{t}", FORWARD if t < n_fwd else BACKWARD, rng.choice(RANDOM_STEP_TIMES_MS) * _MS)
        for t in range(n_steps)
    )
    tensors: list[SavedTensor] = []
    for i in range(n_tensors):
        p = rng.randint(0, n_fwd - 1)
        lf = rng.randint(p, n_fwd - 1)
        fb = rng.randint(n_fwd, n_steps - 1)
        lb = rng.randint(fb, n_steps - 1)
        earlier = [t.name for t in tensors if t.produced_at <= p]
        inputs = rng.sample(earlier, min(len(earlier), rng.randint(0, 2)))
        if rng.random() < 0.5:
            inputs.append("w")
        tensors.append(
            SavedTensor(
                name=f"t{i}",
                nbytes=rng.randint(0, RANDOM_MAX_BYTES),
                produced_at=p,
                last_forward_use=lf,
                first_backward_use=fb,
                last_backward_use=lb,
                recompute_cost_s=rng.choice(RANDOM_RECOMPUTE_MS) * _MS,
                recompute_inputs=tuple(inputs),
                recomputable=rng.random() < 0.75,
                offloadable=rng.random() < 0.75,
                recompute_work_bytes=rng.randint(0, RANDOM_MAX_BYTES // 2) if rng.random() < 0.5 else 0,
            )
        )
    return Problem(
        steps=steps,
        tensors=tuple(tensors),
        baseline_bytes=tuple(rng.randint(0, RANDOM_MAX_BASELINE) for _ in range(n_steps)),
        budget_bytes=2**62,
        resident_inputs=("w",),
        host_link_bandwidth=rng.choice(RANDOM_BANDWIDTHS),
    )
