#!/usr/bin/env bash
# The one prepared device run for issue 3: GPU-marked tests + the CUDA attention benchmark.
# Needs numpy, cupy-cuda12x, pytest, hypothesis, ml_dtypes importable (on a machine without
# package access, carry wheels and set PYTHONPATH first). Results go under ${OUT:-bench/out}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
PYTHONUNBUFFERED=1 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu-tests.txt"
PYTHONUNBUFFERED=1 "$py" -m bench.attention --json 2>&1 | tee "$out/attention.txt"
