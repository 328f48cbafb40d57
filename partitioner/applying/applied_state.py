"""What the applier changed on this host, kept in a small JSON file: the MIG devices it created and the MPS
daemons it started (with the defaults it set). Only these are ever destroyed or stopped by a later apply;
MIG devices and daemons that somebody else made are left alone."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_STATE_FILE = ".multiserve/partition-state.json"


@dataclass
class MpsDaemonState:
    gpu_index: int
    device_uuid: str
    log_directory: str
    settings: list[str] = field(default_factory=list)  # control commands applied, e.g. "set_default_..."


@dataclass
class AppliedState:
    mig_devices: dict[str, int] = field(default_factory=dict)  # uuid -> GPU index
    mps_daemons: dict[str, MpsDaemonState] = field(default_factory=dict)  # by pipe directory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AppliedStateFile:
    """Loads and saves `AppliedState` at `path` (a missing file is an empty state)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> AppliedState:
        if not self.path.exists():
            return AppliedState()
        try:
            data = json.loads(self.path.read_text())
            return AppliedState(mig_devices={str(k): int(v) for k, v in data.get("mig_devices", {}).items()},
                                mps_daemons={str(k): MpsDaemonState(**v)
                                             for k, v in data.get("mps_daemons", {}).items()})
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{self.path}: not an applied-state file ({exc}); move it away to start afresh") \
                from None

    def save(self, state: AppliedState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_dict(), indent=2) + "\n")
        tmp.replace(self.path)  # a crash mid-write leaves the old state, never half a file
