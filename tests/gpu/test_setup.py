"""tests/gpu/run.sh's setup, order and budget, and summarize.py's verdicts, on CPU.

The setup test builds a bare host from this test's own Python (the repo's venv): a venv made from it, without
pip, that sees only torch, triton, transformers, nvidia-ml-py, numpy and what they require, and a wheel folder
repacked from the installed copies of the project's other dependencies. A venv made from such a host with
`--system-site-packages` would see the base interpreter's packages, not the host's torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.gpu.fetch_wheels import HOST_PROVIDED, pins_name, project_dependencies, wanted

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "tests" / "gpu" / "run.sh"
HOST_PACKAGES = ["torch", "triton", "transformers", "nvidia-ml-py", "numpy"]
HEADROOM_S = 60
# cheap, high-value checks first; the long step-time table last before vLLM, whose start-up is the longest wait
ORDER = ["attention", "quant", "model", "serve", "partitioner", "steptime", "vllm"]


def closure(names: list[str]) -> dict[str, Distribution]:
    """The installed distributions `names` need, with everything they require on this Python (no extras)."""
    env = {**default_environment(), "extra": ""}
    found: dict[str, Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(Requirement(todo.pop()).name)
        if name in found:
            continue
        try:
            found[name] = distribution(name)
        except PackageNotFoundError:  # an optional dependency this venv does not have
            continue
        for spec in found[name].requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return found


def site_files(dist: Distribution) -> list[Path]:
    """The distribution's files inside site-packages (no scripts, no bytecode)."""
    return [Path(f) for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in str(f)]


def repack(dist: Distribution, dest: Path) -> None:
    """An installed distribution as a wheel again (tagged py3-none-any: it is only installed on this Python)."""
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    version = dist.version
    info = f"{name}-{version}.dist-info"
    entries: dict[str, bytes] = {}
    for rel in site_files(dist):
        if rel.parts[0].endswith(".dist-info"):
            if rel.name in ("METADATA", "entry_points.txt", "top_level.txt"):
                entries[f"{info}/{rel.name}"] = Path(str(dist.locate_file(rel))).read_bytes()
            continue
        entries[str(rel)] = Path(str(dist.locate_file(rel))).read_bytes()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test_setup\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in entries.items()]
    entries[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, data in entries.items():
            whl.writestr(path, data)


@pytest.fixture
def bare_host(tmp_path: Path) -> Path:
    """A host Python that is a venv made from a venv, without pip, that imports torch and lacks the rest."""
    host_site = tmp_path / "host-site"
    host_site.mkdir()
    for dist in closure(HOST_PACKAGES).values():
        for top in {rel.parts[0] for rel in site_files(dist)}:
            link = host_site / top
            if not link.exists() and not top.endswith(".pth"):
                link.symlink_to(Path(str(dist.locate_file(top))))
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(host)], check=True)
    (site_packages,) = host.glob("lib/python*/site-packages")
    (site_packages / "host.pth").write_text(f"{host_site}\n")
    return host / "bin" / "python"


@pytest.fixture
def wheel_folder(tmp_path: Path) -> Path:
    """What `make gpu-wheels` would give for this Python, from the installed copies: the wheels and the pin file."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    needed = {n: d for n, d in closure(wanted(project_dependencies(ROOT / "pyproject.toml"))).items()
              if n not in HOST_PROVIDED and not n.startswith("nvidia-")}
    for dist in [*needed.values(), distribution("pip")]:
        repack(dist, wheels)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (wheels / pins_name(version, platform.machine())).write_text(
        "".join(f"{n}=={d.version}\n" for n, d in sorted(needed.items())))
    return wheels


def run_setup(python: Path, wheels: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(python), GPU_CHECK_DEVICE="cpu", GPU_CHECK_ONLY="setup", GPU_WHEELS=str(wheels),
               GPU_SITE=str(tmp_path / "site"), OUT=str(out), PATH=f"{python.parent}:{env['PATH']}")
    done = subprocess.run(["bash", str(RUN_SH)], env=env, capture_output=True, text=True, timeout=300)
    return done, out


def test_setup_installs_into_a_folder_for_a_host_python_that_is_a_venv(bare_host: Path, wheel_folder: Path,
                                                                      tmp_path: Path) -> None:
    probe = subprocess.run([str(bare_host), "-c", "import torch, transformers; import structlog"],
                           capture_output=True, text=True)
    assert "No module named 'structlog'" in probe.stderr, probe.stderr  # the host lacks the project's dependencies
    done, out = run_setup(bare_host, wheel_folder, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^PASS setup\.install \d+ wheels for Python", done.stdout, re.M), done.stdout
    assert "PASS setup.imports" in done.stdout, done.stdout
    environment = json.loads((out / "environment.json").read_text())
    assert environment["executable"] == str(bare_host)
    assert environment["packages"]["torch"] == distribution("torch").version
    assert (tmp_path / "site" / "pydantic").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failed"] == []


def test_setup_names_the_pythons_the_wheel_folder_covers(bare_host: Path, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / pins_name("3.99", "riscv64")).write_text("")
    done, _ = run_setup(bare_host, wheels, tmp_path)
    assert done.returncode == 1
    assert "FAIL setup.install no wheels for Python" in done.stdout
    assert "it has: 3.99-riscv64" in done.stdout, done.stdout


def run_checks() -> list[tuple[str, str]]:
    """(group, cap) of each `run_check` line in run.sh, in order."""
    return re.findall(r"^\s*run_check (\w+) (\S+) tests/gpu/check_\w+\.py", RUN_SH.read_text(), re.M)


def test_checks_run_cheap_first_and_leave_headroom_in_the_budget() -> None:
    budget = int(re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", RUN_SH.read_text()).group(1))  # type: ignore[union-attr]
    checks = run_checks()
    assert [group for group, _ in checks] == ORDER
    # vLLM takes what is left (GPU_CHECK_VLLM_TIMEOUT_S caps it); every other cap is a number within the budget
    caps = {group: int(cap) for group, cap in checks if group != "vllm"}
    assert sum(caps.values()) <= budget - HEADROOM_S, caps


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_summary_has_a_verdict_per_group_when_one_timed_out(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "groups.jsonl", [
        {"group": "setup", "rc": 0, "duration_s": 9},
        {"group": "model", "rc": 124, "duration_s": 110, "timeout_s": 110},
        {"group": "serve", "rc": 0, "duration_s": 30, "timeout_s": 65},
        {"group": "steptime", "rc": 125, "duration_s": 0, "timeout_s": 12},
    ])
    write_jsonl(tmp_path / "setup.jsonl", [{"name": "setup.imports", "ok": True}])
    write_jsonl(tmp_path / "model.jsonl", [{"name": "model.logits", "ok": True}])
    write_jsonl(tmp_path / "serve.jsonl", [{"name": "serve.worker", "ok": True},
                                           {"name": "serve.vllm", "ok": True, "skipped": "no vllm"}])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "summarize.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()}
    assert lines["setup"].split()[1] == "PASS"
    assert lines["model"].split()[1] == "FAIL" and "timed out after 110 s" in lines["model"], lines["model"]
    assert "1 passed, 1 failed" in lines["model"]
    assert lines["serve"].split()[1] == "PASS" and "1 skipped" in lines["serve"]
    assert "NOT RUN" in lines["steptime"]
