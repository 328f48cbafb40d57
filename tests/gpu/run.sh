#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA host without network that has Python with CUDA torch, triton,
# transformers and nvidia-ml-py (see tests/gpu/README.md):
#
#   tests/gpu/run.sh                       # results in ./gpu-results, or $OUT
#
# 1. setup: picks a Python that imports torch ($PYTHON, else python3, else python). If it lacks the project's other
#    dependencies, that Python installs the wheels its version and machine need (tests/gpu/wheels/pins-*.txt,
#    `make gpu-wheels` on a machine with PyPI) offline into tests/gpu/.site ($GPU_SITE), which goes on PYTHONPATH:
#    no venv, so a host Python that is itself a venv, a --user install or conda works as it is. The project runs
#    from the checkout (PYTHONPATH). Then every import the checks need is tried.
# 2. the checks, each under its own cap and all within GPU_CHECK_BUDGET_S (default 470 s), cheap ones first:
#    attention (Triton kernels), quant (the 4/8-bit weight-only matmul), model (parity with transformers), serve
#    (worker and gateway on cuda), partitioner (NVML/MPS, read-only), steptime (decode step time against the HBM
#    floor), and last vllm (a vLLM server as a `launcher: command` replica; skipped, saying why, where vllm does
#    not import; its timeout GPU_CHECK_VLLM_TIMEOUT_S, default 180 s). GPU_CHECK_ONLY="model serve": setup and
#    those checks only; GPU_CHECK_CAP_SCALE=2: every cap and the budget doubled, for a slower machine.
# 3. $OUT/summary.json gathers every result; one verdict line per check, then the exit code is 1 if anything
#    failed.
#
# Each result is one line, `PASS name ...`, `FAIL name ...` or `SKIP name reason` (a check that cannot run here:
# neither passed nor failed); each check's stdout, stderr and JSON lines stay in $OUT. Nothing here changes MIG
# mode, clocks or any other device setting. GPU_CHECK_DEVICE=cpu runs the same checks on tiny shapes on CPU (not
# the partitioner's; vllm's planning and model parts only), to try the script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
start=$(date +%s)
scale=${GPU_CHECK_CAP_SCALE:-1}  # a slower machine (the CPU dry run) multiplies each cap and the budget
budget=$((${GPU_CHECK_BUDGET_S:-470} * scale))
deadline=$((start + budget))
device=${GPU_CHECK_DEVICE:-cuda}
wheels=${GPU_WHEELS:-$root/tests/gpu/wheels}
site=${GPU_SITE:-$root/tests/gpu/.site}
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

install_wheels() {  # the wheels this Python's version and machine need, with the host Python itself, into $site
    local tag pins pip_wheel pip rc
    tag=$("$py" -c 'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}-{platform.machine()}")')
    pins=$wheels/pins-$tag.txt
    if [[ ! -f $pins ]]; then
        local have
        have=$(cd "$wheels" 2>/dev/null && ls pins-*.txt 2>/dev/null | sed 's/^pins-//; s/\.txt$//' | tr '\n' ' ')
        echo "FAIL setup.install no wheels for Python $tag in tests/gpu/wheels (it has: ${have:-nothing});" \
            "run \`make gpu-wheels\` (GPU_PYTHONS, GPU_ARCHS) on a machine with PyPI"
        return 1
    fi
    if "$py" -m pip --version >/dev/null 2>&1; then
        pip=("$py" -m pip)
    else  # no pip on the host (Debian's python3 without python3-pip): pip runs from its wheel
        pip_wheel=$(ls "$wheels"/pip-*.whl 2>/dev/null | head -n 1)
        pip=("$py" "$pip_wheel/pip")
    fi
    rm -rf "$site"
    # --isolated and no config file: the host's pip settings (an index, constraints, find-links) play no part;
    # --no-deps: the pin file is the whole set, resolved by `make gpu-wheels`.
    PIP_CONFIG_FILE=/dev/null timeout 120 "${pip[@]}" install --isolated --disable-pip-version-check --no-input \
        --no-index --find-links "$wheels" --no-deps --target "$site" --no-warn-script-location --quiet -r "$pins" \
        > "$out/install.log" 2>&1
    rc=$?
    if [[ $rc != 0 ]]; then
        echo "FAIL setup.install exit code $rc: $(tail -c 400 "$out/install.log" | tr '\n' ' ')"
        return "$rc"
    fi
    echo '*' > "$site/.gitignore"
    echo "PASS setup.install $(grep -c '==' "$pins") wheels for Python $tag into $site ($(($(date +%s) - t0)) s)"
}

# The host Python as it is, with the missing wheels in a folder on PYTHONPATH: no venv, which would not see a
# host Python's packages when that Python is itself a venv, a --user install or a conda environment.
t0=$(date +%s)
if "$py" tests/gpu/preflight.py --probe 2>/dev/null; then
    echo "PASS setup.install skipped: $py already imports every dependency"
    step install 0 0
else
    install_wheels
    rc=$?
    step install "$rc" "$(($(date +%s) - t0))"
    export PYTHONPATH="$root:$site${PYTHONPATH#"$root"}"
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
    local group=$1 cap=$(($2 * scale)) script=$3 left t rc t0
    if [[ -n ${GPU_CHECK_ONLY:-} && " $GPU_CHECK_ONLY " != *" $group "* ]]; then
        return
    fi
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

# Cheap checks that say the most first, the long step-time table last before vLLM. The caps add up to the budget
# less 60 s, which setup (the install, the first CUDA context) and the slack of each `timeout` take
# (tests/gpu/test_setup.py holds them to it).
run_check attention 65 tests/gpu/check_attention.py
run_check quant 35 tests/gpu/check_quant.py
run_check model 110 tests/gpu/check_model.py
run_check serve 65 tests/gpu/check_serve.py
if [[ $device == cuda ]]; then
    run_check partitioner 50 tests/gpu/check_partitioner.py  # read-only: no MIG, clock or setting changes
fi
run_check steptime 85 tests/gpu/check_steptime.py
# last: vLLM's start-up is the longest wait here, and a slow one must not take the other checks' time
run_check vllm "${GPU_CHECK_VLLM_TIMEOUT_S:-180}" tests/gpu/check_vllm.py
finish
