#!/usr/bin/env bash
# The GPU figures in one run of at most 10 minutes on ONE NVIDIA GPU (H100/H200 class), from the
# repository root after `pip install -e '.[gpu,test]'`:
#
#   bash tools/gpu_check.sh            # every step; gpu_check.json in $OUT (or here)
#   bash tools/gpu_check.sh --plan     # the steps, their budgets and the sum; touches no GPU
#
# The steps, their budgets and what they measure live in tools/gpu_check.py (STEPS), which this
# script runs; see its docstring. Without CUDA it prints one line and exits 2.
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/gpu_check.py" "$@"
