"""Shared pytest configuration and fixtures.

Asyncio tests run on uvloop, as the daemon does. The fixtures every room shares: daemon
processes started on demand (`daemon_factory`, `module_daemon_factory`), and a `client`
parametrized over the blocking and the asyncio client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.clients import CLIENT_KINDS, Client, connect
from tests.support.daemons import StartDaemon, daemon_processes

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


# --- shared fixtures ---------------------------------------------------------------------------
@pytest.fixture
def daemon_factory() -> Iterator[StartDaemon]:
    """``daemon_factory(**overrides)``: a ready daemon process of `make_config` with ``overrides``;
    each one started is stopped, and its runtime dir removed, after the test."""
    with daemon_processes() as start:
        yield start


@pytest.fixture(scope="module")
def module_daemon_factory() -> Iterator[StartDaemon]:
    """`daemon_factory` for daemons that a module's tests share: stopped after the module."""
    with daemon_processes() as start:
        yield start


@pytest.fixture
def endpoint(daemon_factory: StartDaemon) -> str:
    """The control endpoint `client` connects to: a fresh daemon process's, unless the module
    overrides this fixture with its own daemon's (a process: `client`'s calls block)."""
    return daemon_factory().config.endpoint


@pytest.fixture(params=CLIENT_KINDS)
def client(request: pytest.FixtureRequest, endpoint: str) -> Iterator[Client]:
    """A client of `endpoint`, once the blocking `SidecarClient` and once the asyncio
    `AsyncSidecarClient` (`tests.support.clients.BlockingAsyncClient`): for tests of what
    both clients must do."""
    with connect(request.param, endpoint) as c:
        yield c
