"""The registry's one owner in a process: the last good `Registry`, its version, and every change to it.

Changes come from the file (an operator's edit, picked up by `watch.RegistryWatcher` or a reload) and from the admin
API (`put_model`, `delete_model`, `scale`). Either way the whole new registry is validated before anything changes;
a rejected change keeps the last good registry, is recorded as `last_rejected` and raised as `RegistryError`.
Beyond the schema, an optional `check` judges the whole registry against the host (the gateway's partitioner:
a registry whose replicas cannot be placed on the devices is refused, not served half-isolated).
Admin edits are written back to the file atomically, touching only the lines of the edited model, and never over an
operator's edit: the file's hash is checked and the file replaced together, under the one lock that file reloads
take too (`registry_file.replace_if_unchanged`); a file changed on disk refuses the admin edit until it is reloaded.

Parsing and validating can take seconds for a large file: callers on an event loop run these methods in a worker
thread (the admin API and the watcher do).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

from registry import yaml_edit
from registry.errors import ModelNotFound, Problem, RegistryError
from registry.launch import draft_launch, launch_key
from registry.registry_file import (
    FileChanged,
    check_size,
    content_hash,
    load_registry,
    parse_registry,
    read_file,
    replace_if_unchanged,
    validate,
)
from registry.schema import ModelSpec, Registry

__all__ = ["ModelNotFound", "RegistryCheck", "RegistryDiff", "RegistryError", "RegistryStore", "RejectedEdit",
           "content_hash", "diff_registries", "load_registry", "parse_registry"]

T = TypeVar("T")
RegistryCheck = Callable[[Registry], Iterable[Problem]]  # what is wrong with a schema-valid registry, if anything


@dataclass(frozen=True)
class RegistryDiff:
    """What an applied change did, for the pool to act on. A model whose spec changed and whose replica count
    changed is in both `changed` and `resized`; one whose replicas must restart is in `changed` and `relaunched`."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # any field other than `replicas` differs
    relaunched: tuple[str, ...] = ()  # what its replicas run with changed (`registry.launch.launch_key`): restart
    # (name, old replicas, new replicas): a count, or {min, max} as in the registry
    resized: tuple[tuple[str, ReplicaCount, ReplicaCount], ...] = ()
    gateway_changed: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.resized or self.gateway_changed)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for admin responses and logs."""
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed),
                "relaunched": list(self.relaunched),
                "resized": [{"name": n, "old_replicas": old, "new_replicas": new} for n, old, new in self.resized],
                "gateway_changed": self.gateway_changed}


@dataclass(frozen=True)
class RejectedEdit:
    """The last change that was not applied, and why."""

    when: float  # the store's clock, seconds
    source: Literal["file", "admin"]
    problems: tuple[Problem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"when": self.when, "source": self.source,
                "errors": [{"field": p.field, "message": p.message} for p in self.problems]}


ReplicaCount = int | dict[str, int]


def _count(spec: ModelSpec) -> ReplicaCount:
    """A model's `replicas` as plain data (JSON-ready)."""
    return spec.replicas if isinstance(spec.replicas, int) else spec.replicas.model_dump()


def diff_registries(old: Registry, new: Registry) -> RegistryDiff:
    """The model-level difference between two registries, in registry order."""
    old_by_name, new_by_name = {m.name: m for m in old.models}, {m.name: m for m in new.models}
    common = [m.name for m in new.models if m.name in old_by_name]
    # a model whose own entry is unchanged changes when its draft model's weights move or are held otherwise
    changed = tuple(name for name in common if old_by_name[name].model_dump(exclude={"replicas"})
                    != new_by_name[name].model_dump(exclude={"replicas"})
                    or draft_launch(old_by_name[name], old) != draft_launch(new_by_name[name], new))
    relaunched = tuple(name for name in changed
                       if launch_key(old_by_name[name], old) != launch_key(new_by_name[name], new))
    return RegistryDiff(
        added=tuple(name for name in new_by_name if name not in old_by_name),
        removed=tuple(name for name in old_by_name if name not in new_by_name),
        changed=changed,
        relaunched=relaunched,
        resized=tuple((name, _count(old_by_name[name]), _count(new_by_name[name])) for name in common
                      if old_by_name[name].replicas != new_by_name[name].replicas),
        gateway_changed=old.gateway != new.gateway,
    )


class RegistryStore:
    """The one owner of a process's registry state. Thread-safe: one lock serializes every change.

    Raises `RegistryError` at construction when the file is not a valid registry (there is no last good one yet).
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time,
                 check: RegistryCheck | None = None) -> None:
        self._path = Path(path)
        self._clock = clock
        self._check = check
        self._lock = threading.RLock()
        self._text, self._hash = read_file(self._path)
        self._registry = parse_registry(self._text, self._path)
        self._run_check("file", self._registry)
        self._version = 1
        self._applied_at = clock()
        self._last_rejected: RejectedEdit | None = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def registry(self) -> Registry:
        """The last good registry (immutable; a change replaces it)."""
        return self._registry

    @property
    def version(self) -> int:
        """1 for the registry loaded at start, +1 for each applied change; edits that change nothing don't count."""
        return self._version

    @property
    def hash(self) -> str:
        """`content_hash` of the file bytes the registry was last read from or written to."""
        return self._hash

    @property
    def last_rejected(self) -> RejectedEdit | None:
        return self._last_rejected

    def status(self) -> dict[str, Any]:
        """The body of `GET /admin/registry/status`."""
        with self._lock:
            rejected = self._last_rejected
            return {"path": str(self._path), "version": self._version, "hash": self._hash,
                    "applied_at": self._applied_at, "num_models": len(self._registry.models),
                    "last_rejected": rejected.to_dict() if rejected else None}

    def reload_from_file(self, data: bytes | None = None) -> RegistryDiff | None:
        """Apply the file's current content (`data`: its bytes, as the caller just read them with `read_head`).

        Returns the diff when the registry changed, None when it did not (same bytes, or only comments and layout
        changed). Invalid content raises `RegistryError` after recording it as `last_rejected`; the last good
        registry stays.
        """
        with self._lock:
            text, digest = self._guard("file", lambda: read_file(self._path, data))
            if digest == self._hash:
                return None
            registry = self._guard("file", lambda: parse_registry(text, self._path))
            self._run_check("file", registry)
            self._text, self._hash = text, digest
            diff = diff_registries(self._registry, registry)
            if diff.is_empty:
                return None
            self._apply(registry)
            return diff

    def put_model(self, spec: Mapping[str, Any]) -> RegistryDiff:
        """Add a model, or replace the one with the same `name` (a full replacement: absent keys take defaults)."""
        with self._lock:
            doc = self._current_document()
            models = doc["models"]
            index = next((i for i, m in enumerate(models) if m.get("name") == spec.get("name")), len(models))
            is_new = index == len(models)
            models[index:index + 1] = [yaml_edit.to_plain(spec)]
            registry = self._validated(doc)
            entry = registry.models[index].model_dump(mode="json", exclude_unset=True)
            if is_new:
                return self._commit(registry, lambda text: yaml_edit.append_entry(text, entry))
            return self._commit(registry, lambda text: yaml_edit.replace_entry(text, index, entry))

    def delete_model(self, name: str) -> RegistryDiff:
        """Remove a model; rejected while another model lists it as a fallback. Raises `ModelNotFound`."""
        with self._lock:
            doc = self._current_document()
            index = self._index_of(name)
            del doc["models"][index]
            registry = self._validated(doc)
            return self._commit(registry, lambda text: yaml_edit.remove_entry(text, index))

    def scale(self, name: str, replicas: Any) -> RegistryDiff:
        """Set a model's replicas: a count (0 keeps it defined but stops it) or `{min, max}` (on demand). Checked by
        the schema like any edit (a count from 0 to `schema.MAX_REPLICAS`). Raises `ModelNotFound`."""
        return self._edit_model(name, lambda entry: entry.__setitem__("replicas", replicas))

    def pin(self, name: str, pinned: bool) -> RegistryDiff:
        """Keep a model started on demand resident (`scaling.pinned`), or let it go idle again. Raises
        `ModelNotFound`; the schema refuses it for a model with a fixed count (always resident already)."""
        return self._edit_model(name, lambda entry: entry.setdefault("scaling", {}).__setitem__("pinned", pinned))

    def _edit_model(self, name: str, edit: Callable[[dict[str, Any]], None]) -> RegistryDiff:
        """Change one model's entry in place (`edit` gets it as plain data), validated whole and persisted."""
        with self._lock:
            doc = self._current_document()
            index = self._index_of(name)
            edit(doc["models"][index])
            registry = self._validated(doc)
            entry = registry.models[index].model_dump(mode="json", exclude_unset=True)
            return self._commit(registry, lambda text: yaml_edit.replace_entry(text, index, entry))

    # --- internals; callers hold the lock ---

    def _index_of(self, name: str) -> int:
        for i, model in enumerate(self._registry.models):
            if model.name == name:
                return i
        owner = self._registry.resolve(name)
        raise ModelNotFound(name, f" ({name!r} is an alias of {owner.name!r})" if owner else "")

    def _current_document(self) -> dict[str, Any]:
        """The applied registry as plain data, refusing early to edit a file with changes not yet applied (`_commit`
        checks again as it replaces the file)."""
        _, digest = self._guard("admin", lambda: read_file(self._path))
        if digest != self._hash:
            self._reject("admin", [self._changed_on_disk("")])
        doc = yaml_edit.to_plain(yaml_edit.parse(self._text))
        assert isinstance(doc, dict) and isinstance(doc.get("models"), list), f"applied registry is {doc!r}"
        return doc

    def _changed_on_disk(self, detail: str) -> Problem:
        return Problem("(file)", f"changed on disk since version {self._version} was applied"
                                 f"{f' ({detail})' if detail else ''}; the file must be valid and reloaded before "
                                 "admin edits")

    def _validated(self, doc: dict[str, Any]) -> Registry:
        registry = self._guard("admin", lambda: validate(doc, self._path))
        self._run_check("admin", registry)
        return registry

    def _run_check(self, source: Literal["file", "admin"], registry: Registry) -> None:
        problems = list(self._check(registry)) if self._check is not None else []
        if problems:
            self._reject(source, problems)

    def _commit(self, registry: Registry, edit: Callable[[str], str]) -> RegistryDiff:
        diff = diff_registries(self._registry, registry)
        if diff.is_empty:
            return diff
        text = edit(self._text)
        data = text.encode("utf-8")
        self._guard("admin", lambda: check_size(self._path, len(data)))  # else it could not be loaded again
        try:
            replace_if_unchanged(self._path, data, self._hash)
        except FileChanged as exc:
            self._reject("admin", [self._changed_on_disk(str(exc))])
        except OSError as exc:
            self._reject("admin", [Problem("(file)", f"cannot write: {exc.strerror or exc}")])
        self._text, self._hash = text, content_hash(data)
        self._apply(registry)
        return diff

    def _apply(self, registry: Registry) -> None:
        self._registry = registry
        self._version += 1
        self._applied_at = self._clock()

    def _guard(self, source: Literal["file", "admin"], step: Callable[[], T]) -> T:
        try:
            return step()
        except RegistryError as exc:
            self._reject(source, exc.problems)

    def _reject(self, source: Literal["file", "admin"], problems: Iterable[Problem]) -> NoReturn:
        self._last_rejected = RejectedEdit(when=self._clock(), source=source, problems=tuple(problems))
        raise RegistryError(self._path, self._last_rejected.problems)
