"""The kernels' build cache: a build is found again by what it depends on, and then loaded without torch's
extension loader (which would keep setuptools and ~4 MiB resident in every replica)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runtimes import cpu_extension
from runtimes.llm.quant.cpu import kernel_available

CHECK = ("import sys; from runtimes.llm.quant.cpu import kernel_available; assert kernel_available(); "
         "print('torch.utils.cpp_extension' in sys.modules)")


def test_a_cached_build_loads_without_torchs_extension_loader():
    assert kernel_available()  # built (or found) by this process
    loaded = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert loaded.stdout == "False\n", loaded.stderr


def test_the_build_key_changes_with_source_and_flags(tmp_path: Path):
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    first = cpu_extension._build_key(source, ["-O3"])
    assert cpu_extension._build_key(source, ["-O3"]) == first
    assert cpu_extension._build_key(source, ["-O3", "-march=native"]) != first
    source.write_text("int f() { return 2; }\n")
    assert cpu_extension._build_key(source, ["-O3"]) != first


def test_the_cache_root_follows_torch_extensions_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_extension._cache_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cpu_extension._cache_root() == tmp_path / "cache" / "multiserve" / "kernels"
