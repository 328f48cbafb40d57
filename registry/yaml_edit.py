"""Round-trip edits of the registry YAML: change one model entry, keep every other byte as the operator wrote it.

A plain ruamel.yaml round trip keeps comments and key order but re-flows what it re-emits (a flow mapping written
over two lines comes back on one), so these edits splice text instead: ruamel's round-trip parse gives the line of
every model entry and of every key inside it; only the lines of keys whose values changed are re-rendered (by
ruamel, from the merged round-trip node, so comments and flow/block style inside survive). Every result is parsed
again and must equal the intended data; a layout the splice does not handle (flow-style `models`, anchors, ...)
falls back to a whole-document ruamel dump, checked the same way.

Every parse is bounded: anchors and aliases are counted as expanded on the composed node graph, before anything is
constructed or walked, so a "billion laughs" document is refused in milliseconds (`YAMLTooLarge`), as is one
nested deeper than the parser's recursion allows.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import RoundTripConstructor
from ruamel.yaml.error import CommentMark, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, SequenceNode
from ruamel.yaml.scalarbool import ScalarBoolean
from ruamel.yaml.tokens import CommentToken

Lines = list[str]

# Nodes a document may have with every alias expanded. A registry of a thousand models is ~20,000; the nine-level
# "billion laughs" is 10^9, which the walks after parsing (`to_plain`, pydantic) would take hours over.
MAX_YAML_NODES = 100_000


class YAMLTooLarge(YAMLError):
    """A document whose aliases expand past `MAX_YAML_NODES`, that refers to itself, or that nests too deeply."""


class _BoundedConstructor(RoundTripConstructor):
    """The round-trip constructor, refusing a document whose expansion is too large before constructing it."""

    def construct_document(self, node: Any) -> Any:
        _expanded_size(node, {}, set())
        return super().construct_document(node)


def _expanded_size(node: Node, sizes: dict[int, int], open_ids: set[int]) -> int:
    """Nodes under `node` (itself included) with every alias expanded. An alias is the same node object as its
    anchor, so `sizes` (by id) makes this linear in the composed graph; `open_ids` are the nodes being counted."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_ids:
        raise YAMLTooLarge(f"an alias refers to a node that contains it (line {node.start_mark.line + 1}): "
                           "a recursive structure is not a registry")
    open_ids.add(key)
    children: list[Node] = []
    if isinstance(node, MappingNode):
        children = [part for pair in node.value for part in pair]
    elif isinstance(node, SequenceNode):
        children = list(node.value)
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_ids)
        if size > MAX_YAML_NODES:
            raise YAMLTooLarge(f"with its aliases expanded the document has more than {MAX_YAML_NODES} nodes "
                               f"(the limit); anchors and aliases may not multiply a registry's size")
    open_ids.discard(key)
    sizes[key] = size
    return size


class _NoSplice(Exception):
    """This layout is not one the line splice handles; use the whole-document dump."""


def make_yaml() -> YAML:
    """The round-trip YAML used for reading and writing registries (the project's 2/4/2 indentation)."""
    yaml = YAML()
    yaml.Constructor = _BoundedConstructor
    yaml.preserve_quotes = True
    yaml.width = 120
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def parse(text: str) -> Any:
    """Round-trip parse; raises ruamel's `YAMLError` (with line and column marks) on bad syntax, and its subclass
    `YAMLTooLarge` for a document too large once expanded or nested too deeply."""
    try:
        return make_yaml().load(text)
    except RecursionError:  # ruamel composes recursively: a few hundred levels of `[[[...` exhaust the stack
        raise YAMLTooLarge("the document nests too deeply (a registry is a few levels deep)") from None


def to_plain(node: Any) -> Any:
    """ruamel's round-trip nodes and scalar subclasses as plain dicts, lists, str, int, float, bool, None."""
    if isinstance(node, Mapping):
        return {to_plain(k): to_plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [to_plain(v) for v in node]
    if isinstance(node, bool | ScalarBoolean):
        return bool(node)
    for kind in (int, float, str):
        if isinstance(node, kind):
            return kind(node)
    return node


def replace_entry(text: str, index: int, entry: Mapping[str, Any]) -> str:
    """`models[index]` becomes `entry`; keys whose values are unchanged keep their text."""
    return _edit(text, lambda doc: doc["models"].__setitem__(index, _merge(doc["models"][index], entry)),
                 lambda doc, lines: _splice_replace(doc, lines, index, entry))


def append_entry(text: str, entry: Mapping[str, Any]) -> str:
    """`entry` becomes the last model, indented like the others."""
    def mutate(doc: Any) -> None:
        if not isinstance(doc.get("models"), CommentedSeq):
            doc["models"] = CommentedSeq()
        doc["models"].fa.set_block_style()
        doc["models"].append(_styled(entry, top=True))
    return _edit(text, mutate, lambda doc, lines: _splice_append(doc, lines, entry))


def remove_entry(text: str, index: int) -> str:
    """`models[index]` goes, with comment lines directly above it at its indentation."""
    return _edit(text, lambda doc: doc["models"].__delitem__(index),
                 lambda doc, lines: _splice_remove(doc, lines, index))


def _edit(text: str, mutate: Callable[[Any], None], splice: Callable[[Any, Lines], Lines]) -> str:
    intended = parse(text)
    mutate(intended)
    expected = to_plain(intended)
    try:
        spliced = "\n".join(splice(parse(text), text.split("\n")))
        if to_plain(parse(spliced)) == expected:
            return spliced
    except _NoSplice:
        pass
    dumped = _dump(intended)
    if to_plain(parse(dumped)) != expected:
        raise RuntimeError(f"round-trip YAML edit does not reproduce the intended registry:\n{dumped}")
    return dumped


def _splice_replace(doc: Any, lines: Lines, index: int, entry: Mapping[str, Any]) -> Lines:
    start, content_end, _ = _item_spans(doc, lines)[index]
    old = doc["models"][index]
    keys = list(old) if isinstance(old, CommentedMap) and not old.fa.flow_style() else []
    if not keys or keys[0] not in entry:  # flow-style entry, or the dash line's key goes: render the whole item
        seq = doc["models"]
        col = seq.lc.item(index)[1]
        item = _render(_merge(_rebased(old, col), entry), lines[start][:col], col)
        eol = (seq.ca.items.get(index) or [None])[0]  # a flow entry's end-of-line comment is its list's
        if len(item) == 1 and isinstance(eol, CommentToken) and not eol.value.startswith("\n"):
            item[0] += " " * max(1, eol.column - len(item[0])) + eol.value.split("\n", 1)[0]
        return lines[:start] + item + lines[content_end:]
    col = old.lc.key(keys[0])[1]
    key_lines = [old.lc.key(k)[0] for k in keys] + [content_end]
    if any(a >= b for a, b in itertools.pairwise(key_lines)):
        raise _NoSplice
    out = lines[:start]
    for k, ks, ke in zip(keys, key_lines, key_lines[1:], strict=False):
        if lines[ks][:col].strip() not in ("", "-"):
            raise _NoSplice
        kce = _trim(lines, ks, ke)
        if k not in entry:
            out += lines[kce:ke]
        elif to_plain(old[k]) == entry[k]:
            out += lines[ks:ke]
        else:
            value = _merge(_rebased(old[k], col), entry[k])
            out += _render_key(k, value, old, lines[ks][:col], col) + lines[kce:ke]
    for k in (k for k in entry if k not in old):
        out += _render_key(k, _styled(entry[k]), old, " " * col, col)
    return out + lines[content_end:]


def _splice_append(doc: Any, lines: Lines, entry: Mapping[str, Any]) -> Lines:
    spans = _item_spans(doc, lines)
    start, content_end, _ = spans[-1]
    col = doc["models"].lc.item(len(spans) - 1)[1]
    above = _heading_start(lines, start, floor=spans[0][0]) - 1
    blank_between = len(spans) > 1 and not lines[above].strip()
    new_item = ([""] if blank_between else []) + _render(_styled(entry, top=True), lines[start][:col], col)
    return lines[:content_end] + new_item + lines[content_end:]


def _splice_remove(doc: Any, lines: Lines, index: int) -> Lines:
    spans = _item_spans(doc, lines)
    start, content_end, _ = spans[index]
    low, high = _heading_start(lines, start, floor=doc.lc.key("models")[0] + 1), content_end
    if low >= 1 and not lines[low - 1].strip():  # do not leave two blank lines where one separated entries
        if high < len(lines) and not lines[high].strip():
            high += 1
        elif index == len(spans) - 1:
            low -= 1
    return lines[:low] + lines[high:]


def _heading_start(lines: Lines, start: int, floor: int) -> int:
    """The first of the comment lines directly above an entry at its dash's indentation (its heading)."""
    dash_col = _indent_of(lines[start])
    while start - 1 >= floor and lines[start - 1].lstrip().startswith("#") and _indent_of(lines[start - 1]) == dash_col:
        start -= 1
    return start


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _item_spans(doc: Any, lines: Lines) -> list[tuple[int, int, int]]:
    """(first line, end of content, end including trailing comments and blanks) of each model entry."""
    seq = doc.get("models") if isinstance(doc, CommentedMap) else None
    if not isinstance(seq, CommentedSeq) or seq.fa.flow_style() or not seq:
        raise _NoSplice
    keys = list(doc)
    after = keys[keys.index("models") + 1:]
    starts = [seq.lc.item(i)[0] for i in range(len(seq))]
    ends = [*starts[1:], doc.lc.key(after[0])[0] if after else len(lines)]
    for i, start in enumerate(starts):
        if lines[start][:seq.lc.item(i)[1]].strip() != "-":
            raise _NoSplice  # e.g. an anchor before the entry, or the dash on a line of its own
    return [(s, _trim(lines, s, e), e) for s, e in zip(starts, ends, strict=True)]


def _trim(lines: Lines, start: int, end: int) -> int:
    """`end` moved up past trailing blank and comment-only lines: those belong to whatever follows."""
    while end > start + 1 and _is_trailer(lines[end - 1]):
        end -= 1
    return end


def _is_trailer(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _render_key(key: Any, value: Any, parent: CommentedMap, first_prefix: str, col: int) -> Lines:
    single = CommentedMap()
    single[key] = value
    slots = parent.ca.items.get(key)
    if slots and len(slots) > 2 and isinstance(slots[2], CommentToken):  # keep the key's end-of-line comment
        single.ca.items[key] = [None, None, _comment_moved(slots[2], col, eol_only=True), None]
    return _render(single, first_prefix, col)


def _rebased(node: Any, col: int, is_last: bool = True) -> Any:
    """`node`'s comments moved `col` columns left (it is rendered at column 0, then indented by `col`), and the
    comment lines that trail its last key dropped: in the text they sit after it and stay where they are."""
    if isinstance(node, CommentedMap | CommentedSeq):
        if node.ca.comment:  # comment lines before the first key
            node.ca.comment = [_comment_moved(c, col) for c in node.ca.comment]
        keys = list(node) if isinstance(node, CommentedMap) else list(range(len(node)))
        for key, slots in list(node.ca.items.items()):
            eol = 2 if isinstance(node, CommentedMap) else 0
            node.ca.items[key] = [_comment_moved(c, col, eol_only=is_last and key == keys[-1] and i == eol)
                                  for i, c in enumerate(slots)]
        for i, key in enumerate(keys):
            _rebased(node[key], col, is_last and i == len(keys) - 1)
    return node


def _comment_moved(comment: Any, col: int, eol_only: bool = False) -> Any:
    if isinstance(comment, list):
        return [_comment_moved(c, col) for c in comment]
    if not isinstance(comment, CommentToken):
        return comment
    value = comment.value
    if eol_only:
        if value.startswith("\n"):
            return None
        value = value.split("\n", 1)[0] + "\n"
    return CommentToken(value, CommentMark(max(comment.column - col, 0)))


def _render(node: Any, first_prefix: str, col: int) -> Lines:
    rendered = _dump(node).split("\n")
    while rendered and _is_trailer(rendered[-1]):
        rendered.pop()
    while rendered and _is_trailer(rendered[0]):
        rendered.pop(0)
    return [first_prefix + rendered[0]] + [" " * col + line if line else line for line in rendered[1:]]


def _dump(node: Any) -> str:
    buffer = io.StringIO()
    make_yaml().dump(node, buffer)
    return buffer.getvalue()


def _merge(old: Any, new: Any) -> Any:
    """`new` written into the round-trip node `old`, keeping old's comments, key order and style where it can."""
    if isinstance(old, CommentedMap) and isinstance(new, Mapping):
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, v in new.items():
            if k not in old:
                old[k] = _styled(v)
            elif to_plain(old[k]) != v:
                old[k] = _merge(old[k], v)
        return old
    if isinstance(old, CommentedSeq) and isinstance(new, list):
        del old[:]
        old.extend(_styled(v) for v in new)
        return old
    return _styled(new)


def _styled(value: Any, top: bool = False) -> Any:
    """New data as round-trip nodes: flow style for mappings and lists of scalars (like `engine: {...}`)."""
    if isinstance(value, Mapping):
        node: CommentedMap | CommentedSeq = CommentedMap((k, _styled(v)) for k, v in value.items())
    elif isinstance(value, list):
        node = CommentedSeq(_styled(v) for v in value)
    else:
        return value
    children = value.values() if isinstance(value, Mapping) else value
    if not top and not any(isinstance(v, Mapping | list) for v in children):
        node.fa.set_flow_style()
    return node
