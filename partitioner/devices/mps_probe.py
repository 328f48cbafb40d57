"""Is an MPS control daemon running? Found without privileges: a scan of /proc and of pipe directories."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from partitioner.devices.inventory import MpsStatus

MPS_CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where the daemon and its clients meet without CUDA_MPS_PIPE_DIRECTORY
MULTISERVE_PIPE_ROOT = "/tmp/multiserve-mps"  # ours: one pipe directory per device below it (`gpu0`, ...)


def candidate_pipe_directories(env: Mapping[str, str], own_root: str = MULTISERVE_PIPE_ROOT) -> list[str]:
    """The default pipe directory, the one the environment names, and each device directory under our root."""
    dirs = [DEFAULT_PIPE_DIRECTORY]
    if env.get("CUDA_MPS_PIPE_DIRECTORY"):
        dirs.append(env["CUDA_MPS_PIPE_DIRECTORY"])
    root = Path(own_root)
    if root.is_dir():
        dirs += sorted(str(p) for p in root.iterdir() if p.is_dir())
    return list(dict.fromkeys(dirs))


def probe_mps(pipe_directories: Iterable[str], proc_root: str | Path = "/proc") -> MpsStatus:
    """Control daemons by their command line (`comm` is cut to 15 characters, so it cannot tell control from
    server), and the pipe directories whose `control` pipe exists."""
    pids = []
    proc = Path(proc_root)
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:  # the process ended, or it is not ours to read
            continue
        if Path(argv0.decode(errors="replace")).name == MPS_CONTROL:
            pids.append(int(entry.name))
    live = [d for d in pipe_directories if (Path(d) / "control").exists()]
    return MpsStatus(control_pids=tuple(sorted(pids)), pipe_directories=tuple(live))
