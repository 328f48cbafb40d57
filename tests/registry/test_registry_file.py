"""The registry file: an admin write never loses an operator's edit made at the worst moment, and reading is bounded
(file size, alias expansion, nesting) so a hostile or mistaken file is refused fast."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from registry import registry_file, yaml_edit
from registry.errors import RegistryError
from registry.store import RegistryStore, parse_registry
from tests.registry.conftest import SAMPLE

OPERATOR_EDIT = SAMPLE.replace("replicas: 2", "replicas: 5")


def only_registry_left(store: RegistryStore) -> bool:
    """No temporary or moved-aside file stays behind."""
    return [p.name for p in store.path.parent.iterdir()] == [store.path.name]


def refused_and_kept(store: RegistryStore, expected_text: str, detail: str) -> None:
    """The admin edit (`scale chat-a 3`) is refused, names the cause, and the operator's file is what is on disk."""
    with pytest.raises(RegistryError, match=r"\(file\): changed on disk since version 1 was applied") as info:
        store.scale("chat-a", 3)
    assert detail in str(info.value) and "reloaded before admin edits" in str(info.value)
    assert store.path.read_text() == expected_text and store.version == 1
    assert store.last_rejected is not None and store.last_rejected.source == "admin"


def test_an_edit_made_between_the_check_and_the_write_is_kept(make_store, monkeypatch):
    store = make_store()
    real = yaml_edit.replace_entry

    def edit_then_render(text: str, index: int, entry: dict) -> str:  # the operator saves while the store renders
        store.path.write_text(OPERATOR_EDIT)
        return real(text, index, entry)

    monkeypatch.setattr(yaml_edit, "replace_entry", edit_then_render)
    refused_and_kept(store, OPERATOR_EDIT, "the edit on disk is kept")
    assert only_registry_left(store)
    monkeypatch.undo()
    store.reload_from_file()  # what the message asks for; then admin edits go through again
    assert store.scale("chat-a", 3).resized == (("chat-a", 1, 3),)
    assert "replicas: 5" in store.path.read_text() and "replicas: 3" in store.path.read_text()


def editor_saves_a_new_file(store: RegistryStore) -> None:
    store.path.write_text(OPERATOR_EDIT)  # the path is free for an instant: an editor's rename lands there


def editor_writes_into_the_old_file(store: RegistryStore) -> None:
    aside = next(p for p in store.path.parent.iterdir() if p.name.endswith(".old"))
    aside.write_text(OPERATOR_EDIT)  # it had the file open before the rename aside, and writes after the check


RACES_WITH_THE_LINK = {
    "editor saves a new file": (editor_saves_a_new_file, "an editor saved it during the write; that file is kept"),
    "editor writes in place": (editor_writes_into_the_old_file,
                               "an editor wrote to it during the write; that edit is kept"),
}


@pytest.mark.parametrize("case", RACES_WITH_THE_LINK)
def test_an_edit_made_just_before_the_new_file_is_linked_in_is_kept(make_store, monkeypatch, case):
    race, detail = RACES_WITH_THE_LINK[case]
    store = make_store()
    real_link = os.link

    def race_then_link(src: str | Path, dst: str | Path) -> None:
        race(store)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", race_then_link)
    refused_and_kept(store, OPERATOR_EDIT, detail)
    assert only_registry_left(store)


def test_a_file_removed_during_the_write_is_not_recreated(make_store, monkeypatch):
    store = make_store()
    real = yaml_edit.replace_entry

    def remove_then_render(text: str, index: int, entry: dict) -> str:
        store.path.unlink()
        return real(text, index, entry)

    monkeypatch.setattr(yaml_edit, "replace_entry", remove_then_render)
    with pytest.raises(RegistryError, match=r"changed on disk since version 1 was applied \(it was removed\)"):
        store.scale("chat-a", 3)
    assert list(store.path.parent.iterdir()) == [] and store.version == 1


LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
) + "models: []\n"

HOSTILE_YAML = {
    "billion laughs": (LAUGHS, "more than 100000 nodes (the limit)"),
    "recursive alias": ("models: &m [{name: a, type: chat, fallbacks: *m}]\n", "refers to a node that contains it"),
    "deep nesting": ("models: " + "[" * 500 + "]" * 500 + "\n", "nests too deeply"),
}


@pytest.mark.timeout(30)  # without the bound the laughs expand to 10^9 nodes: hours
@pytest.mark.parametrize("case", HOSTILE_YAML)
def test_hostile_yaml_is_refused_fast_before_anything_walks_it(case):
    text, expected = HOSTILE_YAML[case]
    started = time.monotonic()
    with pytest.raises(RegistryError) as info:
        parse_registry(text, "r.yaml")
    assert time.monotonic() - started < 1.0
    assert [p.field for p in info.value.problems] == ["(yaml)"] and expected in str(info.value)


@pytest.mark.timeout(30)
def test_a_laughs_edit_keeps_the_last_good_registry(make_store):
    store = make_store()
    good = store.registry
    store.path.write_text(LAUGHS)
    with pytest.raises(RegistryError, match="more than 100000 nodes"):
        store.reload_from_file()
    assert store.registry is good and store.last_rejected is not None


def test_anchors_and_merge_keys_within_the_limit_still_work():
    text = ("models:\n  - &a {name: a, type: chat, source: {path: m}, engine: &engine {block_size: 32}}\n"
            "  - {<<: *a, name: b, engine: *engine}\n")
    registry = parse_registry(text, "r.yaml")
    assert [m.name for m in registry.models] == ["a", "b"] and registry.models[1].engine.block_size == 32


def test_a_file_over_the_size_limit_is_refused_without_parsing_it(make_store, monkeypatch):
    store = make_store()
    parsed = []
    monkeypatch.setattr(yaml_edit, "parse", lambda text: parsed.append(text))
    store.path.write_text(SAMPLE + "#" * registry_file.MAX_REGISTRY_BYTES + "\n")
    with pytest.raises(RegistryError) as info:
        store.reload_from_file()
    assert str(info.value) == (f"{store.path}: (file): too large (at least 1048577 bytes): a registry file may be at "
                               "most 1048576 bytes (1 MiB)")
    assert parsed == [] and store.version == 1


def test_an_admin_edit_that_would_make_the_file_too_large_is_refused(make_store, monkeypatch):
    store = make_store()
    monkeypatch.setattr(registry_file, "MAX_REGISTRY_BYTES", len(SAMPLE) + 16)
    with pytest.raises(RegistryError, match=r"\(file\): too large \(\d+ bytes\): a registry file may be at most"):
        store.put_model({"name": "chat-c", "type": "chat", "source": {"path": "/c.gguf"}})
    assert store.path.read_text() == SAMPLE and store.version == 1
