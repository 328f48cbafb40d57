"""Model sources: a `{package, file}` names a file inside that package, a `{path}` lies under the model roots; the
registry and the worker's loader apply the same rules, and validating never imports the package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from registry.errors import RegistryError
from registry.sources import SourceError, package_file
from registry.store import parse_registry

PACKAGE = "msfake_weights"  # written by the `package` fixture; importing it raises


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed package with a model file, and symlinks leading out of it (a file and a directory)."""
    site, outside = tmp_path / "site", tmp_path / "outside"
    pkg = site / PACKAGE
    pkg.mkdir(parents=True)
    outside.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('validating a registry must not import the package')\n")
    (pkg / "model.gguf").write_bytes(b"GGUF")
    (outside / "secret.gguf").write_bytes(b"secret")
    (pkg / "escape.gguf").symlink_to(outside / "secret.gguf")
    (pkg / "linked").symlink_to(outside, target_is_directory=True)
    monkeypatch.syspath_prepend(str(site))
    return pkg


def registry(source: str, gateway: str = "") -> str:
    return f"{gateway}models:\n  - {{name: m, type: chat, source: {source}}}\n"


def problems(text: str, registry_path: Path) -> list[str]:
    with pytest.raises(RegistryError) as info:
        parse_registry(text, registry_path)
    return [str(p) for p in info.value.problems]


def test_a_file_inside_the_package_is_accepted_without_importing_it(package, tmp_path):
    spec = parse_registry(registry("{package: msfake-weights, file: model.gguf}"), tmp_path / "r.yaml").models[0]
    assert spec.source_ref() == "msfake-weights:model.gguf" and PACKAGE not in sys.modules


ESCAPING_FILES = {
    "absolute": ("/etc/passwd", "must be a path relative to the package's directory, got absolute '/etc/passwd'"),
    "dot-dot": ("../outside/secret.gguf", "must not contain a '..' component"),
    "dot-dot inside": ("linked/../model.gguf", "must not contain a '..' component"),
    "symlinked file": ("escape.gguf", "resolves to"),
    "symlinked directory": ("linked/secret.gguf", "a package file must not link out of its package"),
}


@pytest.mark.parametrize("case", ESCAPING_FILES)
def test_a_package_file_may_not_leave_its_package(package, tmp_path, case):
    file, expected = ESCAPING_FILES[case]
    found = problems(registry(f"{{package: msfake-weights, file: '{file}'}}"), tmp_path / "r.yaml")
    assert len(found) == 1 and found[0].startswith("models[0].source.file: ") and expected in found[0], found
    assert PACKAGE not in sys.modules


def test_the_loader_applies_the_same_rules(package):
    from registry.sources import resolve_model_path

    assert resolve_model_path("msfake-weights:model.gguf") == package / "model.gguf"
    for file in ("../outside/secret.gguf", "escape.gguf", "/etc/passwd"):
        with pytest.raises(SourceError):
            resolve_model_path(f"msfake-weights:{file}")
    with pytest.raises(FileNotFoundError, match="'not-installed-here' is not installed"):
        resolve_model_path("not-installed-here:model.gguf")
    assert PACKAGE not in sys.modules


def test_a_dotted_package_name_is_refused_before_anything_is_imported(tmp_path):
    found = problems(registry("{package: email.mime, file: x.gguf}"), tmp_path / "r.yaml")
    assert found == ["models[0].source.package: must be a top-level package name (letters, digits, '_' and '-'; "
                     "no dots: finding a dotted name imports its parents), got 'email.mime'"]


def test_a_package_not_installed_here_gets_the_lexical_rules_only(tmp_path):
    assert package_file("not-installed-here", "model.gguf") is None
    parse_registry(registry("{package: not-installed-here, file: model.gguf}"), tmp_path / "r.yaml")
    assert problems(registry("{package: not-installed-here, file: ../x}"), tmp_path / "r.yaml")


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """registry dir `conf/` with a model, a sibling `models/` dir, and a symlink in `conf/` to a file outside."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "conf" / "here.gguf").write_bytes(b"GGUF")
    (tmp_path / "models" / "there.gguf").write_bytes(b"GGUF")
    (tmp_path / "secret.gguf").write_bytes(b"secret")
    (tmp_path / "conf" / "link.gguf").symlink_to(tmp_path / "secret.gguf")
    return tmp_path


def test_by_default_a_path_must_lie_in_the_registry_files_directory(roots):
    reg = roots / "conf" / "r.yaml"
    spec = parse_registry(registry(f"{{path: {roots}/conf/here.gguf}}"), reg).models[0]
    assert spec.source_ref() == f"{roots}/conf/here.gguf"
    assert problems(registry("{path: /etc/passwd}"), reg) == [
        f"models[0].source.path: '/etc/passwd' is outside the model roots ('{roots}/conf'); a path source must lie "
        "under gateway.model_roots"]


@pytest.mark.parametrize(("path", "shown"), [
    ("{root}/conf/../models/there.gguf", "resolving to '{root}/models/there.gguf'"),
    ("{root}/conf/link.gguf", "resolving to '{root}/secret.gguf'"),
])
def test_traversal_and_symlinks_out_of_a_root_are_refused(roots, path, shown):
    found = problems(registry(f"{{path: {path.format(root=roots)}}}"), roots / "conf" / "r.yaml")
    assert len(found) == 1 and shown.format(root=roots) in found[0] and "outside the model roots" in found[0]


def test_relative_roots_are_relative_to_the_registry_file(roots, monkeypatch):
    monkeypatch.chdir(roots / "models")  # not what relative roots are resolved against
    text = registry(f"{{path: {roots}/models/there.gguf}}", gateway="gateway: {model_roots: [../models]}\n")
    assert parse_registry(text, roots / "conf" / "r.yaml").models[0].source is not None
    assert problems(text.replace("../models", "models"), roots / "conf" / "r.yaml")


def test_a_relative_path_is_resolved_like_the_worker_does_from_the_working_directory(roots, monkeypatch):
    monkeypatch.chdir(roots / "conf")
    parse_registry(registry("{path: here.gguf}"), roots / "conf" / "r.yaml")
    monkeypatch.chdir(roots / "models")
    assert "outside the model roots" in problems(registry("{path: there.gguf}"), roots / "conf" / "r.yaml")[0]


def test_no_model_roots_allows_no_path_sources(roots):
    found = problems(registry(f"{{path: {roots}/conf/here.gguf}}", gateway="gateway: {model_roots: []}\n"),
                     roots / "conf" / "r.yaml")
    assert found and "(none: gateway.model_roots is empty)" in found[0]
