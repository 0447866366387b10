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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 "
                                        "spmd_types==0.2.3 tyro einops; see docs/torchtitan.md)")
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
