"""hoist_saved_values: a value only the backward reads is computed as soon as its inputs exist,
when that frees at least what it holds; only the order changes."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from mxcompile.passes.hoist_saved import hoist_saved_values

ROWS, WIDTH = 64, 32


def _order(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _forward(saved_dtype: torch.dtype):
    """A partitioned-forward-like graph: the loss first (the user output), then a value saved
    for the backward computed from h, at the very end (as the partitioner lays out a value
    computed in the joint graph's backward part)."""
    def forward(x, w):
        h = torch.relu(x @ w)
        loss = (h @ w.t()).sum()
        return loss, h.to(saved_dtype)

    x, w = torch.randn(ROWS, WIDTH), torch.randn(WIDTH, WIDTH)
    return make_fx(forward)(x, w), (x, w)


def test_a_saved_value_moves_to_just_after_its_input_and_computes_the_same() -> None:
    gm, inputs = _forward(torch.bfloat16)  # half of h's bytes
    before = _order(gm)
    assert before[-1] == "_to_copy", before
    expected = gm(*inputs)
    assert hoist_saved_values(gm, num_fwd_outputs=1) == ["_to_copy"]
    after = _order(gm)
    assert after.index("_to_copy") == after.index("relu") + 1, after
    assert sorted(after) == sorted(before)
    for got, want in zip(gm(*inputs), expected):
        assert torch.equal(got, want)


def test_a_saved_value_larger_than_what_it_frees_stays() -> None:
    gm, _ = _forward(torch.float64)  # twice h's bytes: moving it up would raise the peak
    before = _order(gm)
    assert hoist_saved_values(gm, num_fwd_outputs=1) == []
    assert _order(gm) == before


def test_user_outputs_and_random_ops_stay() -> None:
    def forward(x, w):
        h = torch.relu(x @ w)
        loss = (h @ w.t()).sum()
        noise = torch.rand_like(h)
        return loss, h.to(torch.bfloat16) * 1.0, noise, h.sum()

    gm = make_fx(forward)(torch.randn(ROWS, WIDTH), torch.randn(WIDTH, WIDTH))
    names = _order(gm)
    random = [n for n in names if n.startswith("rand")]
    moved = hoist_saved_values(gm, num_fwd_outputs=3)  # the loss, the bf16 copy and the noise are user outputs
    assert not set(moved) & {*random, "_to_copy", "mul"}
    assert moved == ["sum_2"]
    assert [n for n in _order(gm) if n.startswith("rand")] == random
