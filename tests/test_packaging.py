"""What a wheel carries beside the Python modules: every C++ kernel source the runtime compiles on first use is package
data (an installed, not editable, copy would otherwise have no kernel to build and fall back, or fail)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration  # reads TOML on Python 3.10 too (no tomllib)

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    package_data = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    sources = sorted(ROOT.glob("runtimes/**/*.cpp"))
    assert sources
    for source in sources:
        package = ".".join(source.parent.relative_to(ROOT).parts)
        patterns = package_data.get(package, [])
        assert any(fnmatch.fnmatch(source.name, p) for p in patterns), f"{source.relative_to(ROOT)} is not package data"
