"""`nvidia-cuda-mps-control` over a `FakeBackend`, as strict as the real tool, for the applier's tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from partitioner.applying.commands import CommandResult
from partitioner.devices.backend import DeviceError
from partitioner.devices.fake_backend import FakeBackend


class FakeMpsRunner:
    """Records every command (argv, env, stdin), refused ones too, and acts on the fake backend as the host would.

    `-d` starts a daemon on the device its CUDA_VISIBLE_DEVICES names: refused for a placeholder or a missing device,
    the whole GPU of one in MIG mode, or a pipe directory that already has a daemon. A control command (`quit`,
    `set_default_...`) needs a daemon in its pipe directory. `returncode` fails every command; `fail_on` fails the
    commands whose argv or stdin contain it (a failure in the middle of an apply).
    """

    def __init__(self, backend: FakeBackend, returncode: int = 0, fail_on: str | None = None) -> None:
        self.backend, self.returncode, self.fail_on = backend, returncode, fail_on
        self.commands: list[tuple[list[str], dict[str, str], str | None]] = []

    def run(self, argv: Sequence[str], env: Mapping[str, str], input_text: str | None = None) -> CommandResult:
        self.commands.append((list(argv), dict(env), input_text))
        if self.returncode:
            return CommandResult(self.returncode, "", "An instance of this daemon is already running")
        if self.fail_on is not None and self.fail_on in " ".join(argv) + (input_text or ""):
            return CommandResult(1, "", f"{self.fail_on}: refused (injected)")
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        if list(argv[1:]) == ["-d"]:
            try:
                self.backend.start_mps(pipe, pid=4000 + len(self.commands), device_uuid=env["CUDA_VISIBLE_DEVICES"])
            except DeviceError as exc:
                return CommandResult(1, "", str(exc))
            return CommandResult(0)
        if pipe not in self.backend.read_mps().pipe_directories:
            return CommandResult(1, "", f"Cannot find MPS control daemon process (pipe directory {pipe})")
        if input_text == "quit\n":
            self.backend.stop_mps(pipe)
        return CommandResult(0)
