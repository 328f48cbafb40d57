"""Reading a client's JSON body at the gateway: whatever the bytes, the answer is the object or a 400.

What a hardened entry refuses before anything else looks at the body:
- not UTF-8 (JSON's one encoding between systems, RFC 8259; `json.loads` would take UTF-16 and UTF-32 bytes too, and
  forward what a replica refuses), not JSON, or JSON that is not an object;
- `NaN`, `Infinity` and numbers that overflow to infinity (not JSON, and not re-encodable to a replica);
- integers of more than 4,300 digits (Python's own limit on converting them);
- nesting deeper than `MAX_DEPTH` (no OpenAI body comes near; a deep one would exhaust the recursion of whoever
  parses or re-encodes it next).
"""

from __future__ import annotations

import json
import math
from typing import Any

from foundation.http.errors import APIError
from gateway.context import request_context

MAX_DEPTH = 128


def request_payload(scope: Any, body: bytes) -> dict[str, Any]:
    """The request's body (`body`, of the request whose ASGI scope is `scope`) as a JSON object, parsed once per
    request: the rate limits, the proxy and the traffic log all read it."""
    context = request_context(scope)
    if context.payload is None:
        context.payload = parse_json_object(body)
    return context.payload


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or APIError 400 (code `invalid_json`) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _invalid(f"the request body must be UTF-8 encoded JSON: {err}") from None
    try:
        payload = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise _invalid(f"the request body nests JSON deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits, and the two hooks below
        raise _invalid(f"the request body is not valid JSON: {err}") from None
    if not isinstance(payload, dict):
        raise _invalid("the request body must be a JSON object")
    # Cheap first: a body with few brackets cannot nest deeply (two C-speed scans of the bytes).
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _deeper_than(payload, MAX_DEPTH):
        raise _invalid(f"the request body nests JSON deeper than {MAX_DEPTH} levels")
    return payload


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is too large")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests containers more than `limit` deep (iterative: no recursion of its own)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _invalid(message: str) -> APIError:
    return APIError(400, message, code="invalid_json")
