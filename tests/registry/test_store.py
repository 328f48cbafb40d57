"""RegistryStore: the last good registry survives bad edits; admin edits are validated whole and written back
atomically, touching only the lines of the edited model."""

from __future__ import annotations

import difflib
import os
import shutil
import stat
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.errors import ModelNotFound, Problem, RegistryError
from registry.schema import Registry
from registry.store import RegistryDiff, RegistryStore, content_hash, diff_registries, load_registry
from tests.registry.conftest import SAMPLE
from tests.registry.test_schema import DEFAULT_CONFIG


def changed_lines(old: str, new: str) -> tuple[list[str], list[str]]:
    """(lines only in old, lines only in new), in order."""
    diff = list(difflib.ndiff(old.splitlines(), new.splitlines()))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


def test_initial_state(make_store, clock):
    store = make_store()
    assert store.version == 1 and store.last_rejected is None
    assert store.hash == content_hash(store.path.read_bytes())
    assert [m.name for m in store.registry.models] == ["chat-a", "chat-b", "embed"]
    assert store.status() == {"path": str(store.path), "version": 1, "hash": store.hash, "applied_at": clock.now,
                              "num_models": 3, "last_rejected": None}


def test_an_invalid_file_at_start_raises(registry_file):
    with pytest.raises(RegistryError, match=r"registry.yaml: models\[0\].replicas"):
        RegistryStore(registry_file(SAMPLE.replace("replicas: 1 ", "replicas: -1 ")))


def test_reload_unchanged_or_comment_only_is_not_a_change(make_store):
    store = make_store()
    assert store.reload_from_file() is None
    store.path.write_text(SAMPLE.replace("# backup chat model", "# the backup"))
    assert store.reload_from_file() is None
    assert store.version == 1 and store.hash == content_hash(store.path.read_bytes())


def test_invalid_file_edit_keeps_last_good_registry(make_store, clock):
    store = make_store()
    good = store.registry
    store.path.write_text(SAMPLE.replace("block_size: 16", "block_size: 12"))
    clock.now += 5
    with pytest.raises(RegistryError) as info:
        store.reload_from_file()
    assert str(info.value) == f"{store.path}: models[0].engine.block_size: must be a power of two, got 12"
    assert store.registry is good and store.version == 1
    rejected = store.status()["last_rejected"]
    assert rejected == {"when": clock.now, "source": "file", "errors": [
        {"field": "models[0].engine.block_size", "message": "must be a power of two, got 12"}]}
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 3"))
    assert store.reload_from_file() == RegistryDiff(resized=(("chat-b", 2, 3),))
    assert store.version == 2 and store.registry.resolve("chat-b").replicas == 3  # type: ignore[union-attr]
    assert store.last_rejected is not None and store.last_rejected.when == clock.now  # history, not cleared


def no_more_than_two_replicas(registry: Registry) -> list[Problem]:
    """A stand-in for the partitioner's check: a registry the host cannot place."""
    return [Problem("(partition plan)", f"{m.name}: {m.replicas} replicas do not fit, 2 do")
            for m in registry.models if m.replicas > 2]


def test_the_check_refuses_a_registry_at_start_and_any_edit_it_finds_wrong(registry_file, clock):
    with pytest.raises(RegistryError, match=r"\(partition plan\): chat-b: 3 replicas do not fit"):
        RegistryStore(registry_file(SAMPLE.replace("replicas: 2", "replicas: 3")), check=no_more_than_two_replicas)
    store = RegistryStore(registry_file(SAMPLE), clock=clock, check=no_more_than_two_replicas)
    good = store.registry
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 3"))
    with pytest.raises(RegistryError, match="3 replicas do not fit"):
        store.reload_from_file()
    assert store.registry is good and store.last_rejected is not None and store.last_rejected.source == "file"
    store.path.write_text(SAMPLE)  # the operator puts it back
    assert store.reload_from_file() is None and store.version == 1
    with pytest.raises(RegistryError, match="chat-a: 5 replicas do not fit"):
        store.scale("chat-a", 5)
    assert store.registry is good and store.path.read_text() == SAMPLE and store.last_rejected.source == "admin"
    assert store.scale("chat-a", 2).resized == (("chat-a", 1, 2),)  # what fits still goes through


def test_unreadable_file_is_a_rejected_edit(make_store):
    store = make_store()
    store.path.unlink()
    with pytest.raises(RegistryError, match=r"\(file\): cannot read"):
        store.reload_from_file()
    assert store.last_rejected is not None and store.registry.models


def test_diff_of_add_remove_change_resize(make_store):
    store = make_store()
    edited = (SAMPLE.replace("replicas: 2", "replicas: 4")
              .replace("device: cpu", "device: auto")
              .replace("  - name: embed\n    type: embedding", "  - name: embed2\n    type: embedding")
              .replace("port: 8000", "port: 9000"))
    store.path.write_text(edited)
    diff = store.reload_from_file()
    assert diff == RegistryDiff(added=("embed2",), removed=("embed",), changed=("chat-a",), relaunched=("chat-a",),
                                resized=(("chat-b", 2, 4),), gateway_changed=True)
    assert store.version == 2
    assert diff.as_dict() == {"added": ["embed2"], "removed": ["embed"], "changed": ["chat-a"],
                              "relaunched": ["chat-a"],
                              "resized": [{"name": "chat-b", "old_replicas": 2, "new_replicas": 4}],
                              "gateway_changed": True}


def test_a_model_can_be_both_changed_and_resized():
    old = Registry.model_validate({"models": [{"name": "m", "type": "chat", "source": {"path": "/m"}}]})
    new = Registry.model_validate({"models": [{"name": "m", "type": "chat", "source": {"path": "/n"}, "replicas": 2}]})
    assert diff_registries(old, new) == RegistryDiff(changed=("m",), relaunched=("m",), resized=(("m", 1, 2),))
    assert diff_registries(old, old).is_empty and not diff_registries(old, new).is_empty


def test_only_a_change_to_what_replicas_run_with_relaunches():
    """Aliases, fallbacks and the gateway's side of the policy change a model without restarting it; its engine
    options and placement restart it."""
    base = {"name": "m", "type": "chat", "source": {"path": "/m"}}
    old = Registry.model_validate({"models": [base]})
    live = Registry.model_validate({"models": [{**base, "aliases": ["mm"], "policy": {"routing": "round_robin"}}]})
    assert diff_registries(old, live) == RegistryDiff(changed=("m",))
    for restart in ({"engine": {"block_size": 32}}, {"placement": {"isolation": "exclusive"}}, {"device": "cpu"}):
        new = Registry.model_validate({"models": [{**base, **restart}]})
        assert diff_registries(old, new) == RegistryDiff(changed=("m",), relaunched=("m",)), restart


@settings(deadline=None)  # shared CI cores
@given(st.lists(st.sampled_from("abcdef"), unique=True), st.lists(st.sampled_from("abcdef"), unique=True),
       st.lists(st.integers(0, 3), min_size=6, max_size=6))
def test_diff_is_symmetric(names_a, names_b, replicas):
    def registry(names: list[str], bump: int) -> Registry:
        return Registry.model_validate({"models": [
            {"name": n, "type": "chat", "source": {"path": "/m"}, "replicas": replicas["abcdef".index(n)] + bump}
            for n in names]})

    a, b = registry(names_a, 0), registry(names_b, 1)
    forward, backward = diff_registries(a, b), diff_registries(b, a)
    assert set(forward.added) == set(names_b) - set(names_a) and forward.added == backward.removed
    assert {name for name, _, _ in forward.resized} == set(names_a) & set(names_b)
    assert {(n, new, old) for n, old, new in forward.resized} == set(backward.resized)  # in each new's order


def test_scale_changes_one_line_and_keeps_its_comment(make_store):
    store = make_store()
    diff = store.scale("chat-a", 4)
    assert diff == RegistryDiff(resized=(("chat-a", 1, 4),))
    assert changed_lines(SAMPLE, store.path.read_text()) == (
        ["    replicas: 1   # one is enough on CPU"], ["    replicas: 4   # one is enough on CPU"])
    assert store.version == 2 and store.hash == content_hash(store.path.read_bytes())
    assert load_registry(store.path) == store.registry
    assert store.reload_from_file() is None  # its own write is not a change


def test_scale_to_a_range_and_pin_persist_a_model_on_demand(make_store):
    store = make_store()
    diff = store.scale("chat-a", {"min": 0, "max": 2})
    assert diff == RegistryDiff(resized=(("chat-a", 1, {"min": 0, "max": 2}),))
    assert diff.as_dict()["resized"] == [{"name": "chat-a", "old_replicas": 1, "new_replicas": {"min": 0, "max": 2}}]
    spec = store.registry.resolve("chat-a")
    assert spec is not None and spec.on_demand and spec.resident_replicas == 0
    assert store.pin("chat-a", True) == RegistryDiff(changed=("chat-a",))
    assert load_registry(store.path) == store.registry
    pinned = store.registry.resolve("chat-a")
    assert pinned is not None and pinned.scaling.pinned and pinned.resident_replicas == 1
    with pytest.raises(RegistryError, match=r"models\[1\]\.scaling: only for a model started on demand"):
        store.pin("chat-b", True)  # a fixed count is resident already
    assert store.registry.resolve("chat-b").scaling.pinned is False  # nothing changed


def test_scale_to_the_same_count_writes_nothing(make_store):
    store = make_store()
    before = os.stat(store.path)
    assert store.scale("chat-b", 2).is_empty
    assert store.version == 1 and os.stat(store.path).st_ino == before.st_ino


def test_scale_default_config_keeps_multiline_flow_mapping(registry_file):
    text = DEFAULT_CONFIG.read_text()
    store = RegistryStore(registry_file(text))
    store.scale("smollm2-135m-instruct", 2)
    assert changed_lines(text, store.path.read_text()) == (["    replicas: 1"], ["    replicas: 2"])


def test_put_new_model_appends_and_keeps_everything_else(make_store):
    store = make_store()
    diff = store.put_model({"name": "chat-c", "type": "chat", "source": {"path": "/c.gguf"},
                            "engine": {"block_size": 32}, "aliases": ["c"]})
    assert diff == RegistryDiff(added=("chat-c",))
    text = store.path.read_text()
    assert text.startswith(SAMPLE)  # entries stay separated by a blank line, like the others
    assert text[len(SAMPLE):] == ("\n  - name: chat-c\n    aliases: [c]\n    type: chat\n    source: {path: /c.gguf}\n"
                                  "    engine: {block_size: 32}\n")
    assert load_registry(store.path) == store.registry and store.registry.resolve("c") is not None


def test_put_replaces_only_changed_keys(make_store):
    store = make_store()
    spec = {"name": "chat-b", "type": "chat", "source": {"path": "/models/b.gguf"}, "replicas": 2,
            "policy": {"routing": "power_of_two"}, "enabled": False}
    diff = store.put_model(spec)
    assert diff == RegistryDiff(changed=("chat-b",))
    assert changed_lines(SAMPLE, store.path.read_text()) == (
        ["      routing: round_robin  # stateless"], ["      routing: power_of_two # stateless", "    enabled: false"])


def test_put_is_a_full_replacement(make_store):
    store = make_store()
    store.put_model({"name": "chat-a", "type": "chat", "source": {"path": "/a.gguf"}, "fallbacks": ["chat-b"]})
    spec = store.registry.resolve("chat-a")
    assert spec is not None and spec.aliases == [] and spec.engine.block_size == 16 and spec.replicas == 1
    text = store.path.read_text()
    assert "  # the chat model\n  - name: chat-a\n    type: chat\n    source: {path: /a.gguf}\n" in text
    assert "fallbacks: [chat-b]\n\n  # backup chat model\n" in text
    assert load_registry(store.path) == store.registry


def test_delete_removes_the_entry_and_its_heading(make_store):
    store = make_store()
    assert store.delete_model("embed") == RegistryDiff(removed=("embed",))
    assert store.path.read_text() == SAMPLE[:SAMPLE.index("\n\n  - name: embed")] + "\n"  # and its blank line
    store.put_model({"name": "chat-a", "type": "chat", "source": {"path": "/a.gguf"}})  # drop its fallback
    store.delete_model("chat-b")
    assert store.path.read_text().endswith("    source: {path: /a.gguf}\n")
    assert "# Operator notes: keep this comment." in store.path.read_text()


def test_deleting_the_last_model_leaves_an_empty_list(make_store):
    store = make_store("gateway: {model_roots: [/]}\nmodels:\n  - {name: a, type: chat, source: {path: /m}}\n")
    store.delete_model("a")
    assert load_registry(store.path).models == [] and store.registry.models == []


REJECTED_ADMIN_EDITS = {
    "delete a fallback target": (lambda s: s.delete_model("chat-b"), "models[0].fallbacks[0]: unknown model 'chat-b'"),
    "negative scale": (lambda s: s.scale("chat-b", -1),
                       "models[1].replicas: Input should be greater than or equal to 0"),
    "typo in put": (lambda s: s.put_model({"name": "x", "type": "chat", "source": {"path": "/x"}, "replica": 1}),
                    "models[3].replica: unknown field; did you mean 'replicas'?"),
    "alias collision": (lambda s: s.put_model({"name": "x", "type": "chat", "source": {"path": "/x"},
                                               "aliases": ["a"]}),
                        "models[3].aliases[0]: 'a' is already used by models[0].aliases[0]"),
}


@pytest.mark.parametrize("case", REJECTED_ADMIN_EDITS)
def test_rejected_admin_edit_changes_nothing(make_store, clock, case):
    edit, expected = REJECTED_ADMIN_EDITS[case]
    store = make_store()
    good = store.registry
    clock.now += 1
    with pytest.raises(RegistryError) as info:
        edit(store)
    assert f"{store.path}: {expected}" in str(info.value)
    assert store.path.read_text() == SAMPLE and store.registry is good and store.version == 1
    assert store.last_rejected is not None and store.last_rejected.source == "admin"
    assert store.last_rejected.when == clock.now


def test_unknown_model_is_not_found_not_rejected(make_store):
    store = make_store()
    with pytest.raises(ModelNotFound, match="'a' is an alias of 'chat-a'"):
        store.scale("a", 2)
    with pytest.raises(ModelNotFound):
        store.delete_model("nope")
    assert store.last_rejected is None


def test_admin_edit_refuses_to_overwrite_unapplied_file_changes(make_store):
    store = make_store()
    edited = SAMPLE.replace("replicas: 2", "replicas: 5")
    store.path.write_text(edited)
    with pytest.raises(RegistryError, match=r"\(file\): changed on disk since version 1"):
        store.scale("chat-a", 3)
    assert store.path.read_text() == edited
    store.reload_from_file()
    store.scale("chat-a", 3)
    assert store.registry.resolve("chat-b").replicas == 5  # type: ignore[union-attr]


def test_atomic_write_keeps_mode_and_symlink_and_leaves_no_temp_files(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text(SAMPLE)
    real.chmod(0o640)
    link = tmp_path / "registry.yaml"
    link.symlink_to(real)
    store = RegistryStore(link)
    store.scale("chat-b", 3)
    assert link.is_symlink() and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert "replicas: 3" in real.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real.yaml", "registry.yaml"]


def test_failed_write_is_rejected_and_changes_nothing(make_store, monkeypatch):
    store = make_store()

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)  # writing the new file
    with pytest.raises(RegistryError, match="cannot write: No space left on device"):
        store.scale("chat-b", 3)
    assert store.version == 1 and store.path.read_text() == SAMPLE
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]


def test_concurrent_admin_edits_are_serialized(make_store):
    store = make_store()

    def worker(t: int) -> None:
        for k in range(5):
            store.scale("chat-b", 10 * (t + 1) + k)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.version == 21
    assert load_registry(store.path) == store.registry
    assert store.hash == content_hash(store.path.read_bytes())


def test_store_works_on_a_copy_of_default_config(tmp_path):
    path = tmp_path / "default.yaml"
    shutil.copy(DEFAULT_CONFIG, path)
    store = RegistryStore(path)
    store.put_model({**store.registry.models[0].model_dump(mode="json", exclude_unset=True), "enabled": False})
    assert changed_lines(DEFAULT_CONFIG.read_text(), path.read_text()) == ([], ["    enabled: false"])
