"""What a wheel carries beside the Python modules: every C++ kernel source the runtime compiles on first use is package
data (an installed, not editable, copy would otherwise have no kernel to build and fall back, or fail), and so is the
top-level configs/ folder (the default registry, the GPU inventories, the model shapes, the examples), which the wheel
holds as foundation/configs/ and the code finds there once installed. The wheel is built from a copy of the tree, as
`pip wheel` would build it, and unpacked; a fresh Python that imports the project from the unpacked copy loads every
shipped config file."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration  # reads TOML on Python 3.10 too (no tomllib)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
WHEEL_CONFIGS = "foundation/configs"  # where the wheel holds configs/ (setup.py's package_dir)
# Every top-level package of the tree (a folder with an __init__.py) but the tests: what the wheel must carry.
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")
NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "build", "*.egg-info")


def test_every_kernel_source_is_package_data():
    package_data = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    sources = sorted(ROOT.glob("runtimes/**/*.cpp"))
    assert sources
    for source in sources:
        package = ".".join(source.parent.relative_to(ROOT).parts)
        patterns = package_data.get(package, [])
        assert any(fnmatch.fnmatch(source.name, p) for p in patterns), f"{source.relative_to(ROOT)} is not package data"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built by setuptools' PEP 517 hook (what `pip wheel --no-build-isolation` calls) from a
    copy of the tree, so no build/ folder of an earlier build leaks into it and the checkout stays as it was."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "src", tmp / "dist"
    source.mkdir()
    out.mkdir()
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, source / name)
    for name in (*PACKAGES, "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=NOT_SOURCE)
    script = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_carries_every_module_and_kernel_source(wheel: Path):
    """setup.py finds the packages: a package added to the tree is in the wheel without a list to update."""
    names = _names(wheel)
    sources = [p for name in PACKAGES for p in (ROOT / name).rglob("*") if p.suffix in (".py", ".cpp")
               and "__pycache__" not in p.parts]
    missing = sorted(str(p.relative_to(ROOT)) for p in sources if p.relative_to(ROOT).as_posix() not in names)
    assert not missing, f"not in the wheel: {missing}"


def test_the_wheel_carries_every_config_file_as_foundation_configs(wheel: Path):
    names = _names(wheel)
    shipped = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*") if p.is_file())
    for must in ("default.yaml", "variants.yaml", "model_shapes.json", "README.md", "inventories/h200-141gb.json",
                 "examples/h200-three-models/registry.yaml"):
        assert must in shipped
    missing = [name for name in shipped if f"{WHEEL_CONFIGS}/{name}" not in names]
    assert not missing, f"configs/ files not in the wheel: {missing}"
    assert not [n for n in names if n.startswith("configs/")], "the wheel must not claim a top-level `configs`"


# Run by a fresh Python whose sys.path starts with the unpacked wheel (the editable install's finder comes after the
# path, so the unpacked copy is what gets imported): the config files load where an installed wheel holds them.
LOAD_ALL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import foundation
from foundation.config_files import CONFIG_DIR, config_path, shown_path
from multiserve.cli import DEFAULT_CONFIG
from partitioner.devices.catalog import INVENTORY_DIR, shipped_inventories
from partitioner.planning.demand import SHIPPED_SHAPES, load_shapes
from partitioner.simulate.traffic import load_traffic
from registry.store import load_registry

example = config_path("examples", "h200-three-models")
print(json.dumps({
    "foundation": foundation.__file__,
    "config_dir": str(CONFIG_DIR),
    "files": [str(DEFAULT_CONFIG), str(INVENTORY_DIR), str(SHIPPED_SHAPES)],
    "shown": shown_path(DEFAULT_CONFIG),
    "default_models": [m.name for m in load_registry(DEFAULT_CONFIG).models],
    "variants_models": [m.name for m in load_registry(config_path("variants.yaml")).models],
    "inventories": [name for name, _ in shipped_inventories()],
    "shapes": sorted(load_shapes(SHIPPED_SHAPES)),
    "example_models": [m.name for m in load_registry(example / "registry.yaml").models],
    "example_shapes": sorted(load_shapes(example / "shapes.json")),
    "example_traffic": sorted(load_traffic(example / "traffic.yaml").models),
}))
"""


def test_an_installed_wheel_finds_and_loads_every_shipped_config(wheel: Path, tmp_path: Path):
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    # -I: neither the working directory nor PYTHONPATH (the checkout) is on the path
    done = subprocess.run([sys.executable, "-I", "-c", textwrap.dedent(LOAD_ALL), str(site)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    installed = site / WHEEL_CONFIGS
    assert Path(got["foundation"]).parent == site / "foundation"
    assert got["config_dir"] == str(installed)
    assert all(Path(f).is_relative_to(installed) and Path(f).exists() for f in got["files"]), got["files"]
    assert got["shown"] == str(installed / "default.yaml")  # an absolute path: the operator can pass it as is
    assert got["default_models"] and got["variants_models"] and got["shapes"]
    assert got["inventories"] == sorted(p.name for p in (CONFIGS / "inventories").glob("*.json"))
    assert got["example_models"] and got["example_shapes"] and got["example_traffic"]


def test_a_source_checkout_finds_the_top_level_configs():
    from foundation.config_files import CONFIG_DIR, config_path, shown_path

    assert CONFIG_DIR == CONFIGS
    assert shown_path(config_path("inventories", "h100-80gb.json")) == "configs/inventories/h100-80gb.json"
    assert shown_path(Path("/elsewhere/mine.yaml")) == "/elsewhere/mine.yaml"
