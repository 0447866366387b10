"""mxcompile.measure.memory and .fresh_process: the peak resident set and the tensor-storage
peak of one step, in this process and in a fresh one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mxcompile.measure import memory
from mxcompile.measure.fresh_process import measure_step_peak
from mxcompile.measure.memory import PeakRssUnavailable, rss_peak, tensor_peak_bytes

MIB = 2**20
STEP_BYTES = 32 * MIB
RSS_NOISE_BYTES = 2 * MIB
TESTS_DIR = Path(__file__).resolve().parent


def test_tensor_peak_bytes_counts_what_the_step_holds_at_once() -> None:
    def step() -> None:
        first = torch.ones(STEP_BYTES // 4)
        second = torch.ones(STEP_BYTES // 4)  # both alive: the peak is twice the buffer
        del first, second
        third = torch.ones(STEP_BYTES // 4)  # after the peak: not added to it
        del third

    assert tensor_peak_bytes(step) == 2 * STEP_BYTES


def test_rss_peak_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unwritable = tmp_path / "no-such-dir" / "clear_refs"
    monkeypatch.setattr(memory, "PROC_CLEAR_REFS", unwritable)
    with pytest.raises(PeakRssUnavailable, match="clear_refs cannot be written"):
        rss_peak(lambda: None)


def test_fresh_process_measures_the_step_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable here: VmHWM cannot be reset")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    peak = measure_step_peak("peak_factories:allocate_step", factory_kwargs={"nbytes": STEP_BYTES})
    assert peak.device == "cpu"
    assert peak.tensor_peak_bytes == STEP_BYTES
    # The resident set grows by the buffer (every page touched). It is counted in pages and the
    # rest of the process moves too (pages freed or first touched during the step): seen 124 KiB
    # below the buffer here, so allow RSS_NOISE_BYTES either way.
    assert abs(peak.step_peak_bytes - STEP_BYTES) <= RSS_NOISE_BYTES


def test_fresh_process_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="factory="):
        measure_step_peak("no_colon")
    with pytest.raises(ValueError, match="device="):
        measure_step_peak("peak_factories:allocate_step", device="tpu")
    with pytest.raises(ValueError, match="warmup_steps="):
        measure_step_peak("peak_factories:allocate_step", warmup_steps=0)
