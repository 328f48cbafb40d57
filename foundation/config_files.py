"""Where the files an operator edits live: `configs/` at the top of a source checkout (the default registry, the GPU
inventories, the model shapes, the examples; configs/README.md lists them). A wheel carries that folder as
`foundation/configs/` (pyproject.toml maps it there), beside this module. This is the one place that knows either
location: code that reads a shipped config file asks `config_path`."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
_INSTALLED = _HERE / "configs"  # an installed wheel
_CHECKOUT = _HERE.parent / "configs"  # a source checkout (editable install, or the checkout on PYTHONPATH)

CONFIG_DIR = _INSTALLED if _INSTALLED.is_dir() else _CHECKOUT


def config_path(*parts: str) -> Path:
    """A shipped config file or folder by its path under configs/, e.g. `config_path("inventories", "h100-80gb.json")`
    (it need not exist: callers report a missing file as they would any other)."""
    return CONFIG_DIR.joinpath(*parts)


def shown_path(path: Path) -> str:
    """`path` as an operator would type it: relative to the checkout (`configs/inventories/h100-80gb.json`, as the
    docs spell it) when it is a shipped file of a source checkout, else as given."""
    if CONFIG_DIR == _CHECKOUT:
        try:
            return path.resolve().relative_to(_CHECKOUT.parent).as_posix()
        except ValueError:
            pass
    return str(path)
