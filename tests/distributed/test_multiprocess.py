"""DDP, FSDP2 (plain and MXFP8 all-gather) and tensor parallelism on 2 CPU processes (gloo)
against one process. One torchrun launch runs every scenario of `worker.py` with the eager
lowering (the mxfp8 pipeline without Inductor; the `results` fixture of conftest.py, shared with
test_usages.py); one slow launch repeats FSDP2 + MXFP8 all-gather with Inductor.

Tolerances: data and tensor parallelism change only the order of fp32 sums (all-reduce of
partial sums, GEMMs over per-rank token halves), and with 32-token-aligned per-rank batches
and K-shards of whole blocks every MX block is the single-process block. So losses agree to
LOSS_RTOL and first-step gradients to GRAD_RTOL (relative norm error per parameter; measured
about 1e-7). The MXFP8 all-gather gives the same numbers as the plain all-gather, bit for bit.
DDP and FSDP2 (high-precision all-gather) with the nvfp4 recipe are held to data parallelism
written out in the worker (`data_parallel_nvfp4`: NVFP4 quantizes each rank's local tensors), to
the same GRAD_RTOL.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
MX_BYTES_PER_ELEMENT = 1 + 1 / 32
LINEARS_PER_BLOCK = 5  # the built-in GPT's block graph (one per FSDP unit, shared by both blocks)
ATTENTION_GEMMS = 6

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


def _counts(decisions: list[dict[str, Any]], *fields: str) -> Counter:
    return Counter(tuple(d[f] for f in fields) for d in decisions)


def _unit_relative(module: str) -> str:
    """Module path relative to its FSDP unit (a block or the LM head), as the per-unit compiled
    graphs of compile_fsdp2 name them."""
    for prefix in ("lm_head",):
        if module == prefix or module.startswith(prefix + "."):
            return module[len(prefix) + 1:]
    return module  # worker.summarize already stripped "blocks.<i>."


def _assert_losses_match(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: loss {got} vs {want}"


def _assert_grads_match(result: dict[str, Any]) -> None:
    cmp = result["grads_vs_reference"]
    assert cmp["worst_rel_norm_err"] <= GRAD_RTOL, cmp


def test_reference_converts_every_gemm(results):
    (decisions,) = results["reference"]["decisions"]
    assert decisions and all(d["decision"] == "mxfp8" for d in decisions), \
        [d for d in decisions if d["decision"] != "mxfp8"]


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp_mx", "tp"])
def test_layout_matches_single_process(results, layout):
    result = results[layout]
    _assert_losses_match(result["losses"], results["reference"]["losses"])
    _assert_grads_match(result)


@pytest.mark.parametrize("scenario", ["fsdp_nvfp4", "ddp_nvfp4"])
def test_nvfp4_equals_data_parallel(results, scenario):
    """FSDP2 or DDP + nvfp4 (RHT, stochastic rounding, 2-D weights) on 2 ranks: the first step's
    loss and gradients are those of each rank's unsharded copy on its rows, averaged; every
    linear GEMM in NVFP4, attention kept (off); FSDP2 all-gathers the weights in high precision."""
    result = results[scenario]
    assert abs(result["losses"][0] - result["first_loss_data_parallel"]) <= LOSS_RTOL * result["losses"][0]
    assert result["grads_vs_data_parallel"]["worst_rel_norm_err"] <= GRAD_RTOL, result["grads_vs_data_parallel"]
    if scenario == "ddp_nvfp4":  # one graph of the whole model per rank (DDP's buckets may split it)
        for decisions in result["decisions"]:
            formats = _counts(decisions, "kind", "format")
            assert set(formats) == {("output", "nvfp4"), ("input_grad", "nvfp4"), ("weight_grad", "nvfp4"),
                                    ("attention", "")}, formats
        return
    assert result["mx_weights"] == {}
    for decisions in result["decisions"]:
        assert _counts(decisions, "kind", "format") == Counter(
            {(kind, "nvfp4"): LINEARS_PER_BLOCK for kind in ("output", "input_grad", "weight_grad")}
            | {("attention", ""): ATTENTION_GEMMS}), decisions


def test_ddp_report_equals_single_process(results):
    (reference,) = results["reference"]["decisions"]
    for rank_decisions in results["ddp"]["decisions"]:
        assert _counts(rank_decisions, "graph", "kind", "decision", "full_module") == \
            _counts(reference, "graph", "kind", "decision", "full_module")


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_mx"])
def test_fsdp_report_equals_single_process(results, layout):
    """compile_fsdp2 compiles each FSDP unit: the two blocks share one graph, so compare the
    distinct GEMM sites (graph, kind, decision, module within its unit)."""
    (reference,) = results["reference"]["decisions"]
    want = {(d["graph"], d["kind"], d["decision"], _unit_relative(d["module"])) for d in reference}
    for rank_decisions in results[layout]["decisions"]:
        got = {(d["graph"], d["kind"], d["decision"], d["module"]) for d in rank_decisions}
        assert got == want


def test_tp_report_equals_single_process_up_to_kind(results):
    (reference,) = results["reference"]["decisions"]
    for rank_decisions in results["tp"]["decisions"]:
        assert _counts(rank_decisions, "graph", "decision", "full_module") == \
            _counts(reference, "graph", "decision", "full_module")
    assert results["tp"]["problems"] == []


def test_tp_report_kinds_equal_single_process(results):
    (reference,) = results["reference"]["decisions"]
    for rank_decisions in results["tp"]["decisions"]:
        assert _counts(rank_decisions, "graph", "kind", "decision") == \
            _counts(reference, "graph", "kind", "decision")


def test_fsdp_mx_all_gather_is_bitwise_the_plain_all_gather(results):
    """Forward GEMMs see exactly quantize(W) along K and the dX GEMMs exactly quantize(W)
    along N, as with the plain all-gather: losses and gradients are bit-identical."""
    assert results["fsdp_mx"]["losses"] == results["fsdp"]["losses"]
    assert results["fsdp_mx"]["grads_vs_fsdp"]["bitwise_equal"], results["fsdp_mx"]["grads_vs_fsdp"]


def test_fsdp_mx_all_gather_formats_and_bytes(results):
    result = results["fsdp_mx"]
    assert all(v.startswith("mxfp8 all-gather; backward gathers W quantized along N")
               for v in result["mx_weights"].values()), result["mx_weights"]
    steps = len(result["losses"])
    # Every linear's unit reshards after the forward: one K-axis gather per forward, one
    # N-axis gather per backward.
    assert set(result["gather_counts"]) == set(result["mx_weights"])
    assert all(c == {"forward": steps, "backward": steps} for c in result["gather_counts"].values())
    # Payload of one step: MX weights move 1 + 1/32 bytes per element instead of 4 (fp32).
    numel = result["param_numel"]
    mx_numel = sum(numel[name] for name in result["mx_weights"])
    other_numel = sum(n for name, n in numel.items() if name not in result["mx_weights"])
    plain = results["fsdp"]["comm"]["bytes"]["all_gather"]
    mx = result["comm"]["bytes"]["all_gather"]
    fp32 = torch.finfo(torch.float32).bits // 8
    saved_per_gathered_element = fp32 - MX_BYTES_PER_ELEMENT
    # Linear weights are gathered twice per step (forward, backward), per rank 1/world_size of them.
    expected_saving = 2 * mx_numel / results["world_size"] * saved_per_gathered_element
    assert plain - mx == pytest.approx(expected_saving, rel=1e-9), (plain, mx, mx_numel, other_numel)
    assert results["fsdp"]["comm"]["bytes"]["reduce_scatter"] == result["comm"]["bytes"]["reduce_scatter"]


def test_all_gather_mx_weight_is_bit_identical_to_one_process(results):
    for name, case in results["all_gather"].items():
        assert case["data_equal"] and case["scale_equal"], name
        assert case["bytes"] == pytest.approx(case["shard_numel"] * MX_BYTES_PER_ELEMENT), name


# Linear(64, 65) ColwiseParallel then Linear(65, 64) RowwiseParallel on 2 ranks: DTensor shards
# the 65-long axis as [0, 33) and [33, 65). Contracting over it: down's forward GEMM (local
# K = 33 | 32) and up's dX GEMM (local N = 33 | 32).
MISALIGNED_GEMMS = (("forward", "down"), ("backward", "up"))


def test_misaligned_shard_is_flagged(results):
    problems = results["tp_misaligned"]["problems"]
    assert len(problems) == 2 and all("[0, 33), [33, 65)" in p for p in problems), problems
    assert problems[0].startswith("up.weight: axis 0") and problems[1].startswith("down.weight: axis 1")


def test_misaligned_shard_kept_on_every_rank(results):
    for rank_decisions in results["tp_misaligned"]["current"]:
        kept = {(d["graph"], d["full_module"]) for d in rank_decisions if d["decision"] == "kept"}
        assert kept == set(MISALIGNED_GEMMS)


def test_fsdp_mx_all_gather_with_inductor(launch_workers, results):
    """The full backend (Inductor lowering) under FSDP2 with the MXFP8 all-gather."""
    inductor = launch_workers("inductor", "--lowering", "inductor", "--scenarios", "fsdp_mx")
    result = inductor["fsdp_mx"]
    _assert_losses_match(result["losses"], results["fsdp_mx"]["losses"])
    for rank_decisions in result["decisions"]:
        assert _counts(rank_decisions, "graph", "kind", "decision", "module") == \
            _counts(results["fsdp_mx"]["decisions"][0], "graph", "kind", "decision", "module")
