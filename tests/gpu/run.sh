#!/usr/bin/env bash
# The GPU-only checks, one run of well under 10 minutes on a CUDA machine that has torch and triton.
# No install step: run from the checkout. Results go to $OUT (or ./gpu-results).
# It reads the device and never changes MIG mode, clocks or other settings.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,mig.mode.current --format=csv | tee "$out/device.csv"
status=0
timeout 480 python tests/gpu/check_attention.py 2>&1 | tee "$out/attention.jsonl" || status=1
exit $status
