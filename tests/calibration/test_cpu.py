"""The measured CPU profile: measured once and cached per machine fingerprint, the MX ops'
rates, the DRAM copy size, the cache directory."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from mxcompile.calibration import cpu
from mxcompile.calibration.cpu import measure_cpu_profile
from mxcompile.cost.profiles import (ATTENTION_PASS_RATE, ATTENTION_RATE, DEQUANTIZE_FP4_RATE, DEQUANTIZE_RATE,
                                     OP_RATE_KEYS, QUANTIZE_FP4_RATE, QUANTIZE_RATE, DeviceProfile)


@pytest.fixture
def quick_measurement(monkeypatch):
    monkeypatch.setattr(cpu, "CPU_WARMUP_S", 0.0)
    monkeypatch.setattr(cpu, "CPU_MIN_MEASURE_S", 0.0)
    monkeypatch.setattr(cpu, "CPU_MATMUL_SIZE", 64)
    monkeypatch.setattr(cpu, "CPU_COPY_BYTES", 2**20)
    monkeypatch.setattr(cpu, "CPU_LLC_COPIES", 0)
    monkeypatch.setattr(cpu, "CPU_ATTENTION_SHAPE", (2, 1, 32, 32))
    monkeypatch.setattr(cpu, "CPU_FP4_SHAPE", (32, 64))
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
    # The pass rate is omitted where one-element chunks measured no slower.
    measured = {QUANTIZE_RATE, ATTENTION_RATE, DEQUANTIZE_RATE, QUANTIZE_FP4_RATE, DEQUANTIZE_FP4_RATE}
    assert measured <= set(profile.op_rates) <= set(OP_RATE_KEYS)
    assert "mxcompile::attention" in profile.sources["op_rates.attention"]
    assert "mxcompile::quantize_fp4" in profile.sources[f"op_rates.{QUANTIZE_FP4_RATE}"]
    assert "dequantize_along" in profile.sources[f"op_rates.{DEQUANTIZE_RATE}"]
    assert DeviceProfile.from_dict(json.loads((tmp_path / "cpu_profile.json").read_text())["profile"]) == profile


def test_cpu_profile_times_real_tensors_under_the_compiles_fake_mode(tmp_path, monkeypatch, quick_measurement):
    """The backend measures the profile while compiling, inside the graph's FakeTensorMode.
    Every timed call must still run on real tensors with no dispatch mode active (under the
    fake mode a 1.2 GB copy timed at 28 TB/s)."""
    monkeypatch.setenv("MXCOMPILE_CACHE_DIR", str(tmp_path))
    timed = []

    def best_time(fn):
        assert not _get_current_dispatch_mode_stack(), "a dispatch mode is active while timing"
        with torch.profiler.profile() as prof:
            fn()
        timed.append({event.key for event in prof.key_averages()})
        return 1e-3

    monkeypatch.setattr(cpu, "_best_time", best_time)
    with FakeTensorMode():
        measure_cpu_profile()
    ran = set().union(*timed)
    assert {"aten::mm", "aten::copy_", "mxcompile::attention"} <= ran


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


def test_attention_rates_split_flops_from_passes(monkeypatch):
    """On a clock where the attention ops take FLOPs at a fixed rate plus a fixed time per pass
    (key tile of a batch chunk), the calibration recovers both rates."""
    flop_rate, pass_s = 5e9, 2e-4
    monkeypatch.setattr(cpu, "CPU_ATTENTION_SHAPE", (4, 2, 64, 32))
    batch, heads, seq, width = cpu.CPU_ATTENTION_SHAPE
    tiles = -(-seq // cpu.default_key_tile(cpu.MXConfig().block_size))
    clock = [0.0]

    def timed_op(backward):
        def op(*args):
            q = args[1] if backward else args[0]
            chunk = args[-1]
            flops = cpu.attention_flops(batch, heads, seq, seq, width, width, backward=backward)
            clock[0] += flops / flop_rate + -(-batch // chunk) * tiles * pass_s
            if backward:
                return q, q, q
            return q, q.new_zeros(q.shape[:3])
        return op

    def best_over_threads(fn):
        start = clock[0]
        fn()
        return clock[0] - start

    monkeypatch.setattr(cpu, "ATTENTION", timed_op(False))
    monkeypatch.setattr(cpu, "ATTENTION_BACKWARD", timed_op(True))
    monkeypatch.setattr(cpu, "_best_over_threads", best_over_threads)
    rates = cpu._attention_rates()
    assert rates[ATTENTION_RATE] == pytest.approx(flop_rate)
    assert rates[ATTENTION_PASS_RATE] == pytest.approx(1 / pass_s)


def test_attention_calibration_times_halving_chunks_and_fits_the_pass_time_over_all():
    assert cpu.attention_calibration_chunks(8) == [8, 4, 2, 1]
    assert cpu.attention_calibration_chunks(5) == [5, 3, 2, 1]
    assert cpu.attention_calibration_chunks(1) == [1]
    # Times measured on the 2-core host (fwd + bwd, chunks 8, 4, 2, 1: 1, 2, 4, 8 passes per
    # op): the slope over all four, by hand: sum of (x - 3.75)(y - 11.435) over sum of (x - 3.75)^2 = 17.795 / 28.75.
    passes, times_ms = [1, 2, 4, 8], [11.06, 9.51, 10.53, 14.64]
    assert cpu._slope(passes, times_ms) == pytest.approx(17.795 / 28.75)
