"""Activation checkpointing under the mxfp8 pipeline (issue 46, part 4): the checkpointed GEMMs
run in MX and the gradients are the eager MX oracle's (tests/mx_oracle.py), for

- `torch.utils.checkpoint.checkpoint` written by a user around each block of a small model
  (RMSNorm, fused qkv, eager-softmax causal attention, LayerNorm, GELU MLP, residuals), with
  `use_reentrant=True` and `False`, the whole model compiled: every GEMM of the step in MX
  (the report's decisions), every parameter's gradient bit-identical to the oracle's;
- torchtitan 0.3's three policies (`FullAC`, `SelectiveAC` per op, `MemoryBudgetAC`), each
  applied by torchtitan's own `apply()` to a tiny llama3 (SDPA attention, as
  examples/torchtitan_llama.py builds it), then torchtitan's per-block compile
  (`apply_compile`: `block.compile(backend=..., fullgraph=True)`), in one process (neither
  policy nor compile needs a process group).

Why these checks: HF's checkpointing silently runs its layers eagerly in fp32 (issue 46); the
two forms above are the ones that compile whole, and this file keeps them so.

Bounds. The backend is `compile_and_record` (reports recorded, as `backend="mxfp8"` does) with
the decomposed eager lowering: the graph runs op by op through the same decompositions the
oracle uses, so both sides compute the same fp32 operations and the same MX GEMMs, and
recomputation is deterministic: the gradients must be bit-identical (`EXACT`). Two forms of
attention are not the oracle's numerics and are compared otherwise:
- torchtitan's SDPA with `attention="off"` (kept in high precision on both sides): EXACT
  against the oracle, the 15 Linear GEMMs of a block in MX, the 6 attention GEMMs kept only by
  that option;
- torchtitan's SDPA with the default `attention="both"` (the MX attention op: every one of the
  21 block GEMMs in MX) rounds unnormalized probabilities per key tile, which the eager oracle
  does not (gradient_blocks.MX_SDPA_BOUND): each policy's gradients are compared EXACT with
  the same model compiled without checkpointing, which is itself checked against the oracle's
  eager MX attention within MX_SDPA_BOUND (measured 4.4%).
torchtitan leaves the output projection, the final norm and the loss eager in fp32: the
oracle runs them outside its modes (`_OutsideOracle`), so only the blocks are emulated, and
the block parameters' gradients are compared.

The comparison can fail: the user model with every GEMM left in high precision reads 3.4-7.3%
from the oracle at the GEMM weights (`test_high_precision_block_is_caught`, once for the file).

Found here, and fixed: the MX rewrite dropped the recomputation tags that checkpointing puts on
the forward GEMMs, so the MX step saved the checkpointed blocks' GEMM outputs instead of
recomputing them: 316548 B saved against 50180 B for torch's own checkpointed partition; with
the tags copied onto every node a pass adds (passes/graph_facts.py), 38020 B
(`test_checkpointed_gemms_are_recomputed_not_saved`).

torchtitan changes process-wide state; this file restores it after each test: dynamo's
`capture_scalar_outputs` and `skip_fwd_side_effects_in_bwd_under_checkpoint` (set by
`apply_compile`), dynamo's LRU cache of compiled code (turned off by every policy's `apply`),
`torch._functorch.config.activation_memory_budget` (set by `MemoryBudgetAC`) and, after the
module, `FakeTensorMode.__init__` (wrapped at import by torchtitan.distributed.compile).

The first memory-budget compile on a machine measures the CPU's device profile for mxcompile's
planner (about 50 s here, then cached in ~/.cache/mxcompile); later compiles take about 3 s.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

import mxcompile
from gradient_blocks import (
    EXACT,
    INDUCTOR_BOUND,
    MX_SDPA_BOUND,
    RMSNorm,
    compiled_distances,
    decomposed_eager_lowering,
)
from mx_oracle import MXOracle, SdpaForm, relative_distance
from mxcompile.backend import compile_and_record, compile_graph
from mxcompile.config import MXConfig
from mxcompile.report import Report

MX, KEPT = "mxfp8", "kept"

# ---------------------------------------------------------------- the user-written model
USER_DIM, USER_HEADS, USER_FFN, USER_VOCAB, USER_BLOCKS = 64, 2, 128, 128, 2
USER_SEQ, USER_BATCH = 32, 2  # 64 tokens: whole MX blocks along every contraction axis
# Per block: qkv, out, mlp.0, mlp.2 (forward, dX, dW each) and attention's 6 GEMMs (S = Q Kᵀ,
# O = P V and the four of their backward); the output projection's 3.
USER_GEMMS = USER_BLOCKS * (4 * 3 + 6) + 3
# The parameters whose gradients a GEMM gives (dW): the high-precision check reads these.
USER_GEMM_WEIGHTS = ("blocks.0.qkv.weight", "blocks.0.out.weight", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight",
                     "head.weight")

# ---------------------------------------------------------------- the torchtitan llama3
TT_DIM, TT_LAYERS, TT_HEADS, TT_FFN, TT_VOCAB, TT_SEQ, TT_BATCH = 64, 2, 2, 128, 256, 32, 2
# 5 Linears per block (wqkv, wo, w1, w2, w3) x 3 GEMMs of training, and attention's 6.
TT_LINEAR_GEMMS = 5 * 3
TT_ATTENTION_GEMMS = 6
TT_MEMORY_BUDGET = 0.5  # MemoryBudgetAC's default
ATTENTION_OFF_REASON = "attention='off'"
WRAPPED = "._checkpoint_wrapped_module"  # torch.distributed's checkpoint_wrapper's submodule name
DATA_SEED, MODEL_SEED = 1, 0


def _backend(**options) -> Callable:
    """The mxfp8 pipeline, its reports recorded (as backend="mxfp8"), the graph run op by op."""
    return functools.partial(compile_and_record, config=MXConfig(**options), lower=decomposed_eager_lowering())


def _decisions(reports: list[Report]) -> Counter:
    return Counter((d.kind, d.decision) for r in reports for d in r.decisions)


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(DATA_SEED))
    return tokens[:, :-1], tokens[:, 1:]


# ================================================================ user-written checkpoint


class _UserBlock(nn.Module):
    """Pre-norm transformer block as a user writes it: fused qkv split by view + unbind, eager
    causal softmax attention (its GEMMs are bmm's on both sides, so in MX on both), GELU MLP."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(USER_DIM), nn.LayerNorm(USER_DIM)
        self.qkv, self.out = nn.Linear(USER_DIM, 3 * USER_DIM, bias=False), nn.Linear(USER_DIM, USER_DIM)
        self.mlp = nn.Sequential(nn.Linear(USER_DIM, USER_FFN), nn.GELU(), nn.Linear(USER_FFN, USER_DIM))
        self.register_buffer("causal", torch.ones(USER_SEQ, USER_SEQ, dtype=torch.bool).tril())

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head_dim = USER_DIM // USER_HEADS
        q, k, v = self.qkv(x).view(batch, seq, 3, USER_HEADS, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        attended = scores.masked_fill(~self.causal, float("-inf")).softmax(-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, seq, USER_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class _UserModel(nn.Module):
    """Embedding, blocks each under torch.utils.checkpoint.checkpoint, norm, output projection."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Embedding(USER_VOCAB, USER_DIM)
        self.blocks = nn.ModuleList(_UserBlock() for _ in range(USER_BLOCKS))
        self.norm, self.head = nn.LayerNorm(USER_DIM), nn.Linear(USER_DIM, USER_VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(self.norm(h))


def _user_model_and_loss(use_reentrant: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(MODEL_SEED)
    model = _UserModel(use_reentrant).train()
    inputs, targets = _tokens(USER_VOCAB, USER_BATCH, USER_SEQ)
    return model, lambda module: F.cross_entropy(module(inputs).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_user_checkpointed_blocks_train_in_mx_with_the_oracles_gradients(use_reentrant):
    model, loss_of = _user_model_and_loss(use_reentrant)
    distances = compiled_distances(model, loss_of, _backend())
    reports = mxcompile.report_of(model)
    assert len(reports) == 1, f"{len(reports)} graphs: the checkpointed model did not compile whole"
    decisions = _decisions(reports)
    assert sum(decisions.values()) == USER_GEMMS and all(d == MX for _, d in decisions), decisions
    assert decisions[("attention", MX)] == USER_BLOCKS * 6, decisions
    assert len(distances) == len(list(model.parameters())), sorted(distances)
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"worst parameters {worst}"


def test_high_precision_block_is_caught():
    """The comparison can fail: the same checkpointed model with every GEMM left in high
    precision (exclude every module) is caught, by this file's EXACT and by far looser bounds."""
    model, loss_of = _user_model_and_loss(use_reentrant=False)
    distances = compiled_distances(model, loss_of, _backend(exclude=(".*",)))
    decisions = _decisions(mxcompile.report_of(model))
    assert sum(decisions.values()) == USER_GEMMS and all(d == KEPT for _, d in decisions), decisions
    caught = {name: distances[name] for name in USER_GEMM_WEIGHTS}
    assert min(caught.values()) > INDUCTOR_BOUND, caught


def test_checkpointed_gemms_are_recomputed_not_saved():
    """Checkpointing's point is memory: the MX step must save no more than torch's own
    partition of the same checkpointed graph (which saves fp32; MX saves fp8 or less)."""
    model, loss_of = _user_model_and_loss(use_reentrant=False)
    report = Report({})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=functools.partial(
        compile_graph, config=MXConfig(), lower=decomposed_eager_lowering(), report=report, describe=True))
    loss_of(compiled).backward()
    assert report.decisions and all(d.decision == MX for d in report.decisions)
    assert report.saved_bytes_after <= report.saved_bytes_before, (
        f"MX saves {report.saved_bytes_after} B, torch's checkpointed partition {report.saved_bytes_before} B")


# ================================================================ torchtitan's policies

requires_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro einops; "
           "see docs/torchtitan.md)")
_FAKE_TENSOR_INIT = FakeTensorMode.__init__  # before torchtitan.distributed.compile wraps it


@pytest.fixture(scope="module", autouse=True)
def _restore_fake_tensor_init():
    yield
    FakeTensorMode.__init__ = _FAKE_TENSOR_INIT


@pytest.fixture
def torchtitan_state():
    """What torchtitan's policies and apply_compile set process-wide, restored after the test."""
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs,
                                    skip_fwd_side_effects_in_bwd_under_checkpoint=(
                                        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)), \
            torch._functorch.config.patch(activation_memory_budget=torch._functorch.config.activation_memory_budget):
        try:
            yield
        finally:
            torch._C._dynamo.eval_frame._set_lru_cache(True)  # torch's default (policies turn it off)


def _llama3_config():
    """A tiny torchtitan llama3 built with torchtitan's own layer builder, with its SDPA
    attention (its default FlexAttention is refused for any backend but inductor and aot_eager),
    as examples/torchtitan_llama.py builds it. head_dim 32: attention's GEMMs are whole MX blocks."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm as TitanRMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        Llama3Model, _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init,
    )

    head_dim = TT_DIM // TT_HEADS
    layers = _build_llama3_layers(
        n_layers=TT_LAYERS, dim=TT_DIM, n_heads=TT_HEADS, hidden_dim=TT_FFN,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=4 * TT_SEQ, theta=500000, scaling="llama"),
        attn_backend="flex", fuse_qkv=True)
    for layer in layers:  # one document per sequence: causal SDPA is the same attention
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=TT_DIM, vocab_size=TT_VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=TT_VOCAB, embedding_dim=TT_DIM, param_init=_EMBEDDING_INIT),
        norm=TitanRMSNorm.Config(normalized_shape=TT_DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=TT_DIM, out_features=TT_VOCAB, param_init=_output_linear_init(TT_DIM)),
        layers=layers)


def _llama3() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    model = _llama3_config().build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model.train()


class _OneProcess:
    """The ParallelDims that torchtitan's apply_compile reads without parallelism."""
    tp_enabled = False


def _policy(name: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    return {"full": lambda: FullAC(FullAC.Config()),
            "selective": lambda: SelectiveAC(SelectiveAC.Config()),
            "memory_budget": lambda: MemoryBudgetAC(MemoryBudgetAC.Config(memory_budget=TT_MEMORY_BUDGET))}[name]()


def _block_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The blocks' parameter gradients, by their names without checkpoint_wrapper's level."""
    return {name.replace(WRAPPED, ""): p.grad for name, p in model.named_parameters()
            if name.startswith("layers.") and p.grad is not None}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _titan_step(policy: str | None, backend: Callable) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """torchtitan's order (parallelize_llama): the policy's apply(), then apply_compile; one
    training step's block gradients."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    model = _llama3()
    if policy is not None:
        _policy(policy).apply(model)
    torch._dynamo.reset()
    apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"], backend=backend),
                  parallel_dims=_OneProcess())
    inputs, targets = _tokens(TT_VOCAB, TT_BATCH, TT_SEQ)
    _loss(model(inputs), targets).backward()
    return model, _block_gradients(model)


class _OutsideOracle(torch.autograd.Function):
    """fn(h) run as torchtitan runs it, outside the compiled blocks: eager torch with the
    oracle's modes off, forward and backward (its parameters' gradients accumulate as usual)."""

    @staticmethod
    def forward(ctx, fn, h):
        with _disable_current_modes(), torch.enable_grad():
            ctx.h = h.detach().requires_grad_(True)
            ctx.out = fn(ctx.h)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad):
        with _disable_current_modes():
            torch.autograd.backward(ctx.out, grad)
        return None, ctx.h.grad


def _oracle_block_gradients(sdpa: SdpaForm) -> dict[str, torch.Tensor]:
    """The eager MX oracle over the blocks only (their GEMMs in MX, SDPA in the form `sdpa`);
    embedding, final norm, output projection and loss as torchtitan leaves them: eager fp32."""
    model = _llama3()
    inputs, targets = _tokens(TT_VOCAB, TT_BATCH, TT_SEQ)
    with MXOracle(sdpa=sdpa, decompositions=select_decomp_table()) as oracle:
        h = model.tok_embeddings(inputs)  # a gather: the same on both sides
        for layer in model.layers.values():  # torchtitan's Decoder.forward, without masks or positions
            h = layer(h, None, None)
        loss = _OutsideOracle.apply(lambda x: _loss(model.lm_head(model.norm(x)), targets), h)
        loss.backward()
    assert oracle.converted, "the oracle saw no GEMM to convert: nothing would be compared"
    return _block_gradients(model)


def _distances(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    return {name: relative_distance(actual[name], expected[name]) for name in expected}


def _block_decisions(model: nn.Module) -> Counter:
    """The decisions of the one graph that every block runs (report_of each block finds it)."""
    found = [mxcompile.report_of(block) for block in model.layers.values()]
    assert all(len(reports) == 1 for reports in found), [len(reports) for reports in found]
    assert len({id(reports[0]) for reports in found}) == 1, "the blocks do not share one compiled graph"
    return Counter((d.kind, d.decision, ATTENTION_OFF_REASON in d.reason) for d in found[0][0].decisions)


@pytest.fixture(scope="module")
def titan_without_checkpointing() -> dict[str, torch.Tensor]:
    """Block gradients of the llama3 compiled per block with MX attention, no checkpointing."""
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs,
                                    skip_fwd_side_effects_in_bwd_under_checkpoint=(
                                        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)):
        model, grads = _titan_step(None, _backend())
        decisions = _block_decisions(model)
    torch._dynamo.reset()
    return {"grads": grads, "decisions": decisions}


@requires_torchtitan
def test_torchtitan_reference_without_checkpointing_is_mx(titan_without_checkpointing):
    """The reference the policies' MX-attention runs are held to: every block GEMM in MX, within
    MX_SDPA_BOUND of the oracle's eager MX attention (MX SDPA is not its numerics)."""
    decisions = titan_without_checkpointing["decisions"]
    assert decisions == Counter({("attention", MX, False): TT_ATTENTION_GEMMS,
                                 ("output", MX, False): 5, ("input_grad", MX, False): 5,
                                 ("weight_grad", MX, False): 5}), decisions
    distances = _distances(titan_without_checkpointing["grads"], _oracle_block_gradients(SdpaForm.EAGER_MX))
    worst = max(distances, key=distances.get)
    assert distances[worst] <= MX_SDPA_BOUND, f"{worst}: {distances[worst]:.3g}"


@requires_torchtitan
@pytest.mark.parametrize("policy", ["full", "selective", "memory_budget"])
def test_torchtitan_policy_with_per_block_compile(policy, torchtitan_state, titan_without_checkpointing):
    budget_before = torch._functorch.config.activation_memory_budget
    # attention="off": torchtitan's SDPA kept in high precision on both sides, every Linear GEMM in
    # MX; the graph is the oracle's op by op: EXACT.
    model, grads = _titan_step(policy, _backend(attention="off"))
    if policy == "memory_budget":
        assert torch._functorch.config.activation_memory_budget == TT_MEMORY_BUDGET
    decisions = _block_decisions(model)
    assert decisions == Counter({("attention", KEPT, True): TT_ATTENTION_GEMMS,
                                 ("output", MX, False): 5, ("input_grad", MX, False): 5,
                                 ("weight_grad", MX, False): 5}), decisions
    assert sum(n for (_, d, _), n in decisions.items() if d == MX) == TT_LINEAR_GEMMS
    distances = _distances(grads, _oracle_block_gradients(SdpaForm.HIGH_PRECISION))
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"{policy}, attention='off': worst block parameters {worst}"

    # The default attention="both": all 21 block GEMMs in MX; recomputation is deterministic, so
    # the gradients are those of the same model compiled without checkpointing: EXACT.
    model, grads = _titan_step(policy, _backend())
    decisions = _block_decisions(model)
    assert decisions == titan_without_checkpointing["decisions"], decisions
    distances = _distances(grads, titan_without_checkpointing["grads"])
    worst = sorted(distances.items(), key=lambda item: -item[1])[:3]
    assert worst[0][1] == EXACT, f"{policy}, MX attention: worst block parameters vs no checkpointing {worst}"
    assert torch._functorch.config.activation_memory_budget == (
        TT_MEMORY_BUDGET if policy == "memory_budget" else budget_before)


def test_memory_budget_is_restored():
    """The memory-budget policy's setting did not outlive its test (the fixture restores it)."""
    assert torch._functorch.config.activation_memory_budget == 1.0
