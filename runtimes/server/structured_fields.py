"""The request fields that constrain a whole output (structured outputs), checked and mapped onto one
StructuredOutput: OpenAI's `response_format` (text, json_object, json_schema), vLLM's `structured_outputs` object
(json, regex, choice, grammar, json_object), and vLLM's older top-level `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`.

Each way is checked for its shape and size, and every refusal is an InvalidRequestError naming the field at fault
(`response_format.json_schema.schema`, `guided_choice[3]`) and the limit. A request may constrain its output one way
only: two at once are refused, naming both, never one of them silently preferred. What changes the output and is not
supported (`guided_whitespace_pattern`, a backend option such as `disable-any-whitespace`) is refused by name; what
only picks an implementation (the backend's name, `no-fallback`) is accepted and has no effect, as this server has
one grammar backend and never falls back to another.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from foundation.request_errors import InvalidRequestError
from runtimes.llm.sampling_params import StructuredOutput

MAX_SPEC_BYTES = 64 << 10  # a JSON schema (as JSON text), a regex or a grammar, in UTF-8 bytes
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's pattern for response_format.json_schema.name
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
_FORMS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs: exactly one
# vLLM's structured_outputs options, each accepted at the value that changes nothing; `disable_fallback` asks for an
# error rather than a fallback to another backend, and there is no other backend here to fall back to; objects are
# closed to their named properties either way, as with vLLM's default backend (runtimes/llm/grammar/schemas.py)
_OPTION_DEFAULTS: dict[str, tuple[object, ...]] = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False),
    "disable_additional_properties": (None, False, True),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}
_BACKEND_OPTIONS_IGNORED = ("no-fallback", "disable-additional-properties")  # what is done here anyway
# the request fields that say what the output must be (the order in which a conflict names them)
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def structured_output(fields: Mapping[str, Any], backend: Any = None,
                      whitespace_pattern: Any = None) -> StructuredOutput | None:
    """The constraint the request's `fields` (STRUCTURED_FIELDS, by name; None: not given) ask for, or None for
    free text. `backend` and `whitespace_pattern` are vLLM's `guided_decoding_backend` and
    `guided_whitespace_pattern`. Raises InvalidRequestError naming the field at fault."""
    _check_backend(backend)
    if whitespace_pattern is not None:
        raise InvalidRequestError("guided_whitespace_pattern is not supported: it changes where whitespace may appear "
                                  "in the JSON output; leave it out (or null)", param="guided_whitespace_pattern")
    found: list[tuple[str, StructuredOutput]] = []
    for name in STRUCTURED_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        parsed = _response_format(value) if name == "response_format" else (
            _structured_outputs(value) if name == "structured_outputs" else _form(name.removeprefix("guided_"),
                                                                                  value, name))
        if parsed is not None:
            found.append((name, parsed))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise InvalidRequestError(f"{names} each constrain the output; give one of them", param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's `response_format`: {"type": "text"} (free text), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}."""
    if not isinstance(value, dict):
        raise _invalid("response_format", "must be an object such as {\"type\": \"json_object\"}")
    if "type" not in value:
        raise _invalid("response_format.type", f"required: one of {_listed(RESPONSE_FORMAT_TYPES)}")
    kind = value["type"]
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _invalid("response_format.type",
                       f"{_show(kind)} is not supported; one of {_listed(RESPONSE_FORMAT_TYPES)}")
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    _refuse_other_keys(value, allowed, "response_format", f"with type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    spec = value.get("json_schema")
    if spec is None:
        raise _invalid("response_format.json_schema", "required when type is 'json_schema'")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema", "must be an object with name and schema")
    _refuse_other_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema", "")
    name = spec.get("name")
    if name is None:
        raise _invalid("response_format.json_schema.name", "required (letters, digits, '_' and '-', 1 to 64)")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _invalid("response_format.json_schema.name",
                       f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {_show(name)}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid("response_format.json_schema.strict", "must be a boolean")  # false: enforced all the same
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _invalid("response_format.json_schema.description", "must be a string")
    param = "response_format.json_schema.schema"
    if spec.get("schema") is None:
        raise _invalid(param, "required: the JSON schema the output must follow")
    if not isinstance(spec["schema"], dict):
        raise _invalid(param, "must be a JSON schema object")
    return StructuredOutput(json_schema=_schema_text(spec["schema"], param), param=param)


def _structured_outputs(value: Any) -> StructuredOutput:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object (true)."""
    if not isinstance(value, dict):
        raise _invalid("structured_outputs", f"must be an object with one of {_listed(_FORMS)}")
    _refuse_other_keys(value, (*_FORMS, *_OPTION_DEFAULTS), "structured_outputs", "")
    for option, harmless in _OPTION_DEFAULTS.items():
        setting = value.get(option)
        if not any(setting is h or (type(setting) is type(h) and setting == h) for h in harmless):
            raise _invalid(f"structured_outputs.{option}",
                           f"{_show(setting)} is not supported (it changes the output); leave it out")
    given = [form for form in _FORMS if value.get(form) is not None and not (form == "json_object" and
                                                                            value[form] is False)]
    if len(given) != 1:
        got = f"got {_listed(given)}" if given else "got none"
        raise _invalid("structured_outputs", f"give exactly one of {_listed(_FORMS)}; {got}")
    form = given[0]
    param = f"structured_outputs.{form}"
    if form == "json_object":
        if value[form] is not True:
            raise _invalid(param, "must be a boolean")
        return StructuredOutput(json_object=True, param=param)
    return _form(form, value[form], param)


def _form(form: str, value: Any, param: str) -> StructuredOutput:
    """One of vLLM's forms (json, regex, choice, grammar), given as the field `param`."""
    if form == "json":
        return StructuredOutput(json_schema=_schema_text(_schema_object(value, param), param), param=param)
    if form == "choice":
        return StructuredOutput(choice=_choices(value, param), param=param)
    what = "a regular expression" if form == "regex" else "a grammar (Lark or GBNF text)"
    text = _spec_text(value, param, what, f"the {form}")
    return StructuredOutput(regex=text, param=param) if form == "regex" else StructuredOutput(grammar=text,
                                                                                            param=param)


def _schema_object(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object, or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        _check_size(value, param, "the schema")
        try:
            value = json.loads(value)
        except RecursionError:
            raise _invalid(param, "the schema nests too deeply") from None
        except ValueError as err:
            raise _invalid(param, f"a string must be a JSON schema as JSON text: {err}") from None
    if not isinstance(value, dict):
        raise _invalid(param, "must be a JSON schema object (or its JSON text)")
    return value


def _schema_text(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text, its keys in the order given: a JSON reply's properties come in the schema's order (as
    OpenAI writes them), which a schema may rely on (say "reasoning" before "answer")."""
    try:
        text = json.dumps(schema, allow_nan=False)
    except RecursionError:
        raise _invalid(param, "the schema nests too deeply") from None
    except ValueError:
        raise _invalid(param, "the schema must be JSON (no NaN or Infinity)") from None
    _check_size(text, param, "the schema")
    return text


def _spec_text(value: Any, param: str, what: str, noun: str) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(param, f"must be {what}, as a non-empty string")
    _check_size(value, param, noun)
    return value


def _check_size(text: str, param: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise _invalid(param, f"{what} is {size:,} bytes; at most {MAX_SPEC_BYTES:,} (64 KiB)")


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _invalid(param, "must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise _invalid(param, f"at most {MAX_CHOICES} choices, got {len(value)}")
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise _invalid(f"{param}[{i}]", "must be a non-empty string")
        if len(choice) > MAX_CHOICE_CHARS:
            raise _invalid(f"{param}[{i}]", f"a choice may have at most {MAX_CHOICE_CHARS} characters, "
                                            f"got {len(choice)}")
    return tuple(value)


def _check_backend(backend: Any) -> None:
    """vLLM's `guided_decoding_backend`, "name" or "name:option,...": the name only picks an implementation (there is
    one here), but options such as `disable-any-whitespace` change the output and are refused."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise _invalid("guided_decoding_backend", "must be a string")
    _, _, options = backend.partition(":")
    changing = [option.strip() for option in options.split(",")
                if option.strip() and option.strip() not in _BACKEND_OPTIONS_IGNORED]
    if changing:
        raise _invalid("guided_decoding_backend",
                       f"backend options that change the output are not supported: {_listed(changing)} (this server "
                       f"has its own grammar backend; its name is accepted and has no effect)")


def _refuse_other_keys(value: dict[str, Any], allowed: tuple[str, ...], param: str, context: str) -> None:
    """Refuse a key this server does not know rather than ignore it: it may be asking for a constraint."""
    other = [key for key in value if key not in allowed]
    if other:
        where = f" {context}" if context else ""
        raise _invalid(f"{param}.{_clip(other[0])}", f"not a field of {param}{where} (it takes {_listed(allowed)})")


def _invalid(param: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {reason}", param=param)


def _listed(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(_clip(n)) for n in names)


def _clip(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _show(value: Any) -> str:
    """A client's value in a message, cut short."""
    return _clip(repr(value), 80)
