"""A request's JSON schema read for compiling: checked to be a JSON object, and its objects closed to the properties
they name unless they say otherwise.

An object schema with `properties` and no `additionalProperties` (pydantic's `model_json_schema()`, most hand-written
schemas) allows any other key by the JSON Schema standard; OpenAI's structured outputs and xgrammar (vLLM's and
SGLang's default backend) take such an object as closed, and so do we: a small model given free keys invents them,
and the output still validates against the schema as written. `additionalProperties`, `unevaluatedProperties` or
`patternProperties` in the schema are kept as given, and the branches of an `allOf` are left alone (closing each
branch would refuse the keys the others name).
"""

from __future__ import annotations

import json
from typing import Any

# keywords whose value is one subschema / a list of them / a map of names to them
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def schema_problem(text: str) -> str | None:
    """Why `text` is not a JSON schema llguidance can take (it wants a JSON object), or None."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        return f"the JSON schema is not valid JSON: {e}"
    if not isinstance(schema, dict):
        return f"the JSON schema must be a JSON object, got {type(schema).__name__}"
    return None


def closed_objects(text: str) -> str:
    """The schema (a JSON object's text) with each object that names `properties` and says nothing of other keys
    given `"additionalProperties": false`; the text itself when nothing changes."""
    schema = json.loads(text)
    return json.dumps(schema) if _close(schema) else text


def _close(node: Any) -> bool:
    """Close `node`'s objects in place (a schema just parsed); whether anything changed."""
    if not isinstance(node, dict):
        return False
    children = [node.get(key) for key in _ONE]
    children += [child for key in _LIST if isinstance(node.get(key), list) for child in node[key]]
    children += [child for key in _MAP if isinstance(node.get(key), dict) for child in node[key].values()]
    changed = False
    for child in children:
        changed = _close(child) or changed
    if isinstance(node.get("properties"), dict) and not any(key in node for key in _OPEN_KEYS):
        node["additionalProperties"] = False
        changed = True
    return changed
