"""What one replica holds of its device's memory while it runs (`registry.launch.Footprint`), and each device's
budget when the registry names none: the numbers the pool admits replicas by (model_pool/residency.py).

On a GPU the footprint is the plan's: the replica's planned memory (weights + KV cache + overhead, planning/demand.py)
on its GPU's index (a MIG slice and an MPS share count on their GPU). On the CPU the host has no plan of sizes, so
it is counted here by the same model: the weights as their files hold them (the CPU engine keeps GGUF blocks packed
and maps the rest), the KV budget the engine will allocate (`engine.kv_cache_gib`, else `CPU_KV_CACHE_BYTES`), and
a worker process's own overhead (the interpreter, torch and the engine's buffers). `placement.memory_gib`, when
set, wins on either. A replica whose files are not on this machine (a `command` model, a package not installed)
has no known footprint and is not counted.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from partitioner.devices.inventory import Inventory
from partitioner.planning.plan import Plan
from registry.engine import EngineSpec, kv_cache_budget
from registry.fields import GIB, MIB
from registry.launch import Footprint, draft_launch
from registry.schema import ModelSpec, Registry
from registry.sources import resolve_model_path

# A CPU worker's resident memory beyond its weights and KV cache: the interpreter with torch and the engine loaded,
# and the engine's step buffers (measured for SmolLM2-135M: docs/on-demand.md).
CPU_PROCESS_OVERHEAD_BYTES = 512 * MIB


def replica_footprint(spec: ModelSpec, index: int, plan: Plan | None, registry: Registry | None = None) -> Footprint:
    """Replica `index` of `spec`: on its planned GPU, the plan's memory; else on the CPU, counted from its files (and
    its draft model's, which `registry` names)."""
    explicit = None if spec.placement.memory_gib is None else int(spec.placement.memory_gib * GIB)
    planned = None
    if plan is not None:
        try:
            planned = plan.replica(f"{spec.name}/{index}")
        except KeyError:
            planned = None
    if planned is not None and planned.gpu_index is not None:
        return Footprint(str(planned.gpu_index), explicit or planned.memory_bytes)
    if spec.device == "cuda":  # meant for a GPU the plan did not place it on: nothing known to count
        return Footprint("cpu", None)
    return Footprint("cpu", explicit or cpu_bytes(spec, registry))


def cpu_bytes(spec: ModelSpec, registry: Registry | None = None) -> int | None:
    """What a CPU replica of `spec` holds: its weight files, its KV budget and a worker's overhead, and with a draft
    model (speculative decoding) the draft's files and its KV cache, as large as the model's (None: its files are not
    on this machine, or another program serves it)."""
    if spec.launcher not in ("local", "ray") or spec.source is None or spec.source.kind == "url":
        return None
    try:
        weights = _files_bytes(resolve_model_path(spec.source_ref()))
    except (OSError, ValueError):
        return None
    kv = kv_cache_budget(spec.engine.kv_cache_bytes, device="cpu") if isinstance(spec.engine, EngineSpec) else 0
    draft, _ = draft_launch(spec, registry)
    if draft:
        kv *= 2
        with contextlib.suppress(OSError, ValueError):  # not on this machine (the replica will fail): its own bytes
            weights += _files_bytes(resolve_model_path(draft))
    return weights + kv + CPU_PROCESS_OVERHEAD_BYTES


def _files_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))


def device_budget(device: str, inventory: Inventory) -> int | None:
    """A device's memory when the registry sets no budget for it: a GPU's total, the host's physical memory."""
    if device == "cpu":
        return host_memory_bytes()
    try:
        return inventory.gpu(int(device)).memory_total_bytes
    except (KeyError, ValueError):
        return None


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
