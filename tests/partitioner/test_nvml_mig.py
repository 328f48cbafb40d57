"""The NVML backend's MIG changes (the applier's only privileged calls), run against a stand-in `pynvml` whose
rules are the fake backend's: NVML's call sequence, the device it reports back, and NVML errors as kinds."""

from __future__ import annotations

import pytest

from partitioner.devices.backend import DeviceError
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.nvml_backend import NvmlBackend
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
