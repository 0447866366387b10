"""Smoke test of benchmarks/train_step.py: `--quick` runs the bf16 and mxfp8 variants end to end,
prints ratios that agree with its step times, and profiles each variant with `--profile`; a GPU
asked for where there is none is refused with a message saying what to do."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "train_step.py"
VARIANTS = ("bf16 (inductor)", "mxfp8", "mxfp8, attention off")


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_train_step_quick_with_profiles() -> None:
    result = _run("--quick", "--no-torchao", "--no-fp32", "--profile", "3", "--kernel-names", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    rows = {}
    for line in out.splitlines():
        for name in VARIANTS:
            rest = line[len(name):].split() if line.startswith(name) else []
            if rest and rest[0].replace(".", "", 1).isdigit():
                rows[name] = (float(rest[0]), float(rest[1].rstrip("x")))
    assert set(rows) == set(VARIANTS), out
    bf16_ms = rows["bf16 (inductor)"][0]
    for name, (step_ms, ratio) in rows.items():
        # The table prints milliseconds to 0.1 (each off by up to 0.05) and the unrounded
        # ratio to 0.01 (off by up to 0.005): the bound that rounding alone allows.
        rounding = 0.005 + ratio * (0.05 / step_ms + 0.05 / bf16_ms)
        assert ratio == pytest.approx(step_ms / bf16_ms, abs=rounding), (name, out)
    for name in VARIANTS:
        assert f"{name}: one step, operators by self_cpu_time_total" in out, out
        # --kernel-names: Inductor's C++ kernels are profiled by name and totalled.
        total = re.search(rf"^{re.escape(name)}: Inductor's generated C\+\+ kernels, (\d+) distinct, ([\d.]+) ms",
                          out, re.MULTILINE)
        assert total and int(total.group(1)) > 0 and float(total.group(2)) > 0, (name, out)


def test_kernel_names_without_profile_is_refused() -> None:
    result = _run("--kernel-names", timeout=120)
    assert result.returncode == 2
    assert "give --profile N too" in result.stderr, result.stderr


def test_device_cuda_without_a_gpu_is_refused_with_the_fix() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    result = _run("--device", "cuda", timeout=120)
    assert result.returncode == 2
    assert "no CUDA GPU is visible" in result.stderr and "--device cpu" in result.stderr, result.stderr
