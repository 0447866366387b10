"""`mxcompile.report_of(block)` finds the graph each FSDP2 unit ran (torchtitan's per-block
compile + fully_shard): the graph ran with the unsharded parameters, while between steps the
block holds the sharded ones. One process, a gloo group of one."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mxcompile
from mxcompile.backend import compile_and_record
from mxcompile.config import MXConfig
from mxcompile.lowering import eager_compiler


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_report_of_finds_each_fsdp2_units_graph(single_rank_group):
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    mxcompile.clear_reports()
    model = nn.Sequential(_Block(), _Block())
    backend = functools.partial(compile_and_record, config=MXConfig(), lower=eager_compiler)
    for block in model:
        fully_shard(block)
        block.compile(backend=backend)
    fully_shard(model)
    model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    reports = [mxcompile.report_of(block) for block in model]
    assert all(reports), [len(r) for r in reports]
    assert all(d.decision == "mxfp8" for d in reports[1][0].decisions)
