"""GPU-only, read-only checks of the partitioner: one PASS/FAIL/SKIP line per check on stdout, the details as JSON
lines in `$OUT/partitioner.jsonl`, exit 1 if any failed.

1. NVML inventory (`partition status --json`) against `nvidia-smi`: name, UUID, memory, MIG mode, processes.
2. Every GPU-instance profile id probed through NVML: NotSupported / InvalidArgument / NotFound may refuse one;
   NoPermission (a container) makes it a SKIP that says so; any other error fails. The MIG profiles against the
   shipped table for this GPU (configs/inventories/*.json): with MIG on, as the partitioner reads them; with
   MIG off, as NVML answers the probe, or a SKIP when it answers none (what drivers do while MIG is off).
3. `partition plan` and `partition apply --dry-run` of a registry made for the first GPU as found (MIG on: a mig
   replica; MIG off and idle: mig replicas, which the dry run falls back to MPS for; otherwise MPS replicas), and
   `partition plan` of the default registry: each must exit 0, plan the GPU in the expected mode, and leave MIG
   mode as it was. A SKIP if the planner cannot place even that registry on the GPU as it is (full, or busy).
4. MPS: a control daemon of our own (temporary pipe and log directories), seen by `partition status`; matmul
   clients at 30 % and 70 % active thread percentage, alone and together: the 70 % one must be measurably faster,
   which shows the daemon applied the percentages; `quit` must remove its pipe within 10 s. A SKIP when an MPS
   daemon already runs, when MIG mode is on, or when `nvidia-cuda-mps-control` is not installed.

It never changes MIG mode, clocks, compute mode or any other device setting, never creates MIG devices and never
applies a plan (the applier's MIG path is exercised only against fakes). Run from the checkout:
`PYTHONPATH=. python ...`. There is no `--device cpu` dry run: without NVML and nvidia-smi there is nothing to check.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from partitioner.devices.mps_probe import MPS_CONTROL
from partitioner.devices.nvml_backend import NO_SUCH_PROFILE, profile_name
from tests.gpu.common import Reporter, fmt, parse_args
from tests.gpu.serving import tail

CLI = [sys.executable, "-m", "multiserve", "partition"]
MIB = 1 << 20
GIB = 1 << 30
MPS_WAIT_S = 10.0  # for our daemon's pipe to appear after `-d`, and to go after `quit` (its servers exit first)
# 70 % over 30 % of the SMs allows ~2.3x on a compute-bound matmul; ignored percentages would give ~1x
MIN_RATIO_ALONE = 1.5
MIN_RATIO_TOGETHER = 1.2
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


def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> float | None:
    """Poll `done` until it holds: the seconds that took, or None if it still did not hold after `timeout_s`."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(poll_s)
    return time.monotonic() - start


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


# --- MIG profiles ---------------------------------------------------------------------------------------------

_FACTS = ("profile_id", "slice_count", "memory_bytes", "sm_count", "max_instances")


def probe_profiles(nvml: Any, handle: Any) -> tuple[dict[str, dict[str, int]], dict[int, str]]:
    """Every GPU-instance profile id asked of NVML: the profiles it answered (name -> the `_FACTS` a shipped table
    holds too) and the ids it refused (id -> NVML error class)."""
    answered: dict[str, dict[str, int]] = {}
    refused: dict[int, str] = {}
    for enum_id in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum_id)
        except nvml.NVMLError as exc:
            refused[enum_id] = type(exc).__name__
            continue
        if info.instanceCount:
            answered[profile_name(info.name)] = {
                "profile_id": int(info.id), "slice_count": int(info.sliceCount),
                "memory_bytes": int(info.memorySizeMB) * MIB, "sm_count": int(info.multiprocessorCount),
                "max_instances": int(info.instanceCount)}
    return answered, refused


def check_mig_profiles() -> None:
    from partitioner.devices.nvml_backend import NvmlBackend
    from partitioner.devices.read import read_inventory

    probes = _probe_profile_ids()  # first: a GPU whose profiles NVML will not read must still get its probe line
    for gpu in read_inventory(NvmlBackend()).devices:
        _check_table(gpu, *probes[gpu.index])


def _probe_profile_ids() -> dict[int, tuple[dict[str, dict[str, int]], dict[int, str]]]:
    from partitioner.devices.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    backend.open()
    nvml = backend._lib()  # the probe needs raw NVML; this script is the GPU check, not multiserve code
    probes = {}
    try:
        for index in range(backend.gpu_count()):
            answered, refused = probe_profiles(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
            probes[index] = answered, refused
            _report_probe(index, int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT), answered, refused)
    finally:
        backend.close()
    return probes


def _report_probe(index: int, probed: int, answered: dict[str, Any], refused: dict[int, str]) -> None:
    denied = sorted(i for i, kind in refused.items() if kind == "NVMLError_NoPermission")
    bad = {i: kind for i, kind in refused.items() if kind not in NO_SUCH_PROFILE and i not in denied}
    data: dict[str, Any] = {"gpu": index, "probed_ids": probed, "answered": sorted(answered), "refused": refused}
    if bad or not denied:
        report("mig_profile_id_probe", not bad,
               fmt(gpu=index, probed=probed, answered=len(answered), refused=len(refused), unexpected=len(bad)),
               unexpected=bad, **data)
        return
    REP.skip("mig_profile_id_probe",
             f"gpu={index}: NVML refused {len(denied)} of {probed} GPU-instance profile ids for lack of permission "
             f"(NoPermission, e.g. a container without the MIG capabilities); answered {len(answered)}, refused as "
             f"expected {len(refused) - len(denied)}: the refused ids were not checked", **data)


def _check_table(gpu: Any, answered: dict[str, dict[str, int]], refused: dict[int, str]) -> None:
    """The shipped table for `gpu` against NVML: the partitioner's reading with MIG on; the probe's answers with
    MIG off (NVML may answer none then: the documented NotSupported is what drivers give while MIG is off)."""
    from partitioner.devices.catalog import known_mig_profiles

    if not gpu.mig_capable:
        REP.skip("mig_profiles", f"gpu={gpu.index} {gpu.name} cannot do MIG", gpu=gpu.index)
        return
    shipped, where = known_mig_profiles(gpu)
    if not shipped:
        REP.skip("mig_profiles", f"gpu={gpu.index}: no table in configs/inventories/ is for {gpu.name} with "
                                 f"{gpu.memory_total_bytes / GIB:.1f} GiB: nothing to compare", gpu=gpu.index,
                 nvml_answered=answered)
        return
    if gpu.mig_mode:
        read = {p.name: p for p in gpu.mig_profiles}
        table = {p.name: p for p in shipped}
        diffs = {n: {"nvml": read.get(n), "table": table.get(n)} for n in set(read) | set(table)
                 if read.get(n) != table.get(n)}
        report("mig_profiles", not diffs, fmt(gpu=gpu.index, mig_mode="on", table=where, differences=len(diffs)),
               gpu=gpu.index, table=where, differences=diffs, lgip=sh(["nvidia-smi", "mig", "-lgip"]).stdout[-3000:])
        return
    if not answered:
        kinds = ", ".join(f"{k.removeprefix('NVMLError_')} x{n}" for k, n in sorted(Counter(refused.values()).items()))
        REP.skip("mig_profiles", f"gpu={gpu.index}: MIG mode off and NVML answered none of its GPU-instance profile "
                                 f"ids ({kinds or 'each with 0 instances'}); {where}, which the planner uses while "
                                 f"MIG is off, can only be compared with MIG on", gpu=gpu.index, table=where,
                 refused=refused)
        return
    table_facts = {p.name: {k: getattr(p, k) for k in _FACTS} for p in shipped}
    # variants the table leaves out on purpose (the planner never creates a "+"/"-" profile) are listed, not judged
    ignored = sorted(n for n in answered if n not in table_facts and ("+" in n or "-" in n))
    diffs = {n: {"nvml": answered.get(n), "table": table_facts.get(n)}
             for n in (set(answered) | set(table_facts)) - set(ignored) if answered.get(n) != table_facts.get(n)}
    report("mig_profiles", not diffs, fmt(gpu=gpu.index, mig_mode="off", table=where, differences=len(diffs)),
           gpu=gpu.index, table=where, differences=diffs, compared=list(_FACTS), not_in_table=ignored,
           note="MIG mode off: NVML's answers to the profile probe against the table (placements not compared)")


# --- plan and apply --dry-run on the device found ---------------------------------------------------------------

_SOURCE = "type: chat, source: {path: /m/%s.gguf}"


def registry_for(gpu: Any) -> tuple[str, str]:
    """A registry the planner can place on `gpu` as it is, and the mode it must plan the GPU in.

    MIG on: one mig replica (a free MIG device reused, or a new one). MIG off on an idle MIG GPU: two mig replicas,
    planned as MIG devices once MIG is on (the plan says to enable it); `apply --dry-run` then takes the MPS
    fallback, since multiserve never changes MIG mode. Otherwise (no MIG, or processes that keep MIG from being
    enabled): two MPS replicas at 30 % and 70 %. 4 GiB each fits the smallest profile of every shipped table."""
    head = "gateway: {model_roots: [/]}\nmodels:\n"
    if gpu.mig_mode:
        return head + f"  - {{name: a, {_SOURCE % 'a'}, placement: {{isolation: mig, memory_gib: 4}}}}\n", "mig"
    if gpu.mig_capable and not gpu.processes:
        return (head + f"  - {{name: a, {_SOURCE % 'a'}, replicas: 2, placement: {{isolation: mig, memory_gib: 4}}}}\n",
                "mig")
    models = [f"  - {{name: {n}, {_SOURCE % n}, placement: {{isolation: mps, memory_gib: 4, sm_percent: {p}}}}}\n"
              for n, p in (("a", 30), ("b", 70))]
    return head + "".join(models), "mps"


def _plan_refusal(registry: Path, inventory: Any, index: int) -> str | None:
    """Why the planner (in this process, on the inventory `partition status` read) cannot place `registry` on GPU
    `index` with an MPS fallback; None when it can."""
    from partitioner.planning.demand import replica_demands
    from partitioner.planning.placement import PlanOptions
    from partitioner.planning.plan import InfeasiblePlan
    from partitioner.planning.planner import plan
    from registry.store import load_registry

    try:
        plan(inventory, replica_demands(load_registry(registry)), PlanOptions(gpus=(index,), mig_fallback="mps"))
    except InfeasiblePlan as exc:
        return "; ".join(exc.problems)
    return None


def check_plan_against_device() -> None:
    from partitioner.devices.inventory import inventory_from_dict

    inventory = inventory_from_dict(status())
    if inventory.is_cpu:
        report("plan_against_real_device", False, f"partition status found no GPU ({inventory.source})")
        return
    gpu = inventory.devices[0]
    text, mode = registry_for(gpu)
    before = mig_modes()
    with tempfile.TemporaryDirectory() as tmp:
        registry = Path(tmp) / "reg.yaml"
        registry.write_text(text)
        refusal = _plan_refusal(registry, inventory, gpu.index)
        if refusal is not None:
            REP.skip("plan_against_real_device", f"gpu={gpu.index} as it is cannot take even this registry: "
                                                 f"{refusal[:400]}", registry=text)
            return
        options = ["--config", str(registry), "--gpus", str(gpu.index), "--mig-fallback", "mps"]
        runs = {name: sh([*CLI, *args]) for name, args in {
            "registry": ["plan", *options, "--json"],
            "default_registry": ["plan"],
            "apply_dry_run": ["apply", "--dry-run", *options, "--state-file", str(Path(tmp) / "state.json")]}.items()}
    after = mig_modes()
    _report_plan(gpu, mode, text, runs, before, after)


def _report_plan(gpu: Any, mode: str, registry: str, runs: dict[str, subprocess.CompletedProcess[str]],
                 before: list[str], after: list[str]) -> None:
    planned = _planned_mode(runs["registry"].stdout, gpu.index)
    fallback = "Fallback: the mig replicas run with mps" in runs["apply_dry_run"].stderr
    expect_fallback = mode == "mig" and not gpu.mig_mode  # the dry run cannot enable MIG: it falls back to MPS
    ok = (all(r.returncode == 0 for r in runs.values()) and planned == mode and fallback == expect_fallback
          and runs["apply_dry_run"].stdout.startswith("dry run:") and before == after)
    report("plan_against_real_device", ok,
           fmt(gpu=gpu.index, **{k: r.returncode for k, r in runs.items()}, mode=planned, expected_mode=mode,
               fallback=fallback, mig_mode_unchanged=before == after),
           registry=registry, expected_fallback=expect_fallback, mig_mode_before=before, mig_mode_after=after,
           results={k: {"rc": r.returncode, "stdout": r.stdout[-2500:], "stderr": r.stderr[-1500:]}
                    for k, r in runs.items()})


def _planned_mode(plan_json: str, index: int) -> str | None:
    try:
        devices = json.loads(plan_json)["devices"]
    except (ValueError, KeyError, TypeError):
        return None
    return next((d["mode"] for d in devices if d.get("index") == index), None)


# --- MPS --------------------------------------------------------------------------------------------------------

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
    """What it proves: the MPS daemon we start serves CUDA clients, and applies CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    (what the planner gives each mps replica). Alone, with the GPU to itself, a compute-bound fp16 matmul client at
    70 % must reach >= 1.5x the TFLOP/s of one at 30 % (their SM counts allow ~2.3x); were the percentage ignored,
    or the clients not on our daemon, both would run at the whole GPU's speed. Together, the 70 % client must get
    > 1.2x the 30 % one's. `partition status` must see the daemon's pipe, and no longer see it within 10 s of
    `quit`. Not proved: memory limits (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), MPS inside MIG devices."""
    data = status()
    if data["mps"]["control_pids"]:
        REP.skip("mps_thread_shares", "an MPS control daemon already runs here; not starting another")
        return
    if data["devices"] and data["devices"][0]["mig_mode"]:
        REP.skip("mps_thread_shares", "MIG mode is on: the whole GPU runs no CUDA clients (MPS per MIG device is "
                                      "not checked here)")
        return
    with tempfile.TemporaryDirectory() as pipe, tempfile.TemporaryDirectory() as log:
        uuid = smi("uuid")[0][0]
        env = {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
        try:
            started = sh([MPS_CONTROL, "-d"], env)
        except FileNotFoundError as exc:
            REP.skip("mps_thread_shares", f"{MPS_CONTROL} is not installed on this host ({exc.strerror}): MPS "
                                          f"cannot run here")
            return
        if started.returncode != 0:
            report("mps_thread_shares", False, "the MPS daemon did not start", error=started.stderr,
                   control_log=tail(Path(log) / "control.log", 2000))
            return
        try:
            seen_s = wait_until(lambda: pipe in _pipes(pipe), MPS_WAIT_S)
            alone = [_clients(env, [p], 4.0)[0] for p in (30, 70)] if seen_s is not None else []
            together = _clients(env, [30, 70], 10.0) if seen_s is not None else []  # long: the starts differ
        finally:
            quit_rc = sh([MPS_CONTROL], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, stdin="quit\n").returncode
            gone_s = wait_until(lambda: pipe not in _pipes(pipe), MPS_WAIT_S)
            control_log = tail(Path(log) / "control.log", 2000)
    # a pipe left after the daemon's process ended would make `partition status` report a daemon that is gone
    pids_after = list(status()["mps"]["control_pids"])
    _report_shares(alone, together, seen_s, quit_rc, gone_s, control_log, pids_after)


def _pipes(pipe: str) -> list[str]:
    return list(status({"CUDA_MPS_PIPE_DIRECTORY": pipe})["mps"]["pipe_directories"])


def _ratio(fast: float, slow: float) -> float:
    return fast / slow if math.isfinite(fast) and math.isfinite(slow) and slow > 0 else float("nan")


def _report_shares(alone: list[float], together: list[float], seen_s: float | None, quit_rc: int,
                   gone_s: float | None, control_log: str, control_pids_after: list[int]) -> None:
    ratio_alone = _ratio(alone[1], alone[0]) if alone else float("nan")
    ratio_together = _ratio(together[1], together[0]) if together else float("nan")
    ok = (seen_s is not None and ratio_alone >= MIN_RATIO_ALONE and ratio_together > MIN_RATIO_TOGETHER
          and quit_rc == 0 and gone_s is not None)
    report("mps_thread_shares", ok,
           fmt(ratio_70_over_30_alone=ratio_alone, ratio_70_over_30_together=ratio_together,
               seen=seen_s is not None, quit_rc=quit_rc, stopped=gone_s is not None),
           tflops_alone=dict(zip(("30%", "70%"), alone, strict=False)),
           tflops_together=dict(zip(("30%", "70%"), together, strict=False)),
           min_ratio_alone=MIN_RATIO_ALONE, min_ratio_together=MIN_RATIO_TOGETHER, seen_after_s=seen_s,
           stopped_after_s=gone_s, control_pids_after_quit=control_pids_after, control_log=control_log)


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
