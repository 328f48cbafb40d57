"""GPU-only, read-only checks of the partitioner: one PASS/FAIL line per check on stdout, the details as JSON lines
in `$OUT/partitioner.jsonl`, exit 1 if any failed.

1. NVML inventory (`partition status --json`) against `nvidia-smi`: name, UUID, memory, MIG mode, processes.
2. MIG profiles read through NVML against the shipped table for this GPU (partitioner/inventories/*.json), and
   every GPU-instance profile id probed: only NotSupported / InvalidArgument / NotFound may refuse one.
3. `partition plan` against the real device (a MIG registry with an MPS fallback, and the default registry):
   exits 0 or 1 cleanly; MIG mode is the same before and after.
4. MPS: a control daemon of our own (temporary pipe and log directories), seen by `partition status`; two
   clients at 30 % / 70 % active thread percentage, alone and together, and their achieved matmul throughput;
   `quit` stops it. Skipped when an MPS daemon already runs on the host.

It never changes MIG mode, clocks, compute mode or any other device setting, and never creates MIG devices
(the applier's MIG path is exercised only against fakes). Run from the checkout: `PYTHONPATH=. python ...`.
There is no `--device cpu` dry run: without NVML and nvidia-smi there is nothing to check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.gpu.common import Reporter, fmt, parse_args

CLI = [sys.executable, "-m", "multiserve", "partition"]
MIB = 1 << 20
REP: Reporter


def report(check: str, ok: bool, summary: str = "", **data: object) -> None:
    REP.report(check, ok, summary, **data)


def sh(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 60, stdin: str | None = None,
       ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, input=stdin, check=False,
                          env={**os.environ, **(env or {})})


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    out = sh(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"]).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def status(env: dict[str, str] | None = None) -> dict:
    done = sh([*CLI, "status", "--json"], env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def mig_modes() -> list[str]:
    return [row[0] for row in smi("mig.mode.current,mig.mode.pending")]


def check_inventory() -> None:
    data = status()
    rows = smi("index,name,uuid,memory.total,mig.mode.current,mig.mode.pending")
    ours = [[str(d["index"]), d["name"], d["uuid"], str(d["memory_total_bytes"] // MIB),
             _mode(d["mig_mode"]), _mode(d["mig_mode_pending"])] for d in data["devices"]]
    pids_smi = sorted(int(r[0]) for r in smi("pid", "compute-apps") if r and r[0].isdigit())
    pids_ours = sorted(p["pid"] for d in data["devices"] for p in d["processes"])
    ok = data["source"] == "nvml" and ours == rows and pids_smi == pids_ours
    report("nvml_inventory_vs_nvidia_smi", ok, fmt(devices=len(ours), pids=len(pids_ours)), ours=ours,
           nvidia_smi=rows, pids_ours=pids_ours, pids_smi=pids_smi,
           note=data.get("note"))


def _mode(value: bool | None) -> str:
    return "[N/A]" if value is None else "Enabled" if value else "Disabled"


def check_mig_profiles() -> None:
    from partitioner.devices.catalog import known_mig_profiles
    from partitioner.devices.nvml_backend import NvmlBackend
    from partitioner.devices.read import read_inventory

    inventory = read_inventory(NvmlBackend())
    for gpu in inventory.devices:
        shipped, where = known_mig_profiles(gpu)
        if not gpu.mig_capable:
            REP.skip("mig_profiles", f"gpu={gpu.index} {gpu.name} cannot do MIG", gpu=gpu.index)
            continue
        if not gpu.mig_mode:  # NVML lists profiles only with MIG on; the plan uses the shipped table then
            report("mig_profiles", bool(shipped), fmt(gpu=gpu.index, mig_mode="off", table=where), gpu=gpu.index,
                   mig_mode="off", table=where,
                   note="MIG mode off: NVML lists no profiles; compare by hand with `nvidia-smi mig -lgip` on a MIG "
                        "host (3g/4g .71gb memory in h200-141gb.json is an estimate to confirm)")
            continue
        read = {p.name: p for p in gpu.mig_profiles}
        table = {p.name: p for p in shipped}
        diffs = {n: {"nvml": read.get(n), "table": table.get(n)} for n in set(read) | set(table)
                 if read.get(n) != table.get(n)}
        report("mig_profiles", not diffs, fmt(gpu=gpu.index, table=where, differences=len(diffs)), gpu=gpu.index,
               table=where, differences=diffs,
               lgip=sh(["nvidia-smi", "mig", "-lgip"]).stdout[-3000:])
    _probe_profile_ids()


def _probe_profile_ids() -> None:
    from partitioner.devices.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    backend.open()
    nvml = backend._lib()  # the probe needs raw NVML; this script is the GPU check, not multiserve code
    allowed = ("NVMLError_NotSupported", "NVMLError_InvalidArgument", "NVMLError_NotFound")
    try:
        for index in range(backend.gpu_count()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            refused = {}
            for enum_id in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum_id)
                except nvml.NVMLError as exc:
                    refused[enum_id] = type(exc).__name__
            bad = {k: v for k, v in refused.items() if v not in allowed}
            report("mig_profile_id_probe", not bad, fmt(gpu=index, refused=len(refused), unexpected=len(bad)),
                   gpu=index, refused=refused)
    finally:
        backend.close()


def check_plan_against_device() -> None:
    before = mig_modes()
    with tempfile.TemporaryDirectory() as tmp:
        registry = Path(tmp) / "reg.yaml"
        registry.write_text("gateway: {model_roots: [/]}\n"
                            "models:\n"
                            "  - {name: a, type: chat, source: {path: /m/a.gguf}, replicas: 2,\n"
                            "     placement: {isolation: mig, memory_gib: 8}}\n"
                            "  - {name: b, type: chat, source: {path: /m/b.gguf},\n"
                            "     placement: {isolation: timeslice, memory_gib: 4, weight: 3}}\n")
        runs = {name: sh([*CLI, *args]) for name, args in {
            "mig_registry": ["plan", "--config", str(registry), "--mig-fallback", "mps", "--json"],
            "default_registry": ["plan"],
            "apply_dry_run": ["apply", "--dry-run", "--config", str(registry), "--mig-fallback", "mps",
                              "--state-file", str(Path(tmp) / "state.json")]}.items()}
    after = mig_modes()
    clean = all(r.returncode in (0, 1) and "Traceback" not in r.stderr for r in runs.values())
    report("plan_against_real_device", clean and before == after,
           fmt(**{k: r.returncode for k, r in runs.items()}, mig_mode_unchanged=before == after),
           mig_mode_before=before, mig_mode_after=after,
           results={k: {"rc": r.returncode, "stdout": r.stdout[-2500:], "stderr": r.stderr[-1500:]}
                    for k, r in runs.items()})


CLIENT = """
import os, sys, time, torch
x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
for _ in range(3): x @ x
torch.cuda.synchronize()
start, n = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[1]):
    for _ in range(8): x @ x
    torch.cuda.synchronize(); n += 8
print(2 * 4096 ** 3 * n / (time.perf_counter() - start) / 1e12)
"""


def _clients(env: dict[str, str], percents: list[int], seconds: float) -> list[float]:
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(seconds)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(p)})
             for p in percents]
    return [float(p.communicate(timeout=seconds + 60)[0].strip() or "nan") for p in procs]


def check_mps() -> None:
    if status()["mps"]["control_pids"]:
        REP.skip("mps_thread_shares", "an MPS control daemon already runs here; not starting another")
        return
    with tempfile.TemporaryDirectory() as pipe, tempfile.TemporaryDirectory() as log:
        uuid = smi("uuid")[0][0]
        env = {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
        started = sh(["nvidia-cuda-mps-control", "-d"], env)
        if started.returncode != 0:
            report("mps_thread_shares", False, "the MPS daemon did not start", error=started.stderr)
            return
        try:
            seen = status({"CUDA_MPS_PIPE_DIRECTORY": pipe})["mps"]
            alone = [_clients(env, [p], 6.0)[0] for p in (30, 70)]
            together = _clients(env, [30, 70], 12.0)
        finally:
            quit_rc = sh(["nvidia-cuda-mps-control"], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, stdin="quit\n").returncode
            time.sleep(1.0)
        gone = not status({"CUDA_MPS_PIPE_DIRECTORY": pipe})["mps"]["pipe_directories"]
        ratio = together[1] / together[0] if together[0] else float("nan")
        report("mps_thread_shares", pipe in seen["pipe_directories"] and quit_rc == 0 and gone and ratio > 1.2,
               fmt(ratio_70_over_30_together=ratio, tflops_30=together[0], tflops_70=together[1], stopped=gone),
               tflops_alone={"30%": alone[0], "70%": alone[1]}, tflops_together={"30%": together[0],
                                                                                 "70%": together[1]},
               ratio_70_over_30_together=ratio, status_saw_daemon=seen, stopped=gone)


def main() -> int:
    global REP
    args = parse_args(__doc__ or "")
    REP = Reporter("partitioner", args.out)
    if args.device == "cpu":
        REP.report("needs_gpu", False, "no --device cpu dry run: these checks read NVML and nvidia-smi")
        return REP.exit_code()
    for check in (check_inventory, check_mig_profiles, check_plan_against_device, check_mps):
        REP.guarded(check.__name__.removeprefix("check_"), check)
    return REP.exit_code()


if __name__ == "__main__":
    sys.exit(main())
