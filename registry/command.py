"""`launcher: command`: any OpenAI-compatible server started by the pool as a replica, from an argument template.

A model's `command:` section names a preset (vLLM, SGLang or llama.cpp's server, whose arguments are known) or an
`argv` of its own, plus arguments appended to either. Templates take placeholders, filled in at each launch
(`CommandSpec.argv_for`): `{host}`, `{port}` (loopback, a port the pool chose), `{model_path}` (the model's source,
resolved), `{served_name}` (the name the server answers to), `{threads}` (CPU threads) and `{gpu_memory_fraction}`
(the share of its device's memory the partitioner planned, for vLLM's `--gpu-memory-utilization` and SGLang's
`--mem-fraction-static`). The replica's API key travels in its environment (`token_env`; presets know theirs), never
on its command line, where any local user could read it.

Everything that can be told before a start is told at validation, by field: an unknown preset or placeholder, a
binary that is not on this host.
"""

from __future__ import annotations

import shutil
import string
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from registry.errors import FieldProblems, Problem
from registry.fields import MAX_WAIT_S, EnvName, Frozen

Preset = Literal["vllm", "sglang", "llamacpp"]
PLACEHOLDERS = ("host", "port", "model_path", "served_name", "threads", "gpu_memory_fraction")
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # vLLM's own default, for a replica the partitioner gave no share (a CPU, no plan)


@dataclass(frozen=True)
class PresetTemplate:
    """A server's known command line: its usual executable, its arguments (after the executable), the path that
    answers 200 once it serves, and the variable it reads its API key from (None: it reads none)."""

    binary: str
    args: tuple[str, ...]
    health_path: str
    token_env: str | None


# Checked against each server's documented command line (tests/registry/test_command.py says where).
PRESETS: dict[str, PresetTemplate] = {
    "vllm": PresetTemplate(
        "vllm", ("serve", "{model_path}", "--host", "{host}", "--port", "{port}", "--served-model-name",
                 "{served_name}", "--gpu-memory-utilization", "{gpu_memory_fraction}"),
        "/health", "VLLM_API_KEY"),
    "sglang": PresetTemplate(
        "python3", ("-m", "sglang.launch_server", "--model-path", "{model_path}", "--host", "{host}", "--port",
                    "{port}", "--served-model-name", "{served_name}", "--mem-fraction-static",
                    "{gpu_memory_fraction}"),
        "/health", None),
    "llamacpp": PresetTemplate(
        "llama-server", ("--model", "{model_path}", "--host", "{host}", "--port", "{port}", "--alias",
                         "{served_name}", "--threads", "{threads}"),
        "/health", "LLAMA_API_KEY"),
}


class CommandSpec(Frozen):
    """How to start one replica of a `launcher: command` model: `preset` or `argv` (exactly one), then `args`."""

    preset: Preset | None = None
    argv: list[str] | None = Field(default=None, min_length=1)  # the executable first; placeholders allowed
    binary: str | None = Field(default=None, min_length=1)  # with a preset: its executable (a name on PATH or a path)
    args: list[str] = []  # appended to the preset's or argv's arguments
    health_path: str | None = Field(default=None, pattern=r"^/[A-Za-z0-9._~/-]*$")  # presets know theirs
    ready_timeout_s: float = Field(default=600.0, gt=0, le=MAX_WAIT_S)  # loading a large model takes minutes
    served_name: str | None = Field(default=None, min_length=1, max_length=256)  # default: the model's name
    threads: int | None = Field(default=None, ge=1, le=4096, strict=True)  # default: the CPUs this host gives us
    token_env: EnvName | None = None  # where the server reads its API key (presets know theirs)
    stop_grace_s: float = Field(default=30.0, gt=0, le=3600)  # SIGTERM, then SIGKILL to its process group

    @model_validator(mode="after")
    def _consistent(self) -> CommandSpec:
        problems: list[Problem] = []
        if (self.preset is None) == (self.argv is None):
            problems.append(Problem("preset", "give exactly one of preset (vllm, sglang, llamacpp) or argv"))
        if self.binary is not None and self.argv is not None:
            problems.append(Problem("binary", "only with a preset: argv's first item is its executable"))
        for field, items in (("argv", self.argv or []), ("args", self.args)):
            problems += [Problem(f"{field}[{i}]", message) for i, item in enumerate(items)
                         for message in _template_problems(item)]
        if not problems and shutil.which(self.executable) is None:
            where = "argv[0]" if self.argv is not None else "binary"
            problems.append(Problem(where, f"{self.executable!r} is not an executable on this host (not on PATH, "
                                           f"or not a file that can be run)"))
        if problems:
            raise FieldProblems(problems)
        return self

    @property
    def template(self) -> PresetTemplate | None:
        return None if self.preset is None else PRESETS[self.preset]

    @property
    def executable(self) -> str:
        if self.argv is not None:
            return self.argv[0]
        assert self.template is not None
        return self.binary or self.template.binary

    @property
    def probe_path(self) -> str:
        """The path that answers 200 once the server serves: `health_path`, else the preset's, else `/health`."""
        return self.health_path or (self.template.health_path if self.template is not None else "/health")

    @property
    def api_key_env(self) -> str | None:
        return self.token_env or (self.template.token_env if self.template is not None else None)

    def argv_for(self, values: dict[str, str]) -> list[str]:
        """The command line with every placeholder filled from `values` (all of PLACEHOLDERS)."""
        if self.argv is not None:
            head, rest = [self.argv[0]], [*self.argv[1:], *self.args]
        else:
            assert self.template is not None
            head, rest = [self.executable], [*self.template.args, *self.args]
        return head + [item.format_map(values) for item in rest]


def _template_problems(item: str) -> list[str]:
    """What is wrong with one templated argument: a placeholder that is not one of PLACEHOLDERS, or a brace that
    opens nothing (write `{{` and `}}` for literal braces)."""
    try:
        fields = [(name, spec or conversion) for _, name, spec, conversion in string.Formatter().parse(item)
                  if name is not None]
    except ValueError as err:
        return [f"{item!r} is not a valid template: {err} (write {{{{ and }}}} for literal braces)"]
    known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
    problems = [f"unknown placeholder {{{name}}} in {item!r}; known: {known}" for name, _ in fields
                if name not in PLACEHOLDERS]
    if any(formatted for _, formatted in fields):
        problems.append(f"{item!r}: a placeholder takes no conversion or format (plain {{name}} only)")
    return problems
