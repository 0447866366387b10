"""Device profiles: datasheet numbers with sources, validation, and the cached CPU measurement."""

from __future__ import annotations

import json

import pytest

from mxcompile.cost import profiles
from mxcompile.cost.profiles import B200, H100_SXM, H200, PROFILES, DeviceProfile, get_profile, measure_cpu_profile


def test_datasheet_numbers():
    assert H100_SXM.flops("bf16") == pytest.approx(989e12, rel=0.01)
    assert H100_SXM.flops("fp8") == pytest.approx(1979e12, rel=0.01)
    assert H100_SXM.memory_bandwidth == pytest.approx(3.35e12)
    assert H100_SXM.host_link_bandwidth == pytest.approx(64e9)
    assert H200.flops("bf16") == H100_SXM.flops("bf16")  # same GH100 compute
    assert H200.memory_bandwidth == pytest.approx(4.8e12)
    assert B200.flops("fp8") == pytest.approx(4.5e15)
    assert B200.flops("bf16") == pytest.approx(2.25e15)
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


@pytest.fixture
def quick_measurement(monkeypatch):
    monkeypatch.setattr(profiles, "CPU_WARMUP_S", 0.0)
    monkeypatch.setattr(profiles, "CPU_MIN_MEASURE_S", 0.0)
    monkeypatch.setattr(profiles, "CPU_MATMUL_SIZE", 64)
    monkeypatch.setattr(profiles, "CPU_COPY_BYTES", 2**20)
    monkeypatch.setattr(profiles, "CPU_LLC_COPIES", 0)
    monkeypatch.setattr(profiles, "CPU_ATTENTION_SHAPE", (1, 1, 32, 32))
    # The compiled quantize's rate needs an Inductor compile in a child (tests/cost/test_graph_costs.py
    # does not time anything); here only the caching is under test.
    monkeypatch.setattr(profiles, "_compiled_quantize_rate", lambda: 1.0)


def test_cpu_profile_measured_once_and_cached(tmp_path, monkeypatch, quick_measurement):
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path / "cache"))  # set after import: read at call time
    profile = measure_cpu_profile()
    path = tmp_path / "cache" / "cpu_profile.json"
    assert path.is_file()
    assert profile.flops("fp8") == profile.flops("bf16")
    assert "no FP8 arithmetic" in profile.sources["peak_flops.fp8"]
    assert all(value > 0 for value in profile.peak_flops.values())

    def refuse():
        raise AssertionError("measured again despite a valid cache")

    monkeypatch.setattr(profiles, "_measure_cpu", refuse)
    assert measure_cpu_profile() == profile
    with pytest.raises(AssertionError, match="measured again"):
        measure_cpu_profile(refresh=True)


def test_cpu_profile_stale_or_broken_cache_is_remeasured(tmp_path, monkeypatch, quick_measurement):
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path))
    path = tmp_path / "cpu_profile.json"
    path.write_text("{not json")
    first = measure_cpu_profile()
    data = json.loads(path.read_text())
    data["fingerprint"]["torch"] = "0.0"
    path.write_text(json.dumps(data))
    second = measure_cpu_profile()
    assert json.loads(path.read_text())["fingerprint"]["torch"] != "0.0"
    assert first.name == second.name
    # A profile measured on a CPU with another instruction set (e.g. AVX512-BF16, where bf16
    # GEMMs run 100x faster than on AVX2) is not reused.
    data = json.loads(path.read_text())
    data["fingerprint"]["cpu_capability"] = "OTHER"
    data["profile"]["peak_flops"]["bf16"] = 1e30
    path.write_text(json.dumps(data))
    third = measure_cpu_profile()
    assert third.flops("bf16") < 1e30
    assert json.loads(path.read_text())["fingerprint"]["cpu_capability"] != "OTHER"


def test_cpu_profile_prices_mx_ops_as_measured(tmp_path, monkeypatch, quick_measurement):
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path))
    profile = measure_cpu_profile()
    assert not profile.native_fp8_gemm
    assert set(profile.op_rates) == set(profiles.OP_RATE_KEYS)
    assert "mxcompile::attention" in profile.sources["op_rates.attention"]
    assert DeviceProfile.from_dict(json.loads((tmp_path / "cpu_profile.json").read_text())["profile"]) == profile


def test_copy_outgrows_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(profiles, "llc_bytes", lambda: 64 * 2**20)
    assert profiles.copy_bytes() == profiles.CPU_LLC_COPIES * 64 * 2**20
    monkeypatch.setattr(profiles, "llc_bytes", lambda: 0)
    assert profiles.copy_bytes() == profiles.CPU_COPY_BYTES


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("MXCOMPILE_CACHE_DIR", raising=False)
    assert str(profiles.cache_dir()).endswith(".cache/mxcompile")
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path))
    assert profiles.cache_dir() == tmp_path


def test_compiled_quantize_rate_runs_in_a_child():
    """The child compiles and times the Inductor quantize (one small compile); a failure there
    would surface as an error here, not as a made-up rate."""
    rate = profiles._compiled_quantize_rate()
    assert 0 < rate < float("inf")
