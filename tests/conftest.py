"""Shared pytest configuration: run asyncio tests on uvloop, as the daemon does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None


@pytest.hookimpl(optionalhook=True)  # the -m gpu tests also run where pytest-asyncio is not
def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], Any]]:
    """Give every asyncio test a uvloop event loop (plain asyncio where uvloop is missing)."""
    if uvloop is None:
        import asyncio

        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


# --- slow tests (soak, long fuzz) run only when selected with -m slow --------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``slow``-marked tests unless the marker expression names ``slow``."""
    if "slow" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
