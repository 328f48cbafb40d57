"""MIG placement rules, shared by the planner and the fake backend so both judge a layout the same way.

A GPU instance of a profile covers `memory_slices` slots starting at one of the profile's valid starts (NVML's
`{starts}:size`, `nvidia-smi mig -lgipp`); instances may not overlap, a profile has at most `max_instances`
instances, and the compute slices of all instances add up to at most the GPU's (7 on A100/H100/H200).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.devices.backend import ErrorKind
from partitioner.devices.inventory import GpuDevice, MigDevice, MigProfile


@dataclass(frozen=True)
class Slot:
    """One GPU instance on the memory-slot axis, existing or planned."""

    profile: str
    start: int
    size: int
    slices: int

    @classmethod
    def of(cls, device: MigDevice) -> Slot:
        return cls(device.profile, device.start if device.start is not None else -1, device.memory_slices,
                   device.slice_count)


def max_compute_slices(gpu: GpuDevice) -> int:
    """The GPU's compute slices: those of its largest profile (7g)."""
    return max((p.slice_count for p in gpu.mig_profiles), default=0)


def plannable_profiles(gpu: GpuDevice) -> list[MigProfile]:
    """Profiles the planner may create, smallest first: no media-extension (`+me`) variants, which exist to carry
    decoders an LLM replica does not need, and none NVML gave no placements for."""
    usable = [p for p in gpu.mig_profiles if "+" not in p.name and p.placements]
    return sorted(usable, key=lambda p: (p.memory_bytes, p.slice_count, p.profile_id))


def placement_conflict(profile: MigProfile, start: int, taken: Sequence[Slot],
                       max_slices: int) -> tuple[ErrorKind, str] | None:
    """Why `profile` cannot be created at `start` next to `taken` (the NVML error kind and a message), or None."""
    if start not in profile.placements:
        return "invalid_argument", f"{profile.name} cannot start at slot {start} (valid: {list(profile.placements)})"
    same = sum(1 for t in taken if t.profile == profile.name)
    if same >= profile.max_instances:
        return "insufficient_resources", f"{profile.name}: all {profile.max_instances} instance(s) already exist"
    end = start + profile.memory_slices
    for t in taken:
        if start < t.start + t.size and t.start < end:
            return ("insufficient_resources",
                    f"{profile.name} at slots {start}-{end - 1} overlaps {t.profile} at slots {t.start}-"
                    f"{t.start + t.size - 1}")
    used = sum(t.slices for t in taken)
    if used + profile.slice_count > max_slices:
        return ("insufficient_resources",
                f"{profile.name} needs {profile.slice_count} compute slice(s); {max_slices - used} left")
    return None


def fit_placements(requests: Sequence[MigProfile], taken: Sequence[Slot], max_slices: int) -> tuple[int, ...] | None:
    """Start slots for every requested profile (in request order) next to the `taken` ones, or None if there is
    no valid layout. Exhaustive (a GPU has 8 slots), largest first, lowest start first: deterministic."""
    if sum(p.slice_count for p in requests) + sum(t.slices for t in taken) > max_slices:
        return None
    order = sorted(range(len(requests)), key=lambda i: (-requests[i].memory_slices, -requests[i].slice_count,
                                                        requests[i].name, i))
    starts = [0] * len(requests)

    def solve(k: int, placed: list[Slot]) -> bool:
        if k == len(order):
            return True
        i = order[k]
        profile = requests[i]
        # identical requests are interchangeable: trying them in increasing start order skips permutations
        floor = starts[order[k - 1]] + 1 if k and requests[order[k - 1]] == profile else 0
        for start in profile.placements:
            if start >= floor and placement_conflict(profile, start, placed, max_slices) is None:
                starts[i] = start
                slot = Slot(profile.name, start, profile.memory_slices, profile.slice_count)
                if solve(k + 1, [*placed, slot]):
                    return True
        return False

    return tuple(starts) if solve(0, list(taken)) else None
