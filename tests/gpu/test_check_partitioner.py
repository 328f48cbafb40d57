"""The partitioner's GPU check (tests/gpu/check_partitioner.py) without a GPU: its judgements over fakes at the seams
it reads the host through: `sh` (nvidia-smi, nvidia-cuda-mps-control, the `multiserve partition` CLI), `status`,
`_clients` (the matmul clients), `time` (a fake clock) and the NVML module behind `NvmlBackend`.

What must hold: the MPS daemon's stop is awaited (bounded), not expected after 1 s; a host without MPS is a SKIP;
the thread shares pass only when the 70 % client is measurably faster than the 30 % one; NVML's NoPermission makes
the profile probe a SKIP; with MIG off, a table is not passed unchecked; the plan and the dry run of a registry made
for the device found must exit 0."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import partitioner.devices.nvml_backend as nvml_backend
from foundation.config_files import config_path
from partitioner.devices.inventory import DeviceProcess, GpuDevice, load_inventory, save_inventory
from partitioner.devices.mps_probe import MPS_CONTROL
from tests.gpu import check_partitioner as cp
from tests.gpu.common import Reporter
from tests.partitioner import fake_nvml

ROOT = Path(__file__).resolve().parents[2]
H200 = config_path("inventories", "h200-141gb.json")
GIB = 1 << 30
SHARES_APPLIED = {30: 100.0, 70: 230.0}  # TFLOP/s: what 30 % and 70 % of the SMs give a compute-bound matmul


class FakeClock:
    """`time` as the check uses it: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def ok(argv: list[str], stdout: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(argv, 0, stdout, "")


class FakeMpsHost:
    """nvidia-smi, `partition status` and nvidia-cuda-mps-control as the MPS check meets them: the daemon's pipe
    exists from `-d` until `stop_lag_s` after `quit` (the daemon first waits for its servers to exit)."""

    def __init__(self, clock: FakeClock, stop_lag_s: float = 0.0, installed: bool = True) -> None:
        self.clock, self.stop_lag_s, self.installed = clock, stop_lag_s, installed
        self.pipe: str | None = None
        self.quit_at: float | None = None

    def sh(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 60,
           stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        if argv[0] == "nvidia-smi":
            return ok(argv, "GPU-00000000-0000-0000-0000-000000000000\n")
        if argv[0] != MPS_CONTROL:
            raise AssertionError(f"unexpected command {argv}")
        if not self.installed:  # what subprocess.run raises for a program that is not there
            raise FileNotFoundError(2, "No such file or directory", MPS_CONTROL)
        if argv[1:] == ["-d"]:
            assert env is not None
            self.pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        elif stdin == "quit\n":
            self.quit_at = self.clock.now
        return ok(argv)

    def status(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        live = self.pipe is not None and (self.quit_at is None or self.clock.now < self.quit_at + self.stop_lag_s)
        return {"devices": [{"index": 0, "mig_mode": False}],
                "mps": {"control_pids": [], "pipe_directories": [self.pipe] if live else []}}


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The check's recorded results so far (`$OUT/partitioner.jsonl`), as `main` would write them through `cp.REP`."""
    rep = Reporter("partitioner", tmp_path)
    monkeypatch.setattr(cp, "REP", rep, raising=False)
    return lambda: [json.loads(line) for line in rep.path.read_text().splitlines()]


def named(results: Callable[[], list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return [r for r in results() if r["name"] == f"partitioner.{name}"]


@pytest.fixture
def mps_host(monkeypatch: pytest.MonkeyPatch):
    """Factory: a `FakeMpsHost` wired into the check, with clients whose throughput is `alone` / `together`."""

    def make(stop_lag_s: float = 0.0, installed: bool = True, alone: dict[int, float] = SHARES_APPLIED,
             together: dict[int, float] = SHARES_APPLIED) -> FakeMpsHost:
        clock = FakeClock()
        host = FakeMpsHost(clock, stop_lag_s, installed)
        monkeypatch.setattr(cp, "time", clock)
        monkeypatch.setattr(cp, "sh", host.sh)
        monkeypatch.setattr(cp, "status", host.status)
        monkeypatch.setattr(cp, "_clients", lambda env, percents, seconds:
                            [(alone if len(percents) == 1 else together)[p] for p in percents])
        return host

    return make


def test_mps_stop_is_awaited_not_expected_after_one_second(results, mps_host) -> None:
    host = mps_host(stop_lag_s=3.0)
    cp.REP.guarded("mps", cp.check_mps)
    [result] = named(results, "mps_thread_shares")
    assert result["ok"] and "skipped" not in result, result["summary"]
    assert 3.0 <= result["stopped_after_s"] <= 3.0 + 1.0
    assert host.quit_at is not None


def test_mps_daemon_that_never_stops_fails_after_a_bounded_wait(results, mps_host) -> None:
    host = mps_host(stop_lag_s=3600.0)
    cp.REP.guarded("mps", cp.check_mps)
    [result] = named(results, "mps_thread_shares")
    assert not result["ok"] and result["stopped_after_s"] is None
    assert cp.MPS_WAIT_S <= host.clock.now <= cp.MPS_WAIT_S + 2.0


def test_no_mps_control_binary_is_a_skip_with_the_reason(results, mps_host) -> None:
    mps_host(installed=False)
    cp.REP.guarded("mps", cp.check_mps)
    assert len(results()) == 1
    [result] = named(results, "mps_thread_shares")
    assert "skipped" in result and MPS_CONTROL in result["skipped"] and "not installed" in result["skipped"]


def test_thread_shares_not_applied_fail_though_a_daemon_ran(results, mps_host) -> None:
    # the daemon ran and stopped, together the 70 % client got 1.27x, but alone both ran at the whole GPU's speed:
    # the percentages were not applied
    mps_host(alone={30: 200.0, 70: 204.0}, together={30: 150.0, 70: 190.0})
    cp.REP.guarded("mps", cp.check_mps)
    [result] = named(results, "mps_thread_shares")
    assert not result["ok"], result["summary"]
    assert "ratio_70_over_30_alone=1.02" in result["summary"]


def test_a_client_that_measured_nothing_fails(results, mps_host) -> None:
    mps_host(alone={30: float("nan"), 70: 230.0})
    cp.REP.guarded("mps", cp.check_mps)
    assert not named(results, "mps_thread_shares")[0]["ok"]


# --- MIG profiles through a fake NVML ---------------------------------------------------------------------------


class NVMLError_Unknown(fake_nvml.NVMLError):
    pass


def h200(**changes: Any) -> GpuDevice:
    return dataclasses.replace(load_inventory(H200).devices[0], **changes)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch):
    """Factory: every `NvmlBackend()` the check makes reads this fake NVML (tests/partitioner/fake_nvml.py)."""

    def make(gpu: GpuDevice, **fake: Any) -> fake_nvml.FakeNvml:
        module = fake_nvml.FakeNvml([gpu], **fake)
        real = nvml_backend.NvmlBackend
        monkeypatch.setattr(nvml_backend, "NvmlBackend", lambda *args, **kwargs: real(nvml=module))
        monkeypatch.setattr(cp, "sh", lambda argv, *args, **kwargs: ok(argv, "(nvidia-smi mig -lgip output)"))
        return module

    return make


def test_probe_refused_for_lack_of_permission_is_a_skip_that_says_so(results, nvml) -> None:
    nvml(h200(mig_profiles=()), failing={"nvmlDeviceGetGpuInstanceProfileInfo": fake_nvml.NVMLError_NoPermission()})
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [probe] = named(results, "mig_profile_id_probe")
    assert "skipped" in probe, probe["summary"]
    assert "NoPermission" in probe["skipped"] and f"{fake_nvml.NVML_GPU_INSTANCE_PROFILE_COUNT} " in probe["skipped"]
    assert probe["probed_ids"] == fake_nvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    assert not [r for r in results() if not r["ok"]]


def test_probe_fails_on_an_unexpected_nvml_error(results, nvml) -> None:
    nvml(h200(mig_profiles=()), failing={"nvmlDeviceGetGpuInstanceProfileInfo": NVMLError_Unknown()})
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [probe] = named(results, "mig_profile_id_probe")
    assert not probe["ok"]


def test_mig_off_with_no_profiles_from_nvml_is_a_skip_not_a_pass(results, nvml) -> None:
    nvml(h200(mig_profiles=()))  # MIG off: every profile id NotSupported
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [table] = named(results, "mig_profiles")
    assert "skipped" in table, table["summary"]
    assert "MIG mode off" in table["skipped"] and "h200-141gb.json" in table["skipped"]
    assert named(results, "mig_profile_id_probe")[0]["ok"]


def test_mig_off_profiles_nvml_answers_are_compared_with_the_table(results, nvml) -> None:
    shipped = load_inventory(H200).devices[0].mig_profiles
    answered = tuple(dataclasses.replace(p, memory_bytes=p.memory_bytes + GIB) if p.name == "3g.71gb" else p
                     for p in shipped)
    nvml(h200(mig_profiles=answered))  # MIG off (the GPU's mig_mode), yet NVML answers the probe
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [table] = named(results, "mig_profiles")
    assert not table["ok"] and "skipped" not in table
    assert set(table["differences"]) == {"3g.71gb"}


def test_mig_off_profiles_equal_to_the_table_pass(results, nvml) -> None:
    nvml(h200(mig_profiles=load_inventory(H200).devices[0].mig_profiles))
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [table] = named(results, "mig_profiles")
    assert table["ok"] and "skipped" not in table and table["differences"] == {}


def test_mig_off_variants_the_table_leaves_out_are_listed_not_judged(results, nvml) -> None:
    shipped = load_inventory(H200).devices[0].mig_profiles
    variant = dataclasses.replace(shipped[0], name="1g.18gb-me", profile_id=47)  # newer drivers add such variants
    nvml(h200(mig_profiles=(*shipped, variant)))
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [table] = named(results, "mig_profiles")
    assert table["ok"] and table["differences"] == {} and table["not_in_table"] == ["1g.18gb-me"]


def test_mig_on_compares_what_the_partitioner_reads(results, nvml) -> None:
    nvml(h200(mig_mode=True, mig_mode_pending=True))
    cp.REP.guarded("mig_profiles", cp.check_mig_profiles)
    [table] = named(results, "mig_profiles")
    assert table["ok"] and "skipped" not in table and table["differences"] == {}


# --- plan and apply --dry-run: the real CLI on an inventory file standing in for the device -----------------------


@pytest.fixture
def cli_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Factory: the check's `sh` runs `multiserve partition ...` for real, on `gpu` (an inventory file in place of
    NVML), and answers nvidia-smi's MIG mode query; `exit_codes` overrides a subcommand's exit status."""

    def make(gpu: GpuDevice, exit_codes: dict[str, int] | None = None) -> list[list[str]]:
        path = tmp_path / "device.json"
        save_inventory(dataclasses.replace(load_inventory(H200), devices=(gpu,)), path)
        calls: list[list[str]] = []

        def sh(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 60,
               stdin: str | None = None) -> subprocess.CompletedProcess[str]:
            if argv[0] == "nvidia-smi":
                mode = "Enabled" if gpu.mig_mode else "Disabled"
                return ok(argv, f"{mode}, {mode}\n")
            assert argv[:len(cp.CLI)] == cp.CLI, argv
            calls.append(argv[len(cp.CLI):])
            done = subprocess.run([*argv, "--inventory", str(path)], capture_output=True, text=True, cwd=ROOT,
                                  timeout=120, check=False)
            forced = (exit_codes or {}).get(argv[len(cp.CLI)])
            return done if forced is None else subprocess.CompletedProcess(argv, forced, done.stdout, done.stderr)

        monkeypatch.setattr(cp, "sh", sh)
        return calls

    return make


def plan_result(results: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    [result] = named(results, "plan_against_real_device")
    return result


def test_plan_and_dry_run_on_an_h200_with_mig_off_exit_0(results, cli_on) -> None:
    calls = cli_on(h200())
    cp.REP.guarded("plan_against_real_device", cp.check_plan_against_device)
    result = plan_result(results)
    assert {k: r["rc"] for k, r in result["results"].items()} == {"registry": 0, "default_registry": 0,
                                                                  "apply_dry_run": 0}, result["results"]
    assert result["ok"], result["summary"]
    assert "mode=mig" in result["summary"] and "fallback=True" in result["summary"]
    assert all("--dry-run" in c for c in calls if c[0] == "apply")


def test_plan_and_dry_run_on_an_h200_with_mig_on_exit_0(results, cli_on) -> None:
    cli_on(h200(mig_mode=True, mig_mode_pending=True))
    cp.REP.guarded("plan_against_real_device", cp.check_plan_against_device)
    result = plan_result(results)
    assert [r["rc"] for r in result["results"].values()] == [0, 0, 0], result["results"]
    assert result["ok"] and "mode=mig" in result["summary"] and "fallback=False" in result["summary"]


def test_a_busy_gpu_with_mig_off_gets_an_mps_registry(results, cli_on) -> None:
    busy = h200(processes=(DeviceProcess(pid=4242, used_memory_bytes=GIB),), memory_used_bytes=GIB,
                memory_free_bytes=h200().memory_total_bytes - GIB)
    cli_on(busy)
    cp.REP.guarded("plan_against_real_device", cp.check_plan_against_device)
    result = plan_result(results)
    assert result["ok"] and "mode=mps" in result["summary"], result["results"]


def test_a_dry_run_that_exits_1_fails(results, cli_on) -> None:
    cli_on(h200(), exit_codes={"apply": 1})
    cp.REP.guarded("plan_against_real_device", cp.check_plan_against_device)
    assert not plan_result(results)["ok"]


def test_a_gpu_too_full_for_any_plan_is_a_skip_with_the_planner_s_reasons(results, cli_on) -> None:
    full = h200(processes=(DeviceProcess(pid=4242, used_memory_bytes=140 * GIB),), memory_used_bytes=140 * GIB,
                memory_free_bytes=h200().memory_total_bytes - 140 * GIB)
    calls = cli_on(full)
    cp.REP.guarded("plan_against_real_device", cp.check_plan_against_device)
    result = plan_result(results)
    assert "skipped" in result and "short by" in result["skipped"]
    assert calls == [["status", "--json"]]  # nothing planned on the CLI once the planner refused
