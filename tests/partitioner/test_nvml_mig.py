"""The NVML backend's MIG changes (the applier's only privileged calls), run against a stand-in `pynvml` whose
rules are the fake backend's: NVML's call sequence, the device it reports back, and NVML errors as kinds."""

from __future__ import annotations

import ctypes

import pytest

from partitioner.devices.backend import DeviceError
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.nvml_backend import NvmlBackend
from tests.partitioner import fake_nvml
from tests.partitioner.conftest import gpus
from tests.partitioner.fake_nvml import FakeNvmlMig


def opened() -> tuple[NvmlBackend, FakeNvmlMig, FakeBackend]:
    rules = FakeBackend(gpus("h100-80gb"))
    rules.set_mig_mode(0, True)  # the operator's step
    nvml = FakeNvmlMig(rules)
    backend = NvmlBackend(nvml=nvml)  # type: ignore[arg-type]
    backend.open()
    return backend, nvml, rules


def test_create_makes_a_gpu_instance_with_its_full_compute_instance_and_reports_the_mig_device():
    backend, nvml, rules = opened()
    made = backend.create_mig_device(0, "3g.40gb", 4)
    assert (made.profile, made.start, made.slice_count) == ("3g.40gb", 4, 3)
    assert made.uuid == rules.snapshot().devices[0].mig_devices[0].uuid
    assert nvml.calls == [("create_gpu_instance", (0, "3g.40gb", 4)),
                          ("create_compute_instance", (0, 2))]  # compute profile 3_SLICE
    backend.destroy_mig_device(0, made.uuid)
    assert [c[0] for c in nvml.calls[2:]] == ["destroy_compute_instance", "destroy_gpu_instance"]
    assert rules.snapshot().devices[0].mig_devices == ()


@pytest.mark.parametrize("kind", ["no_permission", "insufficient_resources"])
def test_nvml_errors_become_kinds_naming_the_action(kind):
    backend, _, rules = opened()
    rules.inject("create_mig_device", kind)
    with pytest.raises(DeviceError) as exc:
        backend.create_mig_device(0, "1g.10gb", 2)
    assert exc.value.kind == kind and "GPU 0: create MIG device 1g.10gb at slot 2" in str(exc.value)


def test_destroying_a_device_in_use_is_in_use_and_an_unknown_profile_is_refused():
    backend, _, rules = opened()
    made = backend.create_mig_device(0, "2g.20gb", 2)
    rules.add_process(0, pid=77, used_memory_bytes=1 << 30, device_uuid=made.uuid)
    with pytest.raises(DeviceError) as exc:
        backend.destroy_mig_device(0, made.uuid)
    assert exc.value.kind == "in_use"
    with pytest.raises(DeviceError, match=r"no MIG profile '9g\.99gb'"):
        backend.create_mig_device(0, "9g.99gb", 0)


def test_create_hands_nvml_a_pointer_to_the_placement_not_the_struct():
    """pynvml passes the placement to C unchanged; a Structure there goes by value and C reads it as an address."""
    backend, nvml, _ = opened()
    seen = []
    create = nvml.nvmlDeviceCreateGpuInstanceWithPlacement

    def spy(handle, profile_id, placement):
        seen.append(placement)
        return create(handle, profile_id, placement)

    nvml.nvmlDeviceCreateGpuInstanceWithPlacement = spy
    backend.create_mig_device(0, "3g.40gb", 4)
    (placement,) = seen
    assert not isinstance(placement, ctypes.Structure)
    where = fake_nvml._points_to("create", "placement", placement, fake_nvml.c_nvmlGpuInstancePlacement_t)
    assert (where.start, where.size) == (4, 4)  # 3g.40gb takes 4 of the 8 memory slices


def _placement(start: int = 0, size: int = 1) -> fake_nvml.c_nvmlGpuInstancePlacement_t:
    return fake_nvml.c_nvmlGpuInstancePlacement_t(start, size)


@pytest.mark.parametrize("by_value", [_placement(), ctypes.c_uint(0), 0, None])
def test_the_stand_in_refuses_what_c_would_read_as_an_address(by_value):
    _, nvml, _ = opened()
    profile = next(p for p in nvml.gpus[0].mig_profiles if p.name == "1g.10gb")
    with pytest.raises(TypeError, match=r"placement is a \w+ (passed by value|not a pointer), but C takes a"):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(("gpu", 0), profile.profile_id, by_value)
    assert nvml.calls == []


@pytest.mark.parametrize("as_pointer", [ctypes.byref, ctypes.pointer,
                                        lambda p: (fake_nvml.c_nvmlGpuInstancePlacement_t * 1)(p)])
def test_the_stand_in_takes_what_c_takes_as_a_pointer(as_pointer):
    _, nvml, rules = opened()
    profile = next(p for p in nvml.gpus[0].mig_profiles if p.name == "1g.10gb")
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(("gpu", 0), profile.profile_id,
                                                  as_pointer(_placement(2, profile.memory_slices)))
    assert [(m.profile, m.start) for m in rules.snapshot().devices[0].mig_devices] == [("1g.10gb", 2)]


def test_the_stand_in_refuses_a_placement_size_nvml_would_refuse():
    _, nvml, rules = opened()
    profile = next(p for p in nvml.gpus[0].mig_profiles if p.name == "3g.40gb")
    with pytest.raises(fake_nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(("gpu", 0), profile.profile_id, ctypes.byref(_placement(4, 3)))
    assert rules.snapshot().devices[0].mig_devices == ()


@pytest.mark.parametrize(("array", "count", "error"), [
    ([None] * 16, ctypes.byref(ctypes.c_uint(16)), "placements is a list not a pointer"),
    (_placement(), ctypes.byref(ctypes.c_uint(16)), "passed by value"),
    ((fake_nvml.c_nvmlGpuInstancePlacement_t * 16)(), ctypes.c_uint(16), "count is a c_uint passed by value"),
    ((fake_nvml.c_nvmlGpuInstancePlacement_t * 16)(), 16, "count is a int passed by value"),
    ((ctypes.c_uint * 16)(), ctypes.byref(ctypes.c_uint(16)), "must be a ctypes array of c_nvmlGpuInstancePlacement"),
])
def test_the_stand_in_fills_only_arrays_and_counts_passed_as_pointers(array, count, error):
    _, nvml, _ = opened()
    with pytest.raises(TypeError, match=error):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(("gpu", 0), nvml.gpus[0].mig_profiles[0].profile_id,
                                                        array, count)


@pytest.mark.parametrize(("array", "count", "error"), [
    ([None], ctypes.byref(ctypes.c_uint(1)), "computeInstances is a list not a pointer"),
    ((fake_nvml.c_nvmlComputeInstance_t * 1)(), ctypes.c_uint(1), "count is a c_uint passed by value"),
    ((fake_nvml.c_nvmlComputeInstance_t * 1)(), ctypes.byref(ctypes.c_int(1)), "count points at a c_int"),
])
def test_the_stand_in_fills_compute_instances_only_through_pointers(array, count, error):
    _, nvml, _ = opened()
    with pytest.raises(TypeError, match=error):
        nvml.nvmlGpuInstanceGetComputeInstances(("gi", 0, 0), 0, array, count)


def test_the_stand_in_refuses_an_array_nvml_would_overrun():
    _, nvml, _ = opened()
    one_g = next(p for p in nvml.gpus[0].mig_profiles if p.name == "1g.10gb")  # seven placements
    count = ctypes.c_uint(2)
    with pytest.raises(AssertionError, match="overrun"):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            ("gpu", 0), one_g.profile_id, (fake_nvml.c_nvmlGpuInstancePlacement_t * 2)(), ctypes.pointer(count))


def test_pynvml_forwards_these_arguments_to_c_unchanged(monkeypatch):
    """Why the stand-in is strict: the installed pynvml hands the caller's objects to the C function as they are."""
    pynvml = pytest.importorskip("pynvml")
    forwarded: dict[str, tuple] = {}

    def function_pointer(name):
        def c_function(*args):
            forwarded[name] = args
            return pynvml.NVML_SUCCESS
        return c_function

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", function_pointer)
    placement, placements = pynvml.c_nvmlGpuInstancePlacement_t(), (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    instances, count = (pynvml.c_nvmlComputeInstance_t * 1)(), ctypes.byref(ctypes.c_uint(1))
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement("device", 9, placement)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements("device", 9, placements, count)
    pynvml.nvmlGpuInstanceGetComputeInstances("instance", 2, instances, count)
    assert forwarded["nvmlDeviceCreateGpuInstanceWithPlacement"][2] is placement
    assert forwarded["nvmlDeviceGetGpuInstancePossiblePlacements_v2"][2:] == (placements, count)
    assert forwarded["nvmlGpuInstanceGetComputeInstances"][2:] == (instances, count)
