"""`make gpu-wheels`: download the wheels a CUDA host without network needs to run tests/gpu/run.sh.

Such a host has Python with CUDA torch, triton, transformers (and so numpy, tokenizers, safetensors, PyYAML,
huggingface-hub) and nvidia-ml-py; this fetches every other runtime dependency of the project (pyproject.toml
`[project] dependencies`) with its own dependencies, as manylinux wheels for each Python version and machine
asked for, plus pip itself (run.sh installs with it when the host Python has none). matplotlib and uvloop are left
out (see NOT_NEEDED). For each Python version and machine the folder gets `pins-<version>-<machine>.txt`, every
wheel that combination needs pinned (run.sh installs exactly these, `--no-deps`), and `manifest.json` says what was
resolved for which.

pip resolves for a foreign Python version but evaluates environment markers for the one running it, so the
dependencies that only an older Python needs (anyio's `exceptiongroup` on 3.10) are found here by evaluating
each resolved package's markers for the target version, and resolved again until nothing is missing.

    python tests/gpu/fetch_wheels.py --dest tests/gpu/wheels --python-versions "3.10 3.14" --archs "x86_64 aarch64"
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip vendors it; a bare machine with pip has no other copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
# On the GPU host already (CUDA torch and its runtime, triton, transformers and what it requires) or too big to
# ship per Python version; run.sh checks that they import.
HOST_PROVIDED = {"torch", "triton", "numpy", "tokenizers", "safetensors", "pyyaml", "transformers",
                 "huggingface-hub", "nvidia-ml-py", "setuptools"}
# matplotlib: only `multiserve bench plot` imports it. uvloop: uvicorn uses it when present and asyncio's loop
# otherwise; the checks do not measure the gateway's per-hop cost it is there for, and its wheels are 4 MB per
# Python version, half the folder.
NOT_NEEDED = {"matplotlib", "uvloop"}


def project_dependencies(pyproject: Path) -> list[str]:
    text = pyproject.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the one list this needs, read by hand
        block = re.search(r"^\[project\].*?^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        if block is None:
            raise SystemExit(f"no [project] dependencies in {pyproject}") from None
        return re.findall(r"^\s*\"([^\"]+)\"", block.group(1), re.M)
    return list(tomllib.loads(text)["project"]["dependencies"])


def wanted(requirements: list[str]) -> list[str]:
    """The project's requirements that the wheel folder must provide."""
    keep = []
    for spec in requirements:
        name = canonicalize_name(Requirement(spec).name)
        if name not in HOST_PROVIDED and name not in NOT_NEEDED and not name.startswith("nvidia-"):
            keep.append(spec)
    return keep


def platform_args(version: str, arch: str) -> list[str]:
    abi = "cp" + version.replace(".", "")
    platforms = [f"manylinux2014_{arch}", f"manylinux_2_17_{arch}", f"manylinux_2_28_{arch}"]
    return ["--only-binary=:all:", *(a for p in platforms for a in ("--platform", p)), "--python-version", version,
            "--implementation", "cp", "--abi", abi]


def resolve(requirements: list[str], version: str, arch: str) -> dict[str, dict]:
    """name -> the report entry of each package pip would install for this Python (dry run, metadata only)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                        "--report", str(report), "--target", str(Path(tmp) / "target"),
                        *platform_args(version, arch), *requirements], check=True)
        entries = json.loads(report.read_text())["install"]
    return {canonicalize_name(e["metadata"]["name"]): e for e in entries}


def missing_for(resolved: dict[str, dict], version: str, arch: str) -> list[str]:
    """Requirements of the resolved packages that hold on the target Python but were not resolved."""
    env = {**default_environment(), "python_version": version, "python_full_version": f"{version}.0",
           "platform_machine": arch, "sys_platform": "linux", "platform_system": "Linux"}
    missing = []
    for entry in resolved.values():
        for spec in entry["metadata"].get("requires_dist", []):
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            if canonicalize_name(req.name) not in resolved:
                missing.append(f"{req.name}{req.specifier}")
    return missing


def pins_name(version: str, arch: str) -> str:
    """The pin file run.sh looks for on a host running Python `version` (major.minor) on machine `arch`."""
    return f"pins-{version}-{arch}.txt"


def pins_for(requirements: list[str], version: str, arch: str) -> tuple[dict[str, str], list[str]]:
    """name -> version of every wheel this Python and machine need beyond the host's, and the requirements added
    because their markers hold only there."""
    extra: list[str] = []
    for _ in range(5):
        resolved = resolve(requirements + extra, version, arch)
        more = [spec for spec in missing_for(resolved, version, arch) if spec not in extra]
        if not more:
            break
        extra += more
    pins = {name: e["metadata"]["version"] for name, e in resolved.items()
            if name not in HOST_PROVIDED and not name.startswith("nvidia-")}
    return pins, extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / "tests" / "gpu" / "wheels")
    parser.add_argument("--python-versions", default="3.10 3.11 3.12 3.13 3.14")
    parser.add_argument("--archs", default="x86_64 aarch64", help="machines, as platform.machine() names them")
    args = parser.parse_args()
    requirements = wanted(project_dependencies(ROOT / "pyproject.toml"))
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in [*args.dest.glob("*.whl"), *args.dest.glob("pins-*.txt"), args.dest / "requirements.txt"]:
        old.unlink(missing_ok=True)
    manifest: dict[str, object] = {"host_provided": sorted(HOST_PROVIDED), "not_needed": sorted(NOT_NEEDED),
                                   "requirements": requirements, "python": {}}
    for arch in args.archs.split():
        for version in args.python_versions.split():
            pins, extra = pins_for(requirements, version, arch)
            lines = [f"{n}=={v}" for n, v in sorted(pins.items())]
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
                            str(args.dest), *platform_args(version, arch), *lines], check=True)
            (args.dest / pins_name(version, arch)).write_text(
                f"# written by tests/gpu/fetch_wheels.py: what Python {version} on {arch} needs beyond the host's "
                "packages\n" + "".join(f"{line}\n" for line in lines))
            manifest["python"][f"{version}-{arch}"] = {  # type: ignore[index]
                "packages": pins, "added_for_markers": extra}
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(args.dest), "pip"], check=True)
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in args.dest.iterdir() if p.is_file())
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {size / 1e6:.1f} MB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
