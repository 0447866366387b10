"""Device profiles: datasheet numbers with sources, and validation naming the field."""

from __future__ import annotations

import pytest

from mxcompile.cost.profiles import B200, H100_SXM, H200, PROFILES, DeviceProfile, get_profile


def test_datasheet_numbers():
    assert H100_SXM.flops("bf16") == pytest.approx(989e12, rel=0.01)
    assert H100_SXM.flops("fp8") == pytest.approx(1979e12, rel=0.01)
    assert H100_SXM.memory_bandwidth == pytest.approx(3.35e12)
    assert H100_SXM.host_link_bandwidth == pytest.approx(64e9)
    assert H200.flops("bf16") == H100_SXM.flops("bf16")  # same GH100 compute
    assert H200.memory_bandwidth == pytest.approx(4.8e12)
    assert B200.flops("fp8") == pytest.approx(4.5e15)
    assert B200.flops("bf16") == pytest.approx(2.25e15)
    assert B200.flops("fp4") == pytest.approx(9e15)  # dense FP4 is twice FP8 (18 PFLOPS with sparsity)
    for profile in PROFILES.values():
        assert profile.flops("fp8") == pytest.approx(2 * profile.flops("bf16"))
        assert profile.flops("fp32") < profile.flops("bf16")
        for key, source in profile.sources.items():
            assert "datasheet" in source, key
    assert get_profile("H200 SXM") is H200
    with pytest.raises(KeyError, match="known"):
        get_profile("A100")


def test_profiles_are_immutable():
    with pytest.raises(TypeError):
        H100_SXM.peak_flops["bf16"] = 1.0
    with pytest.raises(AttributeError):
        H100_SXM.memory_bandwidth = 1.0


def _profile(**changes) -> DeviceProfile:
    fields = dict(
        name="X",
        peak_flops={"fp32": 1.0, "bf16": 2.0, "fp8": 4.0},
        memory_bandwidth=1.0,
        host_link_bandwidth=1.0,
        sources={"peak_flops.fp32": "a", "peak_flops.bf16": "b", "peak_flops.fp8": "c",
                 "memory_bandwidth": "d", "host_link_bandwidth": "e"},
    )
    fields.update(changes)
    return DeviceProfile(**fields)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(name=""), "DeviceProfile.name"),
        (dict(peak_flops={"fp32": 1.0, "bf16": 2.0}), "lacks ['fp8']"),
        (dict(peak_flops={"fp32": 1.0, "bf16": -2.0, "fp8": 4.0}), "peak_flops['bf16']"),
        (dict(memory_bandwidth=0.0), "memory_bandwidth"),
        (dict(host_link_bandwidth=float("inf")), "host_link_bandwidth"),
        (dict(sources={"peak_flops.fp32": "a"}), "sources lacks"),
    ],
)
def test_profile_errors_name_the_field(changes, expected):
    with pytest.raises(ValueError) as info:
        _profile(**changes)
    assert expected in str(info.value)
