"""A replica's CUDA memory share, through a stand-in for `torch.cuda` that takes devices as the real one does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from registry.fields import GIB
from runtimes.cuda_memory import default_kv_bytes, limit_process_memory


class StrictCuda:
    """`torch.cuda`'s memory calls, as strict as torch about their device argument: an int or an indexed
    `torch.device`; `torch.device("cuda")` names no device and is refused (torch's `_get_device_index`)."""

    def __init__(self, total: int = 80 * GIB, free: int = 70 * GIB, reserved: int = 4 * GIB,
                 current: int = 0) -> None:
        self.total, self.free, self.reserved, self.current = total, free, reserved, current
        self.fractions: dict[int, float] = {}

    @staticmethod
    def _index(device: Any) -> int:
        if isinstance(device, torch.device):
            if device.type != "cuda" or device.index is None:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            return device.index
        if isinstance(device, int):
            return device
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")

    def current_device(self) -> int:
        return self.current

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        self.fractions[self._index(device)] = fraction

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        return self.fractions.get(self._index(device), 1.0)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._index(device)
        return self.free, self.total

    def memory_reserved(self, device: Any = None) -> int:
        self._index(device)
        return self.reserved


def test_the_memory_cap_is_set_on_an_indexed_device():
    cuda = StrictCuda(current=0)
    with pytest.raises(ValueError, match="specified index"):  # what torch does with the unindexed device
        cuda.set_per_process_memory_fraction(0.25, torch.device("cuda"))
    assert limit_process_memory(0.25, torch.device("cuda"), cuda)  # the config's plain `device: cuda`
    assert limit_process_memory(0.5, torch.device("cuda", 1), cuda)
    assert cuda.fractions == {0: 0.25, 1: 0.5}
    assert not limit_process_memory(0.5, torch.device("cpu"), cuda)
    with pytest.raises(ValueError, match="memory fraction"):
        limit_process_memory(0.0, torch.device("cuda"), cuda)


def test_the_default_kv_budget_stays_inside_the_process_cap():
    cuda = StrictCuda(total=80 * GIB, free=70 * GIB, reserved=4 * GIB)
    device = torch.device("cuda")
    assert default_kv_bytes(device, 0.5, cuda) == 35 * GIB  # no cap: half the free memory
    limit_process_memory(0.25, device, cuda)  # 20 GiB for this process, 4 of which its weights hold
    assert default_kv_bytes(device, 0.5, cuda) == 8 * GIB
    cuda.reserved = 21 * GIB
    assert default_kv_bytes(device, 0.5, cuda) == 0  # over its cap already: no room (the engine then refuses)
