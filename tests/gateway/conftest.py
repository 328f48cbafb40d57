"""Gateway fixtures: run an async scenario against a whole gateway built over fakes (see `fakes.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.fakes import Scenario, open_gateway


@pytest.fixture
def with_gateway(tmp_path: Path) -> Callable[..., None]:
    """Factory: `with_gateway(scenario, **options)` runs `await scenario(gateway)` in a fresh event loop;
    options go to `open_gateway` (registry text, pool/proxy settings, API keys, admin token, ready)."""

    def run(scenario: Scenario, **options: Any) -> None:
        async def main() -> None:
            async with open_gateway(tmp_path, **options) as gateway:
                await scenario(gateway)

        asyncio.run(main())

    return run
