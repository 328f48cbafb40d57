#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA host without network that has Python with CUDA torch, triton,
# transformers and nvidia-ml-py (see tests/gpu/README.md):
#
#   tests/gpu/run.sh                       # results in ./gpu-results, or $OUT
#
# 1. setup: picks a Python that imports torch ($PYTHON, else python3, else python). If it lacks the project's other
#    dependencies, makes tests/gpu/.venv (--system-site-packages, so the host's torch/triton/transformers serve)
#    and installs them offline from tests/gpu/wheels (`make gpu-wheels` on a machine with PyPI). The project runs
#    from the checkout (PYTHONPATH). Then every import the checks need is tried.
# 2. the checks, each under its own timeout and all within GPU_CHECK_BUDGET_S (default 470 s): attention (Triton
#    kernels), model (parity with transformers), serve (worker and gateway on cuda), steptime (decode step time
#    against the HBM floor), quant (the 4/8-bit weight-only matmul), partitioner (NVML/MPS, read-only), and last
#    vllm (a vLLM server as a `launcher: command` replica; skipped, saying why, where vllm does not import; its
#    timeout GPU_CHECK_VLLM_TIMEOUT_S, default 180 s).
# 3. $OUT/summary.json gathers every result; the exit code is 1 if anything failed.
#
# Each result is one line, `PASS name ...`, `FAIL name ...` or `SKIP name reason` (a check that cannot run here:
# neither passed nor failed); each check's stdout, stderr and JSON lines stay in $OUT. Nothing here changes MIG
# mode, clocks or any other device setting. GPU_CHECK_DEVICE=cpu runs the same checks on tiny shapes on CPU (not
# the partitioner's; vllm's planning and model parts only), to try the script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-470}
deadline=$((start + budget))
device=${GPU_CHECK_DEVICE:-cuda}
wheels=$root/tests/gpu/wheels
venv=${GPU_VENV:-$root/tests/gpu/.venv}
out=${OUT:-gpu-results}
mkdir -p "$out" && out=$(cd "$out" && pwd)
rm -f "$out"/*.jsonl "$out"/*.out "$out"/*.stderr "$out/summary.json" "$out/environment.json"

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if [[ $device == cuda ]]; then export TRITON_INTERPRET=0; fi

step() {  # record a setup step: group, exit code, seconds
    echo "{\"group\": \"$1\", \"rc\": $2, \"duration_s\": $3}" >> "$out/groups.jsonl"
}

finish() {
    "$py" tests/gpu/summarize.py --out "$out" --device "$device" --budget-s "$budget" \
        --duration-s "$(($(date +%s) - start))"
    exit $?
}

# --- setup ---------------------------------------------------------------------------------------------------
host_py=
for candidate in ${PYTHON:-} python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
        host_py=$(command -v "$candidate")
        break
    fi
done
if [[ -z $host_py ]]; then
    echo "FAIL setup.python no python3/python here imports torch (set PYTHON=/path/to/python)"
    echo '{"ok": false, "device": "'"$device"'", "passed": 0, "failed": ["setup.python"], "results": []}' \
        > "$out/summary.json"
    exit 1
fi
py=$host_py

if [[ $device == cuda ]]; then
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,mig.mode.current --format=csv \
        > "$out/device.csv" 2> "$out/nvidia-smi.stderr" && cat "$out/device.csv"
fi

t0=$(date +%s)
if "$py" tests/gpu/preflight.py --probe 2>/dev/null; then
    echo "PASS setup.install skipped: $py already imports every dependency"
    step install 0 0
else
    if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        rm -rf "$venv"
        # ensurepip may be missing (Debian's python3 without python3-venv): then a venv without pip, and pip
        # itself from the wheel folder.
        "$host_py" -m venv --system-site-packages "$venv" > "$out/install.log" 2>&1 \
            || "$host_py" -m venv --system-site-packages --without-pip "$venv" >> "$out/install.log" 2>&1
    fi
    py=$venv/bin/python
    if "$py" -m pip --version >/dev/null 2>&1; then
        pip=("$py" -m pip)
    else
        pip_wheel=$(ls "$wheels"/pip-*.whl 2>/dev/null | head -n 1)
        pip=("$py" "$pip_wheel/pip")
    fi
    rc=1
    if [[ -f $wheels/requirements.txt ]]; then
        timeout 60 "${pip[@]}" install --no-index --find-links "$wheels" --no-warn-script-location --quiet \
            -r "$wheels/requirements.txt" >> "$out/install.log" 2>&1
        rc=$?
    else
        echo "no $wheels/requirements.txt: run \`make gpu-wheels\` on a machine with PyPI first" >> "$out/install.log"
    fi
    if [[ $rc == 0 ]]; then
        echo "PASS setup.install offline from tests/gpu/wheels into $venv ($(($(date +%s) - t0)) s)"
    else
        echo "FAIL setup.install exit code $rc: $(tail -c 400 "$out/install.log" | tr '\n' ' ')"
    fi
    step install "$rc" "$(($(date +%s) - t0))"
fi

t0=$(date +%s)
timeout 60 "$py" tests/gpu/preflight.py --device "$device" --out "$out" 2> "$out/setup.stderr"
rc=$?
step setup "$rc" "$(($(date +%s) - t0))"
if [[ $rc != 0 ]]; then
    finish
fi

# --- checks --------------------------------------------------------------------------------------------------
run_check() {  # group, cap in seconds, script: run it under min(cap, time left), which it reads from
               # GPU_CHECK_TIMEOUT_S; record how it ended
    local group=$1 cap=$2 script=$3 left t rc t0
    left=$((deadline - $(date +%s)))
    t=$((cap < left ? cap : left))
    if ((t < 20)); then
        echo "FAIL $group.exit not run: no time left in the ${budget} s budget"
        echo "{\"group\": \"$group\", \"rc\": 125, \"duration_s\": 0, \"timeout_s\": $t}" >> "$out/groups.jsonl"
        return
    fi
    t0=$(date +%s)
    GPU_CHECK_TIMEOUT_S=$t timeout -k 10 "$t" "$py" "$script" --device "$device" --out "$out" \
        2> "$out/$group.stderr" \
        | tee "$out/$group.out"
    rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        echo "FAIL $group.exit timed out after $t s (its results so far are kept)"
    elif ((rc != 0)) && ! grep -q '^FAIL ' "$out/$group.out"; then
        echo "FAIL $group.exit exit code $rc: $(tail -c 400 "$out/$group.stderr" | tr '\n' ' ')"
    fi
    echo "{\"group\": \"$group\", \"rc\": $rc, \"duration_s\": $(($(date +%s) - t0)), \"timeout_s\": $t}" \
        >> "$out/groups.jsonl"
}

run_check attention 70 tests/gpu/check_attention.py
run_check model 120 tests/gpu/check_model.py
run_check serve 80 tests/gpu/check_serve.py
run_check steptime 90 tests/gpu/check_steptime.py
run_check quant 40 tests/gpu/check_quant.py
if [[ $device == cuda ]]; then
    run_check partitioner 70 tests/gpu/check_partitioner.py  # read-only: no MIG, clock or setting changes
fi
# last: vLLM's start-up is the longest wait here, and a slow one must not take the other checks' time
run_check vllm "${GPU_CHECK_VLLM_TIMEOUT_S:-180}" tests/gpu/check_vllm.py
finish
