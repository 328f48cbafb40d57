"""The fake backend: shipped MIG tables, NVML's placement rules for creating and destroying MIG devices, and
injected NVML errors."""

from __future__ import annotations

import pytest

from partitioner.devices.backend import BackendUnavailable, DeviceError
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.mig_fit import max_compute_slices
from partitioner.devices.read import read_inventory
from registry.fields import GIB
from tests.partitioner.conftest import GPU_FILES, INVENTORIES, gpus


@pytest.mark.parametrize("kind", GPU_FILES)
def test_shipped_tables_are_consistent(kind):
    gpu = FakeBackend.from_file(INVENTORIES / f"{kind}.json").read_gpu(0)
    assert gpu.mig_capable and gpu.mig_mode is False
    by_name = {p.name: p for p in gpu.mig_profiles}
    assert max_compute_slices(gpu) == 7
    for p in gpu.mig_profiles:
        assert p.name.startswith(f"{p.slice_count}g."), p
        assert all(s >= 0 and s + p.memory_slices <= 8 for s in p.placements), p
        assert p.max_instances <= len(p.placements)
        assert 0 < p.memory_bytes <= gpu.memory_total_bytes
    full = next(p for p in gpu.mig_profiles if p.slice_count == 7)
    assert full.memory_slices == 8 and full.placements == (0,)
    # the smallest profile's memory times 7 stays under the full profile's (slot 7 only serves 7g)
    assert min(p.memory_bytes for p in by_name.values()) * 7 < full.memory_bytes


def test_h100_and_h200_tables_match_the_mig_user_guide():
    h100 = {p.name: p for p in FakeBackend.from_file(INVENTORIES / "h100-80gb.json").read_gpu(0).mig_profiles}
    assert set(h100) == {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}
    assert [h100[n].profile_id for n in ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")] == \
        [19, 15, 14, 9, 5, 0]
    assert h100["1g.20gb"].placements == (0, 2, 4, 6) and h100["1g.20gb"].memory_slices == 2
    assert h100["3g.40gb"].placements == (0, 4) and h100["3g.40gb"].memory_slices == 4
    assert h100["7g.80gb"].sm_count == 132
    h200 = {p.name for p in FakeBackend.from_file(INVENTORIES / "h200-141gb.json").read_gpu(0).mig_profiles}
    assert {"1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"} <= h200


def enabled(kind: str = "h100-80gb") -> FakeBackend:
    fake = FakeBackend(gpus(kind))
    fake.set_mig_mode(0, True)
    return fake


def test_creates_mig_devices_only_at_valid_free_placements():
    fake = enabled()
    three = fake.create_mig_device(0, "3g.40gb", 4)
    assert (three.start, three.memory_slices, three.slice_count) == (4, 4, 3)
    assert three.memory_total_bytes == pytest.approx(39.5 * GIB, rel=0.01)
    with pytest.raises(DeviceError) as bad_start:
        fake.create_mig_device(0, "3g.40gb", 2)
    assert bad_start.value.kind == "invalid_argument" and "valid: [0, 4]" in str(bad_start.value)
    with pytest.raises(DeviceError) as overlap:
        fake.create_mig_device(0, "2g.20gb", 4)
    assert overlap.value.kind == "insufficient_resources" and "overlaps 3g.40gb" in str(overlap.value)
    fake.create_mig_device(0, "4g.40gb", 0)  # 4g at 0 + 3g at 4: the whole GPU
    with pytest.raises(DeviceError) as full:
        fake.create_mig_device(0, "1g.10gb", 6)
    assert full.value.kind == "insufficient_resources"
    assert [m.profile for m in fake.read_gpu(0).mig_devices] == ["3g.40gb", "4g.40gb"]


def test_seven_1g_fill_the_gpu_and_slot_7_serves_only_7g():
    fake = enabled("h200-141gb")
    made = [fake.create_mig_device(0, "1g.18gb", s) for s in range(7)]
    assert len({m.uuid for m in made}) == 7
    with pytest.raises(DeviceError) as eighth:
        fake.create_mig_device(0, "1g.18gb", 6)
    assert eighth.value.kind == "insufficient_resources" and "all 7 instance(s)" in str(eighth.value)
    with pytest.raises(DeviceError) as at_seven:
        fake.create_mig_device(0, "1g.18gb", 7)
    assert at_seven.value.kind == "invalid_argument"


def test_compute_slices_limit_the_gpu_too():
    fake = enabled("a100-40gb")
    for start in (0, 2, 4, 6):  # four 1g.10gb fill all 8 memory slots with only 4 compute slices
        fake.create_mig_device(0, "1g.10gb", start)
    with pytest.raises(DeviceError) as exc:
        fake.create_mig_device(0, "1g.5gb", 1)
    assert exc.value.kind == "insufficient_resources"


def test_mig_needs_mig_mode_and_an_idle_gpu():
    fake = FakeBackend(gpus("a100-80gb"))
    with pytest.raises(DeviceError) as off:
        fake.create_mig_device(0, "1g.10gb", 0)
    assert off.value.kind == "invalid_state"
    fake.add_process(0, pid=4242, used_memory_bytes=GIB)
    with pytest.raises(DeviceError) as busy:
        fake.set_mig_mode(0, True)
    assert busy.value.kind == "in_use" and fake.read_gpu(0).mig_mode is False


def test_destroy_refuses_a_mig_device_in_use():
    fake = enabled()
    device = fake.create_mig_device(0, "2g.20gb", 2)
    fake.add_process(0, pid=77, used_memory_bytes=GIB, device_uuid=device.uuid)
    with pytest.raises(DeviceError) as exc:
        fake.destroy_mig_device(0, device.uuid)
    assert exc.value.kind == "in_use" and "[77]" in str(exc.value)
    with pytest.raises(DeviceError) as missing:
        fake.destroy_mig_device(0, "MIG-nope")
    assert missing.value.kind == "not_found"
    with pytest.raises(DeviceError) as off:
        fake.set_mig_mode(0, False)
    assert off.value.kind == "in_use"


@pytest.mark.parametrize("kind", ["no_permission", "in_use", "insufficient_resources"])
def test_injected_errors_fail_the_next_call_and_change_nothing(kind):
    fake = enabled()
    fake.inject("create_mig_device", kind)
    with pytest.raises(DeviceError) as exc:
        fake.create_mig_device(0, "1g.10gb", 0)
    assert exc.value.kind == kind
    assert fake.read_gpu(0).mig_devices == ()
    fake.create_mig_device(0, "1g.10gb", 0)  # the fault was used up
    assert [c[0] for c in fake.calls] == ["set_mig_mode", "create_mig_device", "create_mig_device"]


def test_injected_errors_on_mig_mode_and_reads():
    fake = FakeBackend(gpus())
    fake.inject("set_mig_mode", "no_permission", times=2)
    for _ in range(2):
        with pytest.raises(DeviceError, match="no_permission"):
            fake.set_mig_mode(0, True)
    fake.set_mig_mode(0, True)
    fake.inject("read_gpu", "unknown")
    with pytest.raises(DeviceError):
        read_inventory(fake)


def test_unavailable_fake_reads_as_a_cpu_inventory():
    fake = FakeBackend(gpus(), unavailable="no driver (test)")
    with pytest.raises(BackendUnavailable):
        fake.open()
    inventory = read_inventory(fake)
    assert inventory.is_cpu and inventory.source == "cpu" and "no driver (test)" in inventory.note


def test_mps_daemons_by_pipe_directory():
    fake = FakeBackend(gpus())
    fake.start_mps("/tmp/multiserve-mps/gpu0", pid=900)
    assert fake.read_mps().running and fake.read_mps().pipe_directories == ("/tmp/multiserve-mps/gpu0",)
    fake.stop_mps("/tmp/multiserve-mps/gpu0")
    assert not fake.read_mps().running
    with pytest.raises(DeviceError, match="not_found"):
        fake.stop_mps("/tmp/multiserve-mps/gpu0")
