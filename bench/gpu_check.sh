#!/usr/bin/env bash
# The one prepared device run: GPU-marked tests + the CUDA attention benchmarks.
# Needs numpy, cupy-cuda12x, pytest, hypothesis, ml_dtypes importable (on a machine without
# package access, carry wheels and set PYTHONPATH first). Results go under ${OUT:-bench/out}.
#   gpu-tests.txt        every gpu-marked test, one line each (tests/kernels/cuda/test_cuda_attention.py:
#                        f32/fp8 rows; tests/kernels/cuda/test_cuda_tq_sparse_attention.py: v3 int4 rows,
#                        sparse DSA attention, the tiny GLM on the device)
#   attention.txt        bench.attention (CPU fp8 vs f32, CUDA fp8 bandwidth)
#   cuda_paths.txt       bench.cuda_paths (int4 vs fp8 dense decode, sparse k=2048 vs dense)
# QUICK=1 runs bench.cuda_paths with --quick (T = 32k). Exit status: non-zero when any step failed
# (every step still runs).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
PYTHONUNBUFFERED=1 "$py" -m pytest -v -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu-tests.txt" || status=1
PYTHONUNBUFFERED=1 "$py" -m bench.attention --json 2>&1 | tee "$out/attention.txt" || status=1
PYTHONUNBUFFERED=1 "$py" -m bench.cuda_paths ${QUICK:+--quick} --json 2>&1 | tee "$out/cuda_paths.txt" || status=1
exit "$status"
