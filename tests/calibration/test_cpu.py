"""The measured CPU profile: measured once and cached per machine fingerprint, the MX ops'
rates, the DRAM copy size, the cache directory."""

import json

import pytest

from mxcompile.calibration import cpu
from mxcompile.calibration.cpu import measure_cpu_profile
from mxcompile.cost.profiles import OP_RATE_KEYS, DeviceProfile


@pytest.fixture
def quick_measurement(monkeypatch):
    monkeypatch.setattr(cpu, "CPU_WARMUP_S", 0.0)
    monkeypatch.setattr(cpu, "CPU_MIN_MEASURE_S", 0.0)
    monkeypatch.setattr(cpu, "CPU_MATMUL_SIZE", 64)
    monkeypatch.setattr(cpu, "CPU_COPY_BYTES", 2**20)
    monkeypatch.setattr(cpu, "CPU_LLC_COPIES", 0)
    monkeypatch.setattr(cpu, "CPU_ATTENTION_SHAPE", (1, 1, 32, 32))
    # The compiled quantize's rate needs an Inductor compile in a child process (tested once,
    # below); here only the caching is under test.
    monkeypatch.setattr(cpu, "_compiled_quantize_rate", lambda: 1.0)


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

    monkeypatch.setattr(cpu, "_measure_cpu", refuse)
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
    assert set(profile.op_rates) == set(OP_RATE_KEYS)
    assert "mxcompile::attention" in profile.sources["op_rates.attention"]
    assert DeviceProfile.from_dict(json.loads((tmp_path / "cpu_profile.json").read_text())["profile"]) == profile


def test_copy_outgrows_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(cpu, "llc_bytes", lambda: 64 * 2**20)
    assert cpu.copy_bytes() == cpu.CPU_LLC_COPIES * 64 * 2**20
    monkeypatch.setattr(cpu, "llc_bytes", lambda: 0)
    assert cpu.copy_bytes() == cpu.CPU_COPY_BYTES


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("MXCOMPILE_CACHE_DIR", raising=False)
    assert str(cpu.cache_dir()).endswith(".cache/mxcompile")
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path))
    assert cpu.cache_dir() == tmp_path


def test_compiled_quantize_rate_runs_in_a_child():
    """The child compiles and times the Inductor quantize (one small compile); a failure there
    would surface as an error here, not as a made-up rate."""
    rate = cpu._compiled_quantize_rate()
    assert 0 < rate < float("inf")
