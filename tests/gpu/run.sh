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
# Budget: partitioner 150 s + attention 420 s + nvidia-smi keeps the whole run under 10 minutes.
# The partitioner checks are read-only: no MIG mode, clock or setting changes, no MIG devices created.
timeout 150 python tests/gpu/check_partitioner.py 2>&1 | tee "$out/partitioner.jsonl" || status=1
timeout 420 python tests/gpu/check_attention.py 2>&1 | tee "$out/attention.jsonl" || status=1
exit $status
