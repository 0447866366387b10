"""One torchrun launch (every scenario of worker.py, eager lowering) shared by the test files
of this folder: launches are the expensive part. `launch_workers` runs worker.py under
torchrun on NPROC (or `nproc`) gloo processes and reads its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

WORKER = Path(__file__).with_name("worker.py")
NPROC = 2
LAUNCH_TIMEOUT_S = 1200
ROOT = Path(__file__).resolve().parents[2]


def launch(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, nproc: int = NPROC) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(name) / "results.json"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), "--out", str(out), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"torchrun failed with exit code {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def launch_workers(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    return lambda name, *args, nproc=NPROC: launch(tmp_path_factory, name, *args, nproc=nproc)


@pytest.fixture(scope="session")
def results(launch_workers) -> dict[str, Any]:
    return launch_workers("eager", "--lowering", "eager")
