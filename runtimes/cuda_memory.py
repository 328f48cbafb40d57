"""A replica's share of its CUDA device's memory: the cap the partitioner planned, and the KV budget inside it.

CUDA's memory calls take an indexed device (`cuda:0`, or `0`): `torch.device("cuda")` names no device and
`torch.cuda.set_per_process_memory_fraction` refuses it. Every call here resolves the index first (the current
device when the config said just `cuda`; under `CUDA_VISIBLE_DEVICES` a replica sees its GPU or MIG device as 0).

`cuda` is `torch.cuda` unless a test passes a stand-in: nothing here runs without a GPU otherwise.
"""

from __future__ import annotations

from typing import Any

import torch


def device_index(device: torch.device, cuda: Any = None) -> int:
    """The CUDA device's index: its own, or the current device's when it names none."""
    cuda = cuda if cuda is not None else torch.cuda
    return int(device.index) if device.index is not None else int(cuda.current_device())


def limit_process_memory(fraction: float, device: torch.device, cuda: Any = None) -> bool:
    """Cap this process's CUDA allocations at `fraction` of the device (the partitioner's plan); the KV cache
    sizes itself inside that cap. No-op off CUDA (a CPU replica has no device memory to share). True if set."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    if device.type != "cuda":
        return False
    cuda = cuda if cuda is not None else torch.cuda
    cuda.set_per_process_memory_fraction(float(fraction), device_index(device, cuda))
    return True


def default_kv_bytes(device: torch.device, fraction: float, cuda: Any = None) -> int:
    """`fraction` of the memory this process may still take on `device`: the device's free memory, or what is
    left under the process's cap (`limit_process_memory`) if that is less. Called once the weights are loaded."""
    cuda = cuda if cuda is not None else torch.cuda
    index = device_index(device, cuda)
    free, total = cuda.mem_get_info(index)
    cap = int(total * cuda.get_per_process_memory_fraction(index))
    left_in_cap = cap - int(cuda.memory_reserved(index))
    return max(0, int(min(free, left_in_cap) * fraction))
