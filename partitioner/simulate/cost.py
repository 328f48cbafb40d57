"""The step-time model: how long one engine step takes on a share of a device (a roofline).

A step reads every weight once, reads the KV cache of every token its requests attend to, writes the KV of the
tokens it computes, and does two FLOPs per parameter per computed token. On its share it takes whichever is
longer, moving those bytes at the share's memory bandwidth or doing those FLOPs at the share's SMs:

    bytes = weights + (tokens attended + tokens computed) × kv_bytes_per_token
    flops = 2 × weights / bytes_per_parameter × tokens computed
    t     = calibration × max(bytes / (bandwidth × bandwidth_fraction), flops / (peak_flops × sm_fraction))

Attention FLOPs, activations, kernel launches and the scheduler's own time are left out; `calibration` (a
measured step time over the modelled one, `calibration_factor`) folds what a real device adds back in.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.planning.demand import ModelShape

# The LLM runtime holds weights in bf16 on a GPU (partitioner/planning/shapes.py), so a parameter is 2 bytes there.
BF16_BYTES_PER_PARAMETER = 2


@dataclass(frozen=True)
class DeviceSpeed:
    """A whole device's peaks: what its MIG slices, MPS shares and time-slices get fractions of."""

    name: str
    memory_bandwidth_bytes_per_s: float
    flops_per_s: float  # dense bf16 matrix throughput
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.memory_bandwidth_bytes_per_s > 0 and self.flops_per_s > 0):
            raise ValueError(f"{self.name}: memory bandwidth and FLOP/s must be > 0, got "
                             f"{self.memory_bandwidth_bytes_per_s:g} B/s and {self.flops_per_s:g} FLOP/s")


_DATASHEET = "NVIDIA product datasheet (SXM; dense BF16 Tensor Core, i.e. half the sparse figure)"
# By NVML name, as the shipped inventories (configs/inventories/) spell them.
GPU_SPEEDS = {speed.name: speed for speed in (
    DeviceSpeed("NVIDIA H200", 4.8e12, 989e12, _DATASHEET),
    DeviceSpeed("NVIDIA H100 80GB HBM3", 3.35e12, 989e12, _DATASHEET),
    DeviceSpeed("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12, _DATASHEET),
    DeviceSpeed("NVIDIA A100-SXM4-40GB", 1.555e12, 312e12, _DATASHEET),
)}


@dataclass(frozen=True)
class StepWork:
    """What one step does: tokens it computes, and tokens whose KV it attends to (including those it computes)."""

    computed_tokens: int
    attended_tokens: int


@dataclass(frozen=True)
class Share:
    """What a replica's kernels get of a device while they run: fractions of its SMs and of its bandwidth."""

    sm_fraction: float
    bandwidth_fraction: float

    def __post_init__(self) -> None:
        for name in ("sm_fraction", "bandwidth_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Share.{name} must be in (0, 1], got {value}")


def step_seconds(shape: ModelShape, work: StepWork, share: Share, speed: DeviceSpeed, calibration: float = 1.0,
                 bytes_per_parameter: int = BF16_BYTES_PER_PARAMETER) -> float:
    """The roofline time of one step (module docstring), times `calibration`."""
    kv_tokens = work.attended_tokens + work.computed_tokens
    memory_s = (shape.weights_bytes + kv_tokens * shape.kv_bytes_per_token) / (
        speed.memory_bandwidth_bytes_per_s * share.bandwidth_fraction)
    flops = 2 * shape.weights_bytes / bytes_per_parameter * work.computed_tokens
    compute_s = flops / (speed.flops_per_s * share.sm_fraction)
    return calibration * max(memory_s, compute_s)


def calibration_factor(measured_step_s: float, shape: ModelShape, work: StepWork, share: Share, speed: DeviceSpeed,
                       bytes_per_parameter: int = BF16_BYTES_PER_PARAMETER) -> float:
    """How much longer a measured step took than the model says for the same work: the factor that makes the model
    reproduce it. Raises ValueError for a step time that is not positive."""
    if not measured_step_s > 0:
        raise ValueError(f"measured step time must be > 0 s, got {measured_step_s}")
    return measured_step_s / step_seconds(shape, work, share, speed, 1.0, bytes_per_parameter)
