"""The NVML backend: a clean CPU inventory where NVML is missing (really missing here), and its reading code
checked against a stand-in `pynvml` module built from known GPUs."""

from __future__ import annotations

import ctypes.util
import sys
from dataclasses import replace

import pytest

from partitioner.devices.backend import BackendUnavailable, DeviceError
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.inventory import DeviceProcess
from partitioner.devices.nvml_backend import NvmlBackend
from partitioner.devices.read import read_inventory
from registry.fields import GIB
from tests.partitioner import fake_nvml
from tests.partitioner.conftest import gpus

no_nvml = pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                             reason="this host has an NVML library; tests/gpu checks the real one")


@no_nvml
def test_missing_nvml_library_gives_a_cpu_inventory_not_a_crash():
    backend = NvmlBackend()  # the real pynvml, which cannot load libnvidia-ml.so.1 here
    with pytest.raises(BackendUnavailable, match=r"libnvidia-ml\.so\.1"):
        backend.open()
    inventory = read_inventory(backend)
    assert inventory.is_cpu and inventory.source == "cpu" and inventory.devices == ()
    assert "no NVML" in inventory.note and "libnvidia-ml.so.1" in inventory.note


def test_pynvml_not_installed_gives_a_cpu_inventory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    inventory = read_inventory(NvmlBackend())
    assert inventory.is_cpu and "pynvml is not installed" in inventory.note


@pytest.mark.parametrize(("error", "reason"), [
    (fake_nvml.NVMLError_DriverNotLoaded(), "driver is not loaded"),
    (fake_nvml.NVMLError("weird"), "NVML did not start: weird"),
])
def test_any_init_failure_is_a_reason(error, reason):
    inventory = read_inventory(NvmlBackend(nvml=fake_nvml.FakeNvml([], init_error=error)))
    assert inventory.is_cpu and reason in inventory.note


def mig_gpu():
    """An H100 in MIG mode with two MIG devices, one of them busy, as the fake backend builds it."""
    fake = FakeBackend(gpus("h100-80gb"))
    fake.set_mig_mode(0, True)
    fake.create_mig_device(0, "3g.40gb", 4)
    busy = fake.create_mig_device(0, "1g.10gb", 0)
    fake.add_process(0, pid=321, used_memory_bytes=2 * GIB, device_uuid=busy.uuid)
    return fake.read_gpu(0)


def test_reads_a_mig_gpu_field_for_field():
    gpu = mig_gpu()
    nvml = fake_nvml.FakeNvml([gpu])
    backend = NvmlBackend(nvml=nvml)
    inventory = read_inventory(backend)
    assert inventory.source == "nvml" and nvml.shutdowns == 1
    assert inventory.devices == (gpu,)


def test_unprivileged_read_leaves_mig_placements_unknown():
    gpu = mig_gpu()
    read = read_inventory(NvmlBackend(nvml=fake_nvml.FakeNvml([gpu], privileged=False))).devices[0]
    assert [m.start for m in read.mig_devices] == [None, None]
    assert [m.memory_slices for m in read.mig_devices] == [4, 1]  # from the profile table instead
    assert read.processes == gpu.processes


def test_profiles_nvml_will_not_describe_come_from_the_shipped_table():
    """In some containers NVML answers NoPermission for GPU-instance profiles even with MIG on: the read goes on, and
    the profiles come from the shipped table, as with MIG off."""
    gpu = mig_gpu()
    refused = {"nvmlDeviceGetGpuInstanceProfileInfo": fake_nvml.NVMLError_NoPermission()}
    nvml = fake_nvml.FakeNvml([gpu], failing=refused)
    inventory = read_inventory(NvmlBackend(nvml=nvml))
    read = inventory.devices[0]
    assert read.mig_mode is True and {p.name for p in read.mig_profiles} >= {"1g.10gb", "7g.80gb"}
    assert "configs/inventories/h100-80gb.json" in inventory.note


def test_profile_variants_keep_their_whole_names():
    """Newer drivers list variants beside "+me" ("-me", "+me.all", "+gfx"): each keeps its own name, never read as
    its base profile."""
    gpu = mig_gpu()
    base = gpu.mig_profiles[0]
    variants = tuple(replace(base, name=base.name + suffix, profile_id=base.profile_id + 100 + i)
                     for i, suffix in enumerate(("-me", "+me.all", "+gfx")))
    gpu = replace(gpu, mig_profiles=(*gpu.mig_profiles, *variants))
    read = read_inventory(NvmlBackend(nvml=fake_nvml.FakeNvml([gpu]))).devices[0]
    names = [p.name for p in read.mig_profiles]
    assert names == [p.name for p in gpu.mig_profiles] and len(set(names)) == len(names)


def test_mig_off_gpu_gets_the_shipped_profile_table():
    gpu = replace(gpus("h100-80gb").devices[0], mig_profiles=(),
                  processes=(DeviceProcess(pid=9, used_memory_bytes=GIB),))
    inventory = read_inventory(NvmlBackend(nvml=fake_nvml.FakeNvml([gpu])))
    read = inventory.devices[0]
    assert read.mig_mode is False and read.processes == gpu.processes
    assert {p.name for p in read.mig_profiles} >= {"1g.10gb", "7g.80gb"}
    assert "configs/inventories/h100-80gb.json" in inventory.note


def test_unknown_product_gets_no_profiles_and_a_non_mig_gpu_no_mig_mode():
    odd = replace(gpus("h100-80gb").devices[0], name="NVIDIA H100 PCIe", mig_profiles=())
    plain = replace(gpus("h100-80gb").devices[0], index=1, name="NVIDIA L4", mig_mode=None, mig_mode_pending=None,
                    mig_profiles=())
    inventory = read_inventory(NvmlBackend(nvml=fake_nvml.FakeNvml([odd, plain])))
    assert inventory.devices[0].mig_profiles == () and inventory.devices[0].mig_capable
    assert inventory.devices[1].mig_mode is None and not inventory.devices[1].mig_capable


def test_nvml_errors_become_device_errors_naming_the_gpu():
    nvml = fake_nvml.FakeNvml([mig_gpu()], failing={"nvmlDeviceGetMemoryInfo": fake_nvml.NVMLError_NoPermission()})
    with pytest.raises(DeviceError) as exc:
        read_inventory(NvmlBackend(nvml=nvml))
    assert exc.value.kind == "no_permission" and str(exc.value).startswith("GPU 0:")
    assert nvml.shutdowns == 1  # NVML is shut down even when a read fails
