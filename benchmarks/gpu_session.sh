#!/usr/bin/env bash
# Every GPU measurement of the project in one short run, for a lent GPU machine whose Python
# already has torch and Triton (nothing is downloaded): the environment, `mxcompile doctor`, the
# GPU-only tests (compiled CUDA graphs), the kernel checks and benchmarks (gpu_kernels.py), and
# the training step against Inductor's bf16 (train_step.py --device cuda). Each part has its own
# time limit, so one that hangs or fails leaves the others' figures; logs go to the folder given
# (default benchmarks/results/gpu). All parts together take about 9 minutes on an H200, within
# one 600 s call of a lent machine only without `kernels`; name the parts to run a subset.
#
#     benchmarks/gpu_session.sh [OUT_DIR [PART...]]     PART: doctor tests kernels train_step
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu}"
shift $(( $# > 0 ? 1 : 0 ))
parts="${*:-doctor tests kernels train_step}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local code=$?
    echo "== $name: exit $code after $((SECONDS - started)) s (limit $limit s)" | tee -a "$out/summary.log"
}
wanted() { [[ " $parts " == *" $1 "* ]]; }

{ nvidia-smi -L; $python -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee "$out/summary.log"
# The mxfp8 backend is found through its torch_dynamo_backends entry point: install in place.
part install 60 $python -m pip install --no-deps --no-build-isolation --no-index -e .
wanted doctor && part doctor 60 $python -m mxcompile.cli.main doctor
if wanted tests; then
    if $python -c 'import pytest' 2>/dev/null; then  # the project's addopts need xdist: not here
        part tests 150 $python -m pytest -q -o addopts="--import-mode=importlib -p no:cacheprovider" \
            -o pythonpath=tests tests/backend/test_cuda_compile.py
    else
        echo "== tests: pytest is not installed here; skipped" | tee -a "$out/summary.log"
    fi
fi
wanted kernels && part gpu_kernels 290 $python benchmarks/gpu_kernels.py --check --sizes 4096 8192
wanted train_step && part train_step 330 $python benchmarks/train_step.py --device cuda --no-torchao --no-fp32 \
    --d-model 2048 --heads 16 --layers 2 --seq 1024 --batch 8 --warmup 2 --steps 10 --rounds 3 --profile 12
for name in doctor tests gpu_kernels; do
    [[ -f "$out/$name.log" ]] && { echo "----- $name"; tail -n 45 "$out/$name.log"; }
done
if [[ -f "$out/train_step.log" ]]; then
    echo "----- train_step (the profiles are in $out/train_step.log)"
    grep -B1 -A6 "^variant" "$out/train_step.log"
fi
