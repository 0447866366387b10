"""Attention batch chunks chosen after the memory plan: the rule on plain numbers, and the
rewrite of an attention node's `batch_chunk` for the room a budget leaves at its step."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mxcompile.config import MXConfig
from mxcompile.cost.graph_costs import attention_batch_chunk, attention_workspace_for_chunk, workspace_bytes
from mxcompile.cost.profiles import ATTENTION_PASS_RATE, ATTENTION_RATE, DeviceProfile
from mxcompile.ops.attention import ATTENTION
from mxcompile.passes.attention_chunks import (ChunkDecision, largest_fitting_chunk, unbudgeted_chunk,
                                               widen_attention_chunks)
from mxcompile.passes.memory_plan import _chunk_report
from mxcompile.planner import Plan

BATCH, HEADS, SEQ, WIDTH = 6, 2, 64, 32
PASSES_PER_S = 1000.0


def test_largest_fitting_chunk_on_plain_numbers() -> None:
    per_element = 100
    assert largest_fitting_chunk(8, 800, lambda c: per_element * c) == 8
    assert largest_fitting_chunk(8, 799, lambda c: per_element * c) == 7
    assert largest_fitting_chunk(8, 350, lambda c: per_element * c) == 3
    assert largest_fitting_chunk(8, 150, lambda c: per_element * c) == 1
    assert largest_fitting_chunk(8, -5, lambda c: per_element * c) == 1  # one element is the least an op runs
    assert largest_fitting_chunk(1, 10**9, lambda c: per_element * c) == 1


def _attention_graph(chunk: int) -> torch.fx.GraphModule:
    config = MXConfig()

    def forward(q, k, v):
        return ATTENTION(q, k, v, None, True, WIDTH**-0.5, config.attention.value, config.forward_elem.value,
                         config.scale_mode.value, config.block_size, 32, chunk)

    q, k, v = (torch.randn(BATCH, HEADS, SEQ, WIDTH) for _ in range(3))
    return make_fx(forward, tracing_mode="fake")(q, k, v)


def _profile() -> DeviceProfile:
    rates = {key: 1e12 for key in ("fp32", "bf16", "fp8")}
    sources = {f"peak_flops.{key}": "test" for key in rates}
    sources.update({"memory_bandwidth": "test", "host_link_bandwidth": "test", f"op_rates.{ATTENTION_RATE}": "test",
                    f"op_rates.{ATTENTION_PASS_RATE}": "test"})
    return DeviceProfile("test", rates, 1e12, 1e12, sources,
                         op_rates={ATTENTION_RATE: 1e12, ATTENTION_PASS_RATE: PASSES_PER_S}, native_fp8_gemm=False)


@pytest.mark.parametrize("room_elements, expected", [(2.5, 2), (4.0, 4), (100.0, 6), (0.5, 1)])
def test_widening_takes_the_largest_chunk_the_room_allows(room_elements: float, expected: int) -> None:
    gm = _attention_graph(chunk=1)
    node = next(n for n in gm.graph.nodes if n.target is ATTENTION)
    assert unbudgeted_chunk(node.args[0].meta["val"]) == BATCH  # a small query: the whole batch at once
    per_element = attention_workspace_for_chunk(node, 1)
    assert attention_workspace_for_chunk(node, 3) == 3 * per_element
    others = 10_000  # bytes the step holds besides the op's scratch
    budget = others + int(room_elements * per_element)
    step_bytes = {node.name: others + workspace_bytes(node)}

    [decision] = widen_attention_chunks([gm], [step_bytes], budget, _profile())

    assert decision.chunk == expected and attention_batch_chunk(node) == expected
    assert decision.scratch_bytes == workspace_bytes(node) <= max(decision.room_bytes, per_element)
    key_tiles = SEQ // 32
    passes = {c: -(-BATCH // c) * key_tiles for c in (1, expected, BATCH)}
    assert decision.saved_time_s == pytest.approx((passes[1] - passes[expected]) / PASSES_PER_S)
    assert decision.extra_time_s == pytest.approx((passes[expected] - passes[BATCH]) / PASSES_PER_S)
    assert str(decision.room_bytes) in decision.reason
    # The graph runs with the new chunk: same values as one element per call.
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, WIDTH) for _ in range(3))
    for got, want in zip(gm(q, k, v), _attention_graph(chunk=1)(q, k, v)):
        assert torch.equal(got, want)


def test_widening_never_narrows_and_skips_steps_it_has_no_bytes_for() -> None:
    gm = _attention_graph(chunk=3)
    node = next(n for n in gm.graph.nodes if n.target is ATTENTION)
    [decision] = widen_attention_chunks([gm], [{node.name: 10**9}], 1, _profile())  # no room at all
    assert decision.chunk == 3 and attention_batch_chunk(node) == 3
    assert widen_attention_chunks([gm], [{}], 10**12, _profile()) == []
    assert attention_batch_chunk(node) == 3


def _decision(node: str, *, extra: float, saved: float, recomputed: bool) -> ChunkDecision:
    return ChunkDecision(node, 2, 4, 0, 0, extra_time_s=extra, saved_time_s=saved, recomputed=recomputed, reason="")


def test_the_report_prices_the_chosen_chunks_against_the_step_without_a_budget() -> None:
    """Worked by hand. The plan was made with one element per call: 1.0 s of step, 0.2 s of it
    recomputation (a recomputed attention op at one element among it), 0.05 s of exposed
    transfers. Widening saves 0.3 s on an original op (still 0.1 s over its unbudgeted chunk)
    and 0.04 s on the recomputed copy (which the step without a budget does not run at all)."""
    plan = Plan(decisions=(), budget_bytes=1, peak_bytes=1, binding_step=0, binding_step_name="", memory_curve=(1,),
                step_time_s=1.0, base_time_s=0.75, extra_time_s=0.25, recompute_time_s=0.2,
                transfer_exposed_s=0.05, solver="heuristic", optimal=False, status="")
    chunks = [_decision("attention", extra=0.1, saved=0.3, recomputed=False),
              _decision("attention_copy", extra=0.0, saved=0.04, recomputed=True)]
    report = _chunk_report(plan, chunks)
    assert report["predicted_step_time_s"] == pytest.approx(1.0 - 0.3 - 0.04)
    assert report["attention_chunk_time_s"] == pytest.approx(0.1)
    assert report["extra_time_s"] == pytest.approx((0.2 - 0.04) + 0.05 + 0.1)
    # The step without a budget: the planned graphs' base time with the original op at its
    # unbudgeted chunk (0.75 - (0.3 + 0.1) of its one-element passes), no recomputation.
    assert report["keep_all_step_time_s"] == pytest.approx(0.75 - 0.4)
    assert [c["node"] for c in report["attention_chunks"]] == ["attention", "attention_copy"]
