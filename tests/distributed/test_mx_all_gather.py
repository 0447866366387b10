"""Single-process tests of the MXFP8 all-gather pieces: the FSDP2 hooks of MXAllGatherWeight
(gathers simulated by concatenating shards along dim 0, as FSDP2 does), the standalone
all_gather_mx_weight on a 1-rank gloo group, the collective counter and the placeholder
mapping for subclass inputs. The 2-process runs are in test_multiprocess.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from mxcompile.config import MXConfig
from mxcompile.distributed import (
    CollectiveCounter,
    MXAllGatherSpec,
    MXAllGatherWeight,
    all_gather_decisions,
    all_gather_mx_weight,
    enable_mx_all_gather,
    mx_all_gather_bytes_per_element,
    param_placeholder_indices,
)
from mxcompile.numerics import dequantize_mx, quantize_mx

N, K = 128, 96
WORLD = 2
OCTAVES = 24  # more than e4m3's range below a block maximum (about 17 octaves)
ROW_STRIDE, COL_STRIDE = 7, 5  # coprime with OCTAVES: every residue appears within a block
BLOCK = 32
SEED = 7


def graded(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Magnitudes 2**-(a_i + b_j) with a_i, b_j cycling through OCTAVES octaves within every
    block of 32 along either axis, so that elements underflow differently under row and column
    blocking (FACTS: iid data cannot tell quantization axes or block placements apart)."""
    generator = torch.Generator().manual_seed(SEED)
    rows = torch.exp2(-((torch.arange(shape[0]) * ROW_STRIDE) % OCTAVES).float()).unsqueeze(1)
    cols = torch.exp2(-((torch.arange(shape[1]) * COL_STRIDE) % OCTAVES).float()).unsqueeze(0)
    return (torch.randn(shape, generator=generator) * rows * cols).to(dtype)


def _gather(shards: list[MXAllGatherWeight], param_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """FSDP2's path: pre-all-gather per shard, dim-0 concatenation, post-all-gather."""
    policy = type("Policy", (), {"param_dtype": param_dtype})()
    pieces, metas = zip(*(s.fsdp_pre_all_gather(None, torch.Size((N, K)), (K, 1), None, policy) for s in shards))
    outputs = tuple(torch.cat([p[i].view(-1, *p[i].shape[1:]) for p in pieces]) for i in range(2))
    weight, inner = shards[0].fsdp_post_all_gather(outputs, metas[0], param_dtype)
    assert inner[0] is weight
    return weight, metas[0][0]


def _shards(full: torch.Tensor, backward_axis: int) -> list[MXAllGatherWeight]:
    spec = MXAllGatherSpec(block_size=BLOCK)
    return [MXAllGatherWeight(s.contiguous(), spec, backward_axis) for s in full.chunk(WORLD, dim=0)]


class _InBackward(torch.autograd.Function):
    """Runs a callback inside the autograd engine (where FSDP2 issues backward all-gathers)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_gather_is_the_full_weight_quantized_along_k(dtype):
    full = graded((N, K))
    weight, axis = _gather(_shards(full, backward_axis=0), dtype)
    assert axis == 1
    expected = dequantize_mx(quantize_mx(full.to(dtype), axis=1), dtype)
    assert weight.dtype == dtype and torch.equal(weight, expected)
    wrong_axis = dequantize_mx(quantize_mx(full.to(dtype), axis=0), dtype)
    assert not torch.equal(weight, wrong_axis)  # the data can tell the axes apart


def test_backward_gather_is_the_full_weight_quantized_along_n():
    full = graded((N, K))
    shards = _shards(full, backward_axis=0)
    got: list = []
    x = torch.zeros(1, requires_grad=True)
    _InBackward.apply(x, lambda: got.append(_gather(shards, torch.float32))).sum().backward()
    (weight, axis), = got
    assert axis == 0
    assert torch.equal(weight, dequantize_mx(quantize_mx(full, axis=0)))
    assert [s.stats.backward for s in shards] == [1, 1] and [s.stats.forward for s in shards] == [0, 0]


@pytest.mark.parametrize("axis", [0, 1])
def test_graph_requantization_reproduces_the_gathered_values(axis):
    """The compiled GEMM re-quantizes the unsharded (dequantized) weight along the same axis:
    MX quantization is idempotent in value, so the GEMM computes with the gathered copy."""
    full = graded((N, K))
    gathered = dequantize_mx(quantize_mx(full, axis=axis))
    data, scale = torch.ops.mxcompile.quantize(gathered, axis, "e4m3", "rceil", BLOCK)
    again = dequantize_mx(quantize_mx(gathered, axis=axis))
    assert torch.equal(again, gathered)
    assert data.shape == gathered.shape and scale.dtype == torch.uint8


def test_out_variant_refills_without_bumping_the_version():
    full = graded((N, K))
    shards = _shards(full, backward_axis=0)
    weight, _ = _gather(shards, torch.float32)
    param = nn.Parameter(weight)
    version = param._version
    policy = type("Policy", (), {"param_dtype": torch.float32})()
    pieces, metas = zip(*(s.fsdp_pre_all_gather(None, full.shape, (K, 1), None, policy) for s in shards))
    outputs = tuple(torch.cat([p[i] for p in pieces]) for i in range(2))
    with torch.no_grad():
        param.zero_()
    version = param._version
    assert shards[0].fsdp_post_all_gather(outputs, metas[0], torch.float32, out=param) is None
    assert param._version == version and torch.equal(param.detach(), weight)


def test_subclass_keeps_fsdp_ops_and_unwraps_the_rest():
    w = MXAllGatherWeight(graded((N, K)), MXAllGatherSpec())
    assert all(isinstance(c, MXAllGatherWeight) for c in w.chunk(WORLD, dim=0))
    assert isinstance(w.view(-1), MXAllGatherWeight)
    assert type(w + 1) is torch.Tensor
    param = nn.Parameter(w)
    before = param.detach()._hp.clone()
    param.grad = torch.ones(N, K)
    torch.optim.SGD([param], lr=0.5).step()
    assert torch.equal(param.detach()._hp, before - 0.5)  # the master weight is updated in place


def test_enable_mx_all_gather_decisions():
    model = nn.ModuleDict({
        "ok": nn.Linear(64, 128),
        "bad_k": nn.Linear(48, 64),
        "odd_n": nn.Linear(64, 63),
        "short_rows": nn.Linear(64, 96),  # 48 rows per rank: no N-axis gather
    })
    decisions = enable_mx_all_gather(model, MXConfig(fsdp_all_gather="mxfp8"), world_size=WORLD)
    assert decisions["ok.weight"].startswith("mxfp8 all-gather; backward gathers W quantized along N")
    assert decisions["bad_k.weight"].startswith("kept: K=48 not divisible by block_size=32")
    assert decisions["odd_n.weight"].startswith("kept: N=63 not divisible by world_size=2")
    assert "re-quantizes it along N" in decisions["short_rows.weight"]
    assert isinstance(model["ok"].weight, MXAllGatherWeight) and model["ok"].weight.backward_axis == 0
    assert isinstance(model["short_rows"].weight, MXAllGatherWeight) and model["short_rows"].weight.backward_axis == 1
    assert type(model["bad_k"].weight) is nn.Parameter and model["ok"].bias.__class__ is nn.Parameter
    with pytest.raises(ValueError, match="fsdp_all_gather='bf16'"):
        enable_mx_all_gather(model, MXConfig(), world_size=WORLD)


def test_explain_reports_every_weights_all_gather_decision():
    """explain's report carries the per-weight rule's decision and reason (JSON too); a model
    the MX all-gather never saw reports none."""
    import mxcompile

    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 40), nn.Linear(40, 64))
    plain = mxcompile.explain(model, torch.randn(32, 64))
    assert plain.all_gather == {}
    config = MXConfig(fsdp_all_gather="mxfp8")
    decisions = enable_mx_all_gather(model, config, world_size=WORLD)
    assert all_gather_decisions(model) == decisions
    report = mxcompile.explain(model, torch.randn(32, 64), config=config)
    assert report.all_gather == decisions and report.to_dict()["all_gather"] == decisions
    assert report.all_gather["0.weight"].startswith("mxfp8 all-gather; backward gathers W quantized along N")
    assert report.all_gather["2.weight"].startswith("mxfp8 all-gather; shard rows N/world_size = 20")
    assert report.all_gather["3.weight"] == "kept: K=40 not divisible by block_size=32"


@pytest.fixture
def single_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_mx_weight_on_one_rank(single_rank_group, axis):
    full = graded((N, K), torch.bfloat16)
    with CollectiveCounter() as counter:
        mx = all_gather_mx_weight(full, single_rank_group, axis=axis)
    expected = quantize_mx(full, axis=axis)
    assert torch.equal(mx.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(mx.scale_bytes, expected.scale_bytes)
    assert counter.totals.calls["all_gather"] == 2
    assert counter.totals.bytes["all_gather"] == full.numel() * mx_all_gather_bytes_per_element(BLOCK)
    assert dist.all_gather_single.__name__ != "counted"  # restored on exit


def test_all_gather_mx_weight_rejects_straddling_blocks(single_rank_group):
    with pytest.raises(ValueError, match="K \\(in_features\\) = 48 is not divisible"):
        all_gather_mx_weight(torch.randn(64, 48), single_rank_group)
    with pytest.raises(ValueError, match="rows .* = 48 is not divisible"):
        all_gather_mx_weight(torch.randn(48, 64), single_rank_group, axis=0)
    with pytest.raises(ValueError, match="2-D"):
        all_gather_mx_weight(torch.randn(64), single_rank_group)


def test_param_placeholder_indices_maps_dtensor_pieces():
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput, SubclassGetAttrAOTInput

    graph = fx.Graph()
    descs = [
        PlainAOTInput(0),  # activation
        PlainAOTInput(1),  # plain parameter
        SubclassGetAttrAOTInput(PlainAOTInput(2), "_local_tensor"),  # DTensor parameter
        SubclassGetAttrAOTInput(PlainAOTInput(2), "device_mesh"),
        PlainAOTInput(3),  # plain parameter after the DTensor
    ]
    for i, desc in enumerate(descs):
        graph.placeholder(f"primals_{i + 1}").meta["desc"] = desc
    graph.placeholder("tangents_1")
    graph.output(None)
    gm = fx.GraphModule(nn.Module(), graph)
    assert param_placeholder_indices(gm, [1, 2, 3]) == (1, 2, 4)
    for node in gm.graph.nodes:
        node.meta.pop("desc", None)
    assert param_placeholder_indices(gm, [1, 2, 3]) == (1, 2, 3)


def test_shards_on_block_boundaries_quantize_like_the_whole():
    """The tensor-parallel condition in one process: a K-shard quantized on its own gives the
    single-process values iff it starts and ends on a multiple of the block size."""
    weight = graded((N, K))
    whole = dequantize_mx(quantize_mx(weight, axis=1, block_size=BLOCK))

    def shard(start: int, stop: int) -> torch.Tensor:
        return dequantize_mx(quantize_mx(weight[:, start:stop], axis=1, block_size=BLOCK))

    assert torch.equal(shard(BLOCK, K), whole[:, BLOCK:])
    offset = BLOCK // 2  # 32 columns starting mid-block, as rank 1 of K=65 on 2 ranks
    assert not torch.equal(shard(offset, offset + BLOCK), whole[:, offset:offset + BLOCK])


def test_sharded_contraction_reason_follows_transposes():
    from mxcompile.distributed.shard_check import sharded_contraction_reason

    aten = torch.ops.aten
    graph = fx.Graph()
    x = graph.placeholder("primals_1")
    w = graph.placeholder("primals_2")  # local shard of W (N, K), K cut off block boundaries
    wt = graph.call_function(aten.t.default, (w,))
    w_view = graph.call_function(aten.view.default, (w, [-1]))
    graph.output((graph.call_function(aten.mm.default, (x, wt)), w_view))
    for node, ndim in ((x, 2), (w, 2), (wt, 2)):
        node.meta["val"] = torch.empty((1,) * ndim)
    misaligned = {"primals_2": (1,)}
    # Y = X Wᵀ contracts Wᵀ along its dim 0, which is W's dim 1: kept.
    assert "dim 1 of primals_2" in sharded_contraction_reason(wt, 0, misaligned, BLOCK)
    # Along Wᵀ's dim 1 (W's dim 0, not cut): fine.
    assert sharded_contraction_reason(wt, 1, misaligned, BLOCK) is None
    # Through a reshape the axis is not tracked: conservative.
    assert "through a reshape" in sharded_contraction_reason(w_view, 0, misaligned, BLOCK)
    assert sharded_contraction_reason(x, 1, misaligned, BLOCK) is None
    assert sharded_contraction_reason(wt, 0, {}, BLOCK) is None


def test_fp4_recipes_all_gather_in_high_precision():
    """FP4 recipes keep FSDP2's high-precision all-gather: an MXFP8 one would round the weights
    before the FP4 GEMMs round them again, so it is refused, naming the fix; and fully_shard's
    backend and config must name the same recipe (its config defaults to the backend's)."""
    from mxcompile.distributed import fully_shard

    model = nn.Sequential(nn.Linear(K, N))
    fp4_mx_gather = MXConfig.for_recipe("nvfp4", {"fsdp_all_gather": "mxfp8"})
    with pytest.raises(ValueError, match=r"fsdp_all_gather='mxfp8' with recipe='nvfp4'.*set fsdp_all_gather='bf16'"):
        enable_mx_all_gather(model, fp4_mx_gather, world_size=WORLD)
    with pytest.raises(ValueError, match=r"fsdp_all_gather='mxfp8' with recipe='nvfp4'"):
        fully_shard(model, mesh=None, config=fp4_mx_gather)  # refused before the mesh is touched
    with pytest.raises(ValueError, match=r"backend='mxfp4' with config.recipe='mxfp8'"):
        fully_shard(model, mesh=None, config=MXConfig(), backend="mxfp4")
    assert type(model[0].weight) is nn.Parameter  # nothing was wrapped
