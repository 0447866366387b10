"""Register spills of the MX attention kernels' autotune shapes (`configs.ATTENTION_SHAPES`).

The static report (`benchmarks/kernel_static.py`, results in
`benchmarks/results/kernel_static.json`) compiles every shape for sm90 and sm100 at head_dim 64
and 128, causal and not. Each shape states those of the head_dims at which it spills nothing on
either target (`spill_free_head_dims`), and the launchers autotune only over the shapes listed
for the call's head_dim: the cheap test below checks those statements against the committed
results, so a shape added or changed without re-running the report fails it. Compiling every
shape here would take minutes on 2 cores; the slow test compiles the report's sm90 head_dim-128
causal choices (head_dim 128 on sm90 is where every backward config spilled while the kernels
quantized their tiles themselves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxcompile.triton_templates import configs
from mxcompile.triton_templates.kernel_static import compile_static, launchers

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "kernel_static.json"
KERNELS = ("fwd", "dkdv", "dq")


def _records(target: dict, head_dim: int, kernel: str) -> dict[tuple[int, int, int, int], dict]:
    """(BLOCK_M, BLOCK_N, num_stages, num_warps) -> the report's record of that shape."""
    records = target[f"head_dim_{head_dim}"][f"mx_attention_{kernel}"]["configs"]
    return {(r["config"]["BLOCK_M"], r["config"]["BLOCK_N"], r["config"]["num_stages"], r["config"]["num_warps"]): r
            for r in records}  # fmt: skip


def _spills(record: dict) -> int:
    return record["spill_bytes"] + record["causal"]["spill_bytes"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_shape_is_listed_for_exactly_the_head_dims_where_it_spills_nothing(kernel: str) -> None:
    """Every shape's spill_free_head_dims are the checked head_dims at which the report shows no
    spill on sm90 and sm100, causal or not, and no shape spills at all of them. ~0.1 s (reads
    the results file)."""
    targets = json.loads(RESULTS.read_text())["targets"]
    for shape in configs.ATTENTION_SHAPES[kernel]:
        key = (shape.block_m, shape.block_n, shape.num_stages, shape.num_warps)
        spill_free = tuple(
            head_dim for head_dim in configs.SPILL_CHECKED_HEAD_DIMS
            if all(_spills(_records(targets[f"sm{sm}"], head_dim, kernel)[key]) == 0 for sm in (90, 100))
        )  # fmt: skip
        assert spill_free == shape.spill_free_head_dims and spill_free, (kernel, shape)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_reports_choices_are_listed_shapes(kernel: str) -> None:
    """The configs the report chose are among those the launchers autotune over. ~0.1 s."""
    targets = json.loads(RESULTS.read_text())["targets"]
    for target in targets.values():
        for head_dim in configs.SPILL_CHECKED_HEAD_DIMS:
            entry = target[f"head_dim_{head_dim}"][f"mx_attention_{kernel}"]
            chosen = entry["configs"][entry["chosen"]]["config"]
            shapes = {(s.block_m, s.block_n, s.num_stages, s.num_warps) for s in configs.attention_shapes(kernel, head_dim)}
            assert (chosen["BLOCK_M"], chosen["BLOCK_N"], chosen["num_stages"], chosen["num_warps"]) in shapes


def _chosen_sm90_d128() -> dict[str, tuple[dict[str, int], int, int]]:
    target = json.loads(RESULTS.read_text())["targets"]["sm90"]["head_dim_128"]
    chosen = {}
    for kernel in KERNELS:
        entry = target[f"mx_attention_{kernel}"]
        config = entry["configs"][entry["chosen"]]["config"]
        tiles = {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]}
        chosen[f"mx_attention_{kernel}"] = (tiles, config["num_warps"], config["num_stages"])
    return chosen


@pytest.mark.slow  # ~5-10 s per kernel on 2 cores
@pytest.mark.parametrize("label", [f"mx_attention_{kernel}" for kernel in KERNELS])
def test_chosen_configs_spill_nothing_sm90_d128_causal(label: str) -> None:
    kernel_name, launch = launchers(128, causal=True)[label]
    tiles, warps, stages = _chosen_sm90_d128()[label]
    static = compile_static(launch, kernel_name, tiles, 90, warps, stages)
    assert static.spill_bytes == 0, static.registers
    assert static.loop_classes is not None and static.loop_classes["local"] == 0
    assert static.loop_classes["mma"] > 0  # bf16 wgmma on the expanded tiles
