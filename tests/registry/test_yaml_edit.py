"""Round-trip edits: the edited data is exact, and text outside the edit is the operator's, byte for byte."""

from __future__ import annotations

import difflib

from hypothesis import given, settings
from hypothesis import strategies as st

from registry import yaml_edit
from tests.registry.conftest import SAMPLE


def plain_models(text: str) -> list[dict]:
    return yaml_edit.to_plain(yaml_edit.parse(text))["models"]


def num_changed_lines(old: str, new: str) -> int:
    return sum(1 for d in difflib.ndiff(old.splitlines(), new.splitlines()) if d[:1] in "+-")


@settings(max_examples=30, deadline=None)  # each example parses YAML several times
@given(st.integers(0, 2), st.integers(0, 1000))
def test_changing_one_value_changes_one_line(index, replicas):
    entry = {**plain_models(SAMPLE)[index], "replicas": replicas}
    edited = yaml_edit.replace_entry(SAMPLE, index, entry)
    assert plain_models(edited)[index] == entry
    assert num_changed_lines(SAMPLE, edited) in (0, 2)  # one line out, one line in


def test_flow_style_entry_is_rewritten_in_flow_style():
    text = "models:\n  - {name: a, replicas: 1}  # tiny\n  - name: b\n"
    edited = yaml_edit.replace_entry(text, 0, {"name": "a", "replicas": 3})
    assert edited == "models:\n  - {name: a, replicas: 3}  # tiny\n  - name: b\n"


def test_comments_inside_a_changed_block_survive():
    text = ("models:\n  - name: a\n    engine:\n      # measured on an A10\n      block_size: 16\n"
            "      max_num_seqs: 8   # keep low\n")
    edited = yaml_edit.replace_entry(text, 0, {"name": "a", "engine": {"block_size": 32, "max_num_seqs": 8}})
    assert edited == text.replace("block_size: 16", "block_size: 32")


def test_layouts_the_splice_does_not_handle_fall_back_to_a_full_dump():
    text = "# keep me\nmodels: [{name: a, replicas: 1}]\n"
    edited = yaml_edit.append_entry(text, {"name": "b", "source": {"path": "/b"}})
    assert edited.startswith("# keep me\n")
    assert plain_models(edited) == [{"name": "a", "replicas": 1}, {"name": "b", "source": {"path": "/b"}}]
    anchored = "base: &e {block_size: 16}\nmodels:\n  - &first\n    name: a\n    engine: *e\n"
    edited = yaml_edit.replace_entry(anchored, 0, {"name": "a", "engine": {"block_size": 16}, "replicas": 2})
    assert plain_models(edited) == [{"name": "a", "engine": {"block_size": 16}, "replicas": 2}]


def test_removing_the_first_entry_keeps_the_section_comment():
    text = "models:  # all models\n  # model a\n  - name: a\n  # model b\n  - name: b\n"
    assert yaml_edit.remove_entry(text, 0) == "models:  # all models\n  # model b\n  - name: b\n"
