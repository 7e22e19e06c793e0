"""Both clients behind one interface, for tests that mean either client.

`BlockingAsyncClient` runs an `AsyncSidecarClient` on an event loop of its own thread (uvloop,
as the daemon's) and waits for each call's result there, so that a test written against
`SidecarClient`'s methods runs unchanged against the asyncio client, over its own transport.
`connect` opens either kind by name (``"blocking"`` or ``"async"``).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvsidecar.client import AsyncSidecarClient, SidecarClient

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None

T = TypeVar("T")

CLIENT_KINDS = ("blocking", "async")
"""The two clients, as `connect` names them."""

CALL_TIMEOUT_S = 60.0
"""A bound on any one call through `BlockingAsyncClient` (the client's own timeouts are shorter)."""


class BlockingAsyncClient:
    """An `AsyncSidecarClient` on a loop thread; each of its coroutine methods, a blocking call."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self._client = self._wait(self._open(endpoint, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _open(endpoint: str, kwargs: dict[str, Any]) -> AsyncSidecarClient:
        # Made on the loop thread: the client's futures and lock belong to that loop.
        client = AsyncSidecarClient(endpoint, **kwargs)
        await client.start()
        return client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)
        if not inspect.iscoroutinefunction(method):
            raise AttributeError(f"{name} is not a call of the asyncio client")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._wait(method(*args, **kwargs))

        call.__name__ = name
        return call

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def close(self) -> None:
        """Close the client, then stop and close its loop."""
        try:
            self._wait(self._client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CALL_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> BlockingAsyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Client = SidecarClient | BlockingAsyncClient
"""Either client, called the blocking way."""


def connect(kind: str, endpoint: str, **kwargs: Any) -> Client:
    """A connected client of ``kind`` (one of `CLIENT_KINDS`); ``kwargs`` go to its constructor."""
    if kind == "blocking":
        return SidecarClient(endpoint, **kwargs)
    if kind == "async":
        return BlockingAsyncClient(endpoint, **kwargs)
    raise ValueError(f"unknown client kind {kind!r}")
