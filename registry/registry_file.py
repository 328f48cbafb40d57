"""The registry file on disk: read it (bounded), parse and validate it, and replace it only if it is unchanged.

Reading is bounded twice: the file may be at most `MAX_REGISTRY_BYTES`, and its YAML may not expand past
`yaml_edit.MAX_YAML_NODES`, so neither a huge file nor a "billion laughs" document can stall the gateway.

`replace_if_unchanged` is how an admin edit reaches the file without losing an operator's edit made meanwhile: the
current file is moved aside, its bytes are checked against the hash the store applied, and only then is the new
file linked into place; `os.link` fails if an editor created the path in between. Whatever it finds, an
operator's edit ends up in place or is reported (`FileChanged`), never overwritten silently.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

from pydantic import ValidationError
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from registry import yaml_edit
from registry.errors import Problem, RegistryError
from registry.fields import MIB
from registry.schema import Registry, validate_registry, validation_problems

# A registry of a thousand models is ~200 KiB; ruamel parses ~100 KiB/s, so this also bounds a parse to seconds.
MAX_REGISTRY_BYTES = 1 * MIB


class FileChanged(Exception):
    """The file on disk is not the one the store applied; the message says what was kept where."""


_REMOVED = "it was removed"


def content_hash(data: bytes) -> str:
    """The registry file's identity: `sha256:<hex>` of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_head(path: Path) -> bytes:
    """The file's bytes, but never more than `MAX_REGISTRY_BYTES` + 1 (enough to tell that it is too large)."""
    with open(path, "rb") as f:
        return f.read(MAX_REGISTRY_BYTES + 1)


def read_file(path: Path, data: bytes | None = None) -> tuple[str, str]:
    """The registry file's text and `content_hash`; `data`: its bytes (by `read_head`) when the caller has them.
    Raises `RegistryError` when it is unreadable, too large or not UTF-8."""
    if data is None:
        try:
            data = read_head(path)
        except OSError as exc:
            raise RegistryError(path, [Problem("(file)", f"cannot read: {exc.strerror or exc}")]) from None
    check_size(path, len(data))
    try:
        return data.decode("utf-8"), content_hash(data)
    except UnicodeDecodeError as exc:
        raise RegistryError(path, [Problem("(file)", f"not UTF-8 text: {exc}")]) from None


def check_size(path: str | Path, num_bytes: int) -> None:
    """Raise `RegistryError` if a registry of `num_bytes` (as read by `read_head`, or as about to be written) is too
    large to be read back."""
    if num_bytes > MAX_REGISTRY_BYTES:
        size = f"{'at least ' if num_bytes == MAX_REGISTRY_BYTES + 1 else ''}{num_bytes} bytes"
        raise RegistryError(path, [Problem("(file)", f"too large ({size}): a registry file may be at most "
                                                     f"{MAX_REGISTRY_BYTES} bytes ({MAX_REGISTRY_BYTES // MIB} MiB)")])


def parse_registry(text: str, path: str | Path) -> Registry:
    """Validate registry YAML text meant for the file `path` (its directory anchors relative model roots).
    Raises `RegistryError` naming `path` and each field at fault. (The size bound is checked on the bytes, where
    they are read or about to be written.)"""
    try:
        data = yaml_edit.to_plain(yaml_edit.parse(text))
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(yaml)"
        message = " ".join(str(m) for m in (exc.problem, exc.context) if m) or str(exc)
        raise RegistryError(path, [Problem(where, message)]) from None
    except YAMLError as exc:
        raise RegistryError(path, [Problem("(yaml)", str(exc))]) from None
    if data is None:
        raise RegistryError(path, [Problem("(top level)", "the file is empty; a registry with no models says "
                                                          "`models: []`")])
    return validate(data, path)


def validate(data: object, path: str | Path) -> Registry:
    """`schema.validate_registry`, with its errors as `RegistryError`."""
    try:
        return validate_registry(data, path)
    except ValidationError as exc:
        raise RegistryError(path, validation_problems(exc)) from None


def load_registry(path: str | Path) -> Registry:
    """Read and validate a registry file. Raises `RegistryError` naming the file and each field at fault."""
    return parse_registry(read_file(Path(path))[0], path)


def replace_if_unchanged(path: Path, data: bytes, expected_hash: str) -> None:
    """Make `data` the file's content, if its content still has `expected_hash`; readers see the old file, the new
    one, or (for an instant) none, never a part. A symlinked registry keeps its link: its target is replaced.

    Raises `FileChanged` when the file changed (the change stays in place, or the message says where it is) and
    `OSError` when writing failed (the old file stays in place).
    """
    target = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)  # the new file keeps the old one's permissions
    except FileNotFoundError:
        raise FileChanged(_REMOVED) from None
    tmp = _write_temp(target, data, mode)
    try:
        _swap_in(tmp, target, expected_hash)
    finally:
        tmp.unlink(missing_ok=True)  # linked into place, or refused: its temporary name goes either way
    _fsync_dir(target.parent)  # the rename and link themselves survive a crash


def _write_temp(target: Path, data: bytes, mode: int) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _swap_in(tmp: Path, target: Path, expected_hash: str) -> None:
    """Move the current file aside, check it, link `tmp` in; every exit leaves an operator's edit in place or
    reported. The caller holds the store's lock, so the store's own reload cannot interleave."""
    aside = _aside_name(target)
    try:
        os.rename(target, aside)  # from here an editor's save creates a new file at `target`: the link sees it
    except FileNotFoundError:
        aside.unlink()
        raise FileChanged(_REMOVED) from None
    if content_hash(aside.read_bytes()) != expected_hash:
        if not _put_back(aside, target):
            raise FileChanged(f"an editor saved it twice during the write; the newer file is in place, the earlier "
                              f"is kept at {aside}")
        raise FileChanged("the edit on disk is kept")
    try:
        _link(tmp, target)
    except FileExistsError:
        aside.unlink()  # what the store applied; the editor's newer file stays in place
        raise FileChanged("an editor saved it during the write; that file is kept") from None
    except BaseException:
        if not _put_back(aside, target):
            aside.unlink()  # as above: what the store applied, and an editor's newer file is in place
        raise
    # An editor that had the file open may have written into it (now at `aside`) after the check above.
    if content_hash(aside.read_bytes()) != expected_hash:
        os.replace(aside, target)
        raise FileChanged("an editor wrote to it during the write; that edit is kept")
    aside.unlink()


def _aside_name(target: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)
    os.close(fd)  # a unique name, which the rename replaces
    return Path(name)


def _put_back(aside: Path, target: Path) -> bool:
    """Return the moved-aside file to `target`; False (and `aside` left alone) if an editor created `target`."""
    try:
        _link(aside, target)
    except FileExistsError:
        return False
    aside.unlink(missing_ok=True)  # gone already where `_link` had to rename
    return True


def _link(source: Path, target: Path) -> None:
    """Give `source`'s file the name `target`, failing with `FileExistsError` if `target` exists."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError:
        # A filesystem without hard links: a rename, which would replace a file an editor created in the
        # microseconds since the rename aside (the one window this cannot close there).
        os.rename(source, target)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
