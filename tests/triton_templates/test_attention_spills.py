"""The MX attention kernels compiled ahead of time for sm90 at head_dim 128, causal, with the
configs the static report chooses there (`benchmarks/results/kernel_static.json`, sm90
head_dim_128): no register spills. Head_dim 128 on sm90 is where every backward config spilled
while the kernels quantized their tiles themselves; the report covers sm90/sm100, head_dim
64/128, causal and not."""

from __future__ import annotations

import pytest

from mxcompile.triton_templates.kernel_static import compile_static, launchers

# label -> (tiles, num_warps, num_stages): the static report's sm90 head_dim-128 choices.
CHOSEN_SM90_D128 = {
    "mx_attention_fwd": ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
    "mx_attention_dkdv": ({"BLOCK_M": 32, "BLOCK_N": 128}, 8, 3),
    "mx_attention_dq": ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
}


@pytest.mark.slow  # ~5-10 s per kernel on 2 cores
@pytest.mark.parametrize("label", sorted(CHOSEN_SM90_D128))
def test_chosen_configs_spill_nothing_sm90_d128_causal(label: str) -> None:
    kernel_name, launch = launchers(128, causal=True)[label]
    tiles, warps, stages = CHOSEN_SM90_D128[label]
    static = compile_static(launch, kernel_name, tiles, 90, warps, stages)
    assert static.spill_bytes == 0, static.registers
    assert static.loop_classes is not None and static.loop_classes["local"] == 0
    assert static.loop_classes["mma"] > 0  # bf16 wgmma on the expanded tiles
