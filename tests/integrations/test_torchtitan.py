"""torchtitan (0.3) with `backend="mxfp8"`: examples/torchtitan_llama.py under torchrun on 2 gloo
ranks. A tiny torchtitan llama3 (dim 64, 2 blocks, head_dim 32, vocab 256; SDPA attention)
trains 3 steps parallelized by torchtitan's own `parallelize_llama` (per-block
`block.compile(backend=..., fullgraph=True)`, then FSDP2 with dp_shard=2), the output projection
compiled too (`--compile-lm-head`). The graphs run eagerly (`--lowering eager`: the backend's
passes, partition and reports without Inductor's compile time, as the other integration tests).

Checked against single-process runs of the same initial weights on the global batches, made by
the script on rank 0: torchtitan's `apply_compile` with the same backend (no FSDP), and eager fp32.
FSDP2 changes only the order of fp32 sums and every rank's 64 tokens are whole MX blocks, so the
2-rank losses and first-step gradients equal the single-process MX ones to TOL (measured about
1e-7); MX's rounding moves step 1's loss by about 1e-4 relative from eager fp32 (under
EAGER_LOSS_RTOL) and the first-step gradients by several percent (more than MX_GRAD_MIN: the
conversion is not a no-op).

`backend="nvfp4"` (in one process: torchtitan's `apply_compile` with the FP4 backend's pipeline,
the output projection compiled alone as `--compile-lm-head` does, the graphs run op by op): the
recipe's high-precision layers are the model's, not each graph's (mxcompile/model_layers.py).
torchtitan compiles each block on its own and dynamo would run one graph for every block; the
recipe keeps the model's last 2 of 10 linear layers (the last block's feed_forward.w3 and w2, in
forward order), so the last block gets its own graph, and the output projection, whose graph's
only module name is '', stays in high precision as the model's `lm_head`. The blocks' gradients
equal the FP4 oracle's (tests/fp4_oracle.py) bit for bit, the oracle given that set; before, the
rule kept feed_forward.w2 in every block and converted the output projection to NVFP4.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 "
                                        "spmd_types==0.2.3 tyro einops; see docs/torchtitan.md)")
# The in-process torchtitan llama3 and the restoration of what torchtitan sets process-wide, shared
# with the activation-checkpointing tests (its fixtures used here by name).
from integrations.test_activation_checkpointing import _restore_fake_tensor_init, torchtitan_state  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this torch build")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchtitan_llama.py"
NPROC, STEPS, LAYERS, DIM, HEADS, FFN, VOCAB, SEQ, BATCH = 2, 3, 2, 64, 2, 128, 256, 32, 2
LAUNCH_TIMEOUT_S = 600
TOL = 1e-5
EAGER_LOSS_RTOL = 1e-3
MX_GRAD_MIN = 1e-3
# 5 Linears per block (wqkv, wo, w1, w2, w3) x 3 GEMMs of training, and attention's 6 GEMMs
# (S = Q K^T, O = P V and the four of their backward).
BLOCK_GEMMS = 5 * 3 + 6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One torchrun launch, as tests/distributed/conftest.py launches its worker."""
    out = tmp_path_factory.mktemp("torchtitan") / "results.json"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
               str(SCRIPT), "--steps", str(STEPS), "--layers", str(LAYERS), "--dim", str(DIM), "--heads", str(HEADS),
               "--ffn", str(FFN), "--vocab", str(VOCAB), "--seq", str(SEQ), "--batch", str(BATCH),
               "--lowering", "eager", "--compile-lm-head", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"torchrun failed with exit code {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


def test_two_ranks_train_as_one_process(results) -> None:
    """torchtitan's per-block compile + FSDP2 on 2 ranks = its apply_compile on one process."""
    assert results["world_size"] == NPROC
    fsdp, one = results["mxfp8"]["losses"], results["mxfp8_one_process"]["losses"]
    assert len(fsdp) == len(one) == STEPS
    for step, (got, want) in enumerate(zip(fsdp, one), start=1):
        assert abs(got - want) <= TOL * abs(want), f"step {step}: 2 ranks {got} vs one process {want}"
    grads = results["first_step_grads"]["fsdp_vs_one_process"]
    assert grads["worst"] <= TOL, grads


def test_step_one_loss_is_eager_fp32_up_to_mx_rounding(results) -> None:
    eager, mx = results["eager"]["losses"][0], results["mxfp8"]["losses"][0]
    assert abs(mx - eager) <= EAGER_LOSS_RTOL * eager, (mx, eager)
    # ... and MX did round: the first-step gradients are not fp32's.
    assert results["first_step_grads"]["one_process_vs_eager"]["worst"] >= MX_GRAD_MIN, results["first_step_grads"]


def test_every_block_runs_the_shared_block_graph_in_mx(results) -> None:
    blocks = results["reports"]["blocks"]
    assert sorted(blocks) == [str(i) for i in range(LAYERS)]
    # mxcompile.report_of(block) finds, from every block, the one graph that block.compile made.
    assert all(block["graphs"] == 1 for block in blocks.values()), {n: b["graphs"] for n, b in blocks.items()}
    assert len({block["report_ids"][0] for block in blocks.values()}) == 1
    tokens = BATCH * SEQ
    linear_flops = 2 * tokens * (DIM * 3 * DIM + DIM * DIM + 3 * DIM * FFN)
    attention_flops = 2 * 2 * BATCH * SEQ * SEQ * DIM
    for name, block in blocks.items():
        kept = [d for d in block["decisions"] if d["decision"] != "mxfp8"]
        assert block["gemms"] == block["converted"] == BLOCK_GEMMS and not kept, (name, kept)
        assert block["gemm_flops"] == block["gemm_flops_converted"] == 3 * (linear_flops + attention_flops), name
        assert sum(d["kind"] == "attention" for d in block["decisions"]) == 6, name


def test_compiled_output_projection_in_mx(results) -> None:
    head = results["reports"]["lm_head"]
    assert head["graphs"] == 1 and head["gemms"] == head["converted"] == 3, head
    assert head["gemm_flops_converted"] == head["analytic_gemm_flops"] == 3 * 2 * BATCH * SEQ * DIM * VOCAB
    assert results["reports"]["model_converted_flop_fraction"] == 1.0


def test_torchtitan_refusals_are_reported(results) -> None:
    assert "neither 'inductor' nor 'aot_eager'" in results["flex_attention"], results["flex_attention"]
    if "torchao" in results:  # the converter runs (sm100+): its losses come beside ours
        assert len(results["torchao"]["losses"]) == STEPS
    else:
        assert "MXFP8 is only supported on SM100" in results["torchao_converter"], results["torchao_converter"]


# ---------------------------------------------------------------- nvfp4, one process
# A block's linear layers in forward order (SwiGLU: w2(silu(w1 x) * w3 x)). The model has 10; the
# recipe keeps round(0.15 * 10) = 2, the last ones, and the output projection.
NVFP4_BLOCK_LINEARS = ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w3",
                       "feed_forward.w2")
NVFP4_KEPT = ("layers.1.feed_forward.w3", "layers.1.feed_forward.w2")
GEMMS_PER_LINEAR = 3


def _fp4_oracle_block_gradients(kept: set[str]) -> dict[str, Any]:
    """The FP4 oracle over the blocks only, as test_activation_checkpointing's MX oracle runs
    them: embedding, final norm, output projection and loss eager in fp32 outside it."""
    from torch._inductor.decomposition import select_decomp_table

    from fp4_oracle import NVFP4_RECIPE, FP4Oracle
    from integrations.test_activation_checkpointing import (
        TT_BATCH, TT_SEQ, TT_VOCAB, _block_gradients, _llama3, _loss, _OutsideOracle, _tokens,
    )

    model = _llama3()
    inputs, targets = _tokens(TT_VOCAB, TT_BATCH, TT_SEQ)
    with FP4Oracle(model, NVFP4_RECIPE, kept, decompositions=select_decomp_table()):
        h = model.tok_embeddings(inputs)
        for layer in model.layers.values():
            h = layer(h, None, None)
        _OutsideOracle.apply(lambda x: _loss(model.lm_head(model.norm(x)), targets), h).backward()
    return _block_gradients(model)


def _titan_step_with_output_projection(backend) -> tuple[Any, dict[str, Any]]:
    """torchtitan's apply_compile, the output projection compiled alone as
    examples/torchtitan_llama.py's compile_lm_head does; one training step's block gradients."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    from integrations.test_activation_checkpointing import (
        TT_BATCH, TT_SEQ, TT_VOCAB, _block_gradients, _llama3, _loss, _OneProcess, _tokens,
    )

    model = _llama3()
    torch._dynamo.reset()
    apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"], backend=backend),
                  parallel_dims=_OneProcess())
    model.lm_head.forward = torch.compile(model.lm_head.forward, backend=backend, fullgraph=True)
    inputs, targets = _tokens(TT_VOCAB, TT_BATCH, TT_SEQ)
    _loss(model(inputs), targets).backward()
    return model, _block_gradients(model)


def test_nvfp4_keeps_the_models_last_layers_and_output_projection(torchtitan_state) -> None:
    """torchtitan's per-block compile with the nvfp4 backend's pipeline (its defaults: RHT,
    stochastic rounding, 2-D weights, high-precision layers; attention off)."""
    import mxcompile
    from gradient_blocks import EXACT, decomposed_eager_lowering
    from mx_oracle import relative_distance
    from mxcompile.backend import compile_and_record
    from mxcompile.config import MXConfig

    backend = functools.partial(compile_and_record, config=MXConfig.for_recipe("nvfp4"),
                                lower=decomposed_eager_lowering())
    model, grads = _titan_step_with_output_projection(backend)
    found = {name: mxcompile.report_of(block) for name, block in model.layers.items()}
    assert all(len(reports) == 1 for reports in found.values()) and found["0"][0] is not found["1"][0]
    for name, (report,) in found.items():  # each block's one graph
        linear = Counter((d.module, d.format or d.decision) for d in report.decisions if d.kind != "attention")
        assert linear == Counter({(m, "kept" if f"layers.{name}.{m}" in NVFP4_KEPT else "nvfp4"): GEMMS_PER_LINEAR
                                  for m in NVFP4_BLOCK_LINEARS}), (name, linear)
        assert all(d.decision == "kept" for d in report.decisions if d.kind == "attention")
    (head,) = mxcompile.report_of(model.lm_head)
    assert [(d.module, d.decision) for d in head.decisions] == [("", "kept")] * GEMMS_PER_LINEAR, head.decisions
    assert all("lm_head stays in high precision" in d.reason and "module 'lm_head' of the Llama3Model" in d.reason
               for d in head.decisions), head.decisions
    expected = _fp4_oracle_block_gradients(set(NVFP4_KEPT))
    assert sorted(grads) == sorted(expected)
    worst = sorted(((relative_distance(grads[n], expected[n]), n) for n in expected), reverse=True)[:3]
    assert worst[0][0] == EXACT, worst
