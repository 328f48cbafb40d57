"""Field paths as people read them (`models[1].engine.block_size`), for the registry's problems and for the 400s
that name the field of a request at fault."""

from __future__ import annotations


def join_field(prefix: str, rest: str) -> str:
    """`models[1]` + `engine.block_size` -> `models[1].engine.block_size`; `urls` + `[2]` -> `urls[2]`."""
    if not prefix or not rest:
        return prefix or rest
    return f"{prefix}{rest}" if rest.startswith("[") else f"{prefix}.{rest}"


def format_loc(loc: tuple[int | str, ...]) -> str:
    """pydantic's `('models', 1, 'engine')` -> `models[1].engine`."""
    out = ""
    for part in loc:
        out = join_field(out, f"[{part}]" if isinstance(part, int) else str(part))
    return out
