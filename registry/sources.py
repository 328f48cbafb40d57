"""Where a model's weights may be read from on this host: the rules for `{package, file}` and `{path}` sources.

The registry's validation (`schema`) and the workers' loaders (`resolve_model_path`) both resolve sources here,
so a source the registry accepts is the file a worker opens. The rules:

- `package` is a top-level name; `importlib.util.find_spec` locates it without running any of its code (a dotted
  name would import its parent packages, so it is refused);
- `file` is relative to the package, has no `..` component, and its real path (symlinks followed) stays inside
  the package's directory;
- `path`, by its real path, lies under one of the model roots (`gateway.model_roots`). A relative `path` is
  resolved against the working directory, as the worker (which inherits it) resolves it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePath

_PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class SourceError(ValueError):
    """A source that breaks one of the rules above; the message says which."""


def check_package_name(package: str) -> None:
    if not _PACKAGE_NAME.fullmatch(package):
        raise SourceError(f"must be a top-level package name (letters, digits, '_' and '-'; no dots: finding a "
                          f"dotted name imports its parents), got {package!r}")


def check_package_file(file: str) -> None:
    """The lexical rules: relative, no `..` component (symlinks are checked against the installed package)."""
    if os.path.isabs(file) or file.startswith(("/", "\\")):
        raise SourceError(f"must be a path relative to the package's directory, got absolute {file!r}")
    if ".." in PurePath(file.replace("\\", "/")).parts:
        raise SourceError(f"must not contain a '..' component (it would leave the package), got {file!r}")


def package_dir(package: str) -> Path | None:
    """The directory of the installed top-level package `package` ('-' read as '_'), or None if not installed."""
    check_package_name(package)
    try:
        spec = importlib.util.find_spec(package.replace("-", "_"))
    except ValueError:  # a module in sys.modules without a spec: not a package this host installed
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(package: str, file: str) -> Path | None:
    """`file` inside the installed `package`, or None when the package is not installed here.

    Raises `SourceError` when the name or the file breaks a rule, including a file that is (or is under) a symlink
    leading out of the package. The path is returned as joined, not resolved, so a model keeps its file's name.
    """
    check_package_file(file)
    base = package_dir(package)
    if base is None:
        return None
    path = base / file
    real, real_base = Path(os.path.realpath(path)), Path(os.path.realpath(base))
    if not real.is_relative_to(real_base):
        raise SourceError(f"{file!r} resolves to {str(real)!r}, outside package {package!r} ({str(real_base)!r}); "
                          "a package file must not link out of its package")
    return path


def resolve_roots(roots: Sequence[str], registry_dir: Path) -> list[Path]:
    """The real paths of the model roots; a relative root is taken relative to the registry file's directory."""
    return [Path(os.path.realpath(registry_dir / root)) for root in roots]


def check_model_path(path: str, roots: Sequence[Path]) -> None:
    """Raise `SourceError` unless `path`'s real path (`..` and symlinks resolved) lies under one of `roots`."""
    real = Path(os.path.realpath(path))
    if any(real.is_relative_to(root) for root in roots):
        return
    shown = repr(path) if str(real) == path else f"{path!r} (resolving to {str(real)!r})"
    allowed = ", ".join(repr(str(root)) for root in roots) or "none: gateway.model_roots is empty"
    raise SourceError(f"{shown} is outside the model roots ({allowed}); a path source must lie under "
                      "gateway.model_roots")


def resolve_model_path(source: str | Path) -> Path:
    """A path, or `package:FILE` naming a file shipped inside an installed Python package, as a worker opens it.
    `package:FILE` follows the rules above: a file that leaves its package raises `SourceError`."""
    text = str(source)
    if ":" in text and not Path(text).exists():
        package, _, filename = text.partition(":")
        found = package_file(package, filename)
        if found is None:
            raise FileNotFoundError(f"model package {package!r} is not installed")
        path = found
    else:
        path = Path(text)
    if not path.exists():
        raise FileNotFoundError(f"model file or directory not found: {path}")
    return path
