"""Registry problems: where (a field path such as `models[1].engine.block_size`) and what."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from foundation.field_paths import format_loc, join_field


class Problem(NamedTuple):
    """One thing wrong with a registry. `field` is a path like `models[1].engine.block_size`, or for problems that
    are not about one field, a place such as `line 4, column 7` or `(file)`; empty for the document as a whole."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class FieldProblems(ValueError):
    """Raised by cross-field validators: problems with paths relative to the object being validated.

    pydantic reports it at that object's location; `pydantic_problems` joins the two into full paths.
    """

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


class RegistryError(Exception):
    """A registry (file content or admin edit) that was not applied, with every problem found.

    str() reads one problem a line: `configs/x.yaml: models[0].replicas: Input should be greater than or equal to 0`.
    """

    def __init__(self, path: str | Path, problems: Iterable[Problem]) -> None:
        self.path = str(path)
        self.problems = tuple(problems)
        if not self.problems:
            raise ValueError("RegistryError needs at least one problem")
        super().__init__("\n".join(f"{self.path}: {p}" for p in self.problems))


class ModelNotFound(LookupError):
    """An admin edit named a model that the registry does not define (HTTP 404, not a rejected edit)."""

    def __init__(self, name: str, hint: str = "") -> None:
        self.name = name
        super().__init__(f"no model named {name!r}{hint}")


def pydantic_problems(exc: ValidationError, known_fields: Sequence[str] = ()) -> list[Problem]:
    """Every error of a pydantic validation as a `Problem` with the full field path (problems a validator raised as
    `FieldProblems` under their own paths); an unknown field gets the nearest of `known_fields` as a suggestion."""
    problems = []
    for err in exc.errors():
        where = format_loc(err["loc"])
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, FieldProblems):
            problems += [Problem(join_field(where, p.field) or "(top level)", p.message) for p in inner.problems]
            continue
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(known_fields), n=1)
            message = "unknown field" + (f"; did you mean {close[0]!r}?" if close else "")
        problems.append(Problem(where or "(top level)", message))
    return problems
