"""The command-runner seam: the applier runs host tools (`nvidia-cuda-mps-control`) only through it.

`SubprocessRunner` runs them for real; tests pass a recorder with the same shape and assert the exact commands.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], env: Mapping[str, str], input_text: str | None = None) -> CommandResult:
        """Run `argv` with `env` added to this process's environment, `input_text` on stdin; never raise for a
        non-zero exit (the result says it), only for a program that cannot start (OSError)."""
        ...


class SubprocessRunner:
    """Runs commands as child processes, each bounded by `timeout_s` (a daemon's `-d` returns once it forked)."""

    def __init__(self, base_env: Mapping[str, str], timeout_s: float = 30.0) -> None:
        self.base_env = dict(base_env)
        self.timeout_s = timeout_s

    def run(self, argv: Sequence[str], env: Mapping[str, str], input_text: str | None = None) -> CommandResult:
        try:
            done = subprocess.run(list(argv), env={**self.base_env, **env}, input=input_text, capture_output=True,
                                  text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return CommandResult(124, "", f"{argv[0]} did not finish within {self.timeout_s:g} s")
        return CommandResult(done.returncode, done.stdout, done.stderr)
