"""The daemon's HTTP endpoint for Prometheus and probes: ``/metrics``, ``/healthz``, ``/readyz``.

`MetricsServer` is a tiny HTTP/1.1 server on ``asyncio.start_server``, owned by the daemon and
living on its event loop: one short request per connection, bounded in size and time, answered
from the loop without threads. ``/metrics`` encodes whatever `CollectorRegistry` it is given (the
metrics themselves are defined in `kvsidecar.daemon.metrics.families`); a watchdog task
measures event-loop lag for ``/healthz``; ``/readyz`` decides on the `Readiness` facts a
`HealthProvider` returns.

The endpoint's reference, with the probes' semantics, is ``docs/metrics.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Final, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["HealthProvider", "MetricsServer", "Readiness"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Readiness:
    """The facts ``/readyz`` is decided on."""

    sockets_bound: bool
    """The command socket (and the peer socket, where configured) is bound."""
    host_pool_allocated: bool
    """The host block pool is allocated and touched."""
    draining: bool
    """Shutdown has begun: finish what runs, take nothing new."""

    @property
    def ready(self) -> bool:
        """Whether the daemon should be sent work."""
        return self.sockets_bound and self.host_pool_allocated and not self.draining

    def reasons(self) -> list[str]:
        """Short human-readable reasons why the daemon is not ready; empty when ready."""
        reasons = []
        if not self.sockets_bound:
            reasons.append("sockets not bound")
        if not self.host_pool_allocated:
            reasons.append("host pool not allocated")
        if self.draining:
            reasons.append("draining")
        return reasons


class HealthProvider(Protocol):
    """What the daemon implements for ``/readyz``. Called on the event loop; must not block."""

    def readiness(self) -> Readiness:
        """Return the current readiness facts."""
        ...


_TEXT: Final = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class _Response:
    status: HTTPStatus
    body: bytes
    content_type: str = _TEXT
    extra_headers: tuple[tuple[str, str], ...] = ()


class MetricsServer:
    """HTTP endpoint for Prometheus and probes, served from the daemon's event loop.

    - ``GET /metrics``: the registry in the format the ``Accept`` header asks for (Prometheus text
      0.0.4 by default, OpenMetrics when asked), as prometheus_client's own servers do.
    - ``GET /healthz``: 200 while the event loop is responsive, else 503. A watchdog task sleeps
      ``watchdog_interval_s`` at a time; a wake-up later than ``max_loop_lag_s`` marks the loop
      stalled for ``stall_hold_s``, so a probe that arrives just after a stall still sees it. A loop
      that is blocked right now answers nothing, which a probe's timeout reads as a failure.
    - ``GET /readyz``: 200 when the `HealthProvider` says ready and the loop is healthy, else 503
      with the reasons.
    - Anything else: 404 (unknown path), 405 (method other than GET/HEAD), 400 (malformed), 431
      (request head over ``max_request_bytes``), 408 (head not complete within
      ``request_timeout_s``).

    One request per connection (``Connection: close``): scrapes and probes come seconds apart, and
    it keeps the server free of keep-alive state. Collection runs on the loop, which the few
    hundred series the daemon exports keep short.

    At most ``max_connections`` are open at once; a new one beyond that closes the oldest (which
    has waited longest for its request head, or for a slow reader to take its answer). A probe
    sends its request as it connects and is answered within a loop turn, so idle or slow
    connections opened at any rate cannot make probes fail: they only push each other out.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        health: HealthProvider,
        port: int,
        host: str = "127.0.0.1",
        max_request_bytes: int = 8192,
        request_timeout_s: float = 2.0,
        max_connections: int = 64,
        watchdog_interval_s: float = 0.25,
        max_loop_lag_s: float = 1.0,
        stall_hold_s: float = 10.0,
        on_loop_lag: Callable[[float], None] | None = None,
    ) -> None:
        """Configure the server; `start` binds it. ``port=0`` binds an ephemeral port.

        ``on_loop_lag`` receives every lag measurement (wire `DaemonMetrics.observe_loop_lag`).
        """
        if max_request_bytes < 256:
            raise ValueError("max_request_bytes must be at least 256")
        self._registry = registry
        self._health = health
        self._host = host
        self._requested_port = port
        self._max_request_bytes = max_request_bytes
        self._request_timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._watchdog_interval_s = watchdog_interval_s
        self._max_loop_lag_s = max_loop_lag_s
        self._stall_hold_s = stall_hold_s
        self._on_loop_lag = on_loop_lag

        self._server: asyncio.Server | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[object], None] = {}
        """Open connections' handlers, oldest first."""
        self.evicted_total = 0
        """Connections closed to make room for a newer one."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = 0.0
        self._stalled_until = 0.0
        self._worst_recent_lag = 0.0

    async def start(self) -> None:
        """Bind the listening socket and start the loop watchdog."""
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        self._loop = asyncio.get_running_loop()
        self._last_tick = self._loop.time()
        # The stream limit bounds how much of a request head is ever buffered.
        try:
            self._server = await asyncio.start_server(
                self._handle,
                self._host,
                self._requested_port,
                limit=self._max_request_bytes,
            )
        except OSError as exc:  # a name that does not resolve, an address not ours, a port taken
            raise SystemExit(
                f"kvsidecar: cannot bind the metrics endpoint {self._host}:"
                f"{self._requested_port}: {exc.strerror or exc}"
            ) from None
        self._watchdog = asyncio.create_task(self._watch_loop(), name="kvsidecar-loop-watchdog")

    async def close(self) -> None:
        """Stop listening, abort open connections and stop the watchdog. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks: list[asyncio.Task[object]] = list(self._connections)
        if self._watchdog is not None:
            tasks.append(self._watchdog)
            self._watchdog = None
        for task in tasks:
            task.cancel()
        # Python < 3.12 does not wait for handlers in wait_closed(); cancelling them does.
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one when constructed with ``port=0``)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("MetricsServer not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        """Base URL of the endpoint, e.g. ``http://127.0.0.1:9400``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def loop_health(self) -> tuple[bool, str]:
        """Whether the event loop is responsive, with a short explanation."""
        if self._loop is None:
            return False, "not started"
        now = self._loop.time()
        since_tick = now - self._last_tick
        if since_tick > self._watchdog_interval_s + self._max_loop_lag_s:
            return False, f"event loop stalled: watchdog silent for {since_tick:.3f}s"
        if now < self._stalled_until:
            return False, (
                f"event loop stalled recently: lag {self._worst_recent_lag:.3f}s "
                f"> {self._max_loop_lag_s:.3f}s"
            )
        return True, "ok"

    async def _watch_loop(self) -> None:
        assert self._loop is not None  # set by start() before this task exists
        loop = self._loop
        interval = self._watchdog_interval_s
        while True:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            now = loop.time()
            lag = max(0.0, now - expected)
            self._last_tick = now
            if lag > self._max_loop_lag_s:
                if now >= self._stalled_until:
                    self._worst_recent_lag = 0.0
                self._worst_recent_lag = max(self._worst_recent_lag, lag)
                self._stalled_until = now + self._stall_hold_s
                logger.warning("event loop lagged %.3fs (limit %.3fs)", lag, self._max_loop_lag_s)
            if self._on_loop_lag is not None:
                try:
                    self._on_loop_lag(lag)
                except Exception:
                    logger.exception("loop-lag callback failed")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        while len(self._connections) >= self._max_connections:
            oldest = next(iter(self._connections))
            del self._connections[oldest]
            oldest.cancel()  # its ``finally`` closes its socket
            self.evicted_total += 1
        if task is not None:
            self._connections[task] = None
        try:
            response = await self._read_and_route(reader)
            if response is not None:
                writer.write(_serialize(response))
                await asyncio.wait_for(writer.drain(), self._request_timeout_s)
        except (ConnectionError, asyncio.TimeoutError):
            pass  # the client went away or stopped reading: nothing to tell it
        finally:
            writer.close()
            # The socket closes either way; waiting only collects the transport's close.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            if task is not None:
                self._connections.pop(task, None)

    async def _read_and_route(self, reader: asyncio.StreamReader) -> _Response | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._request_timeout_s)
        except asyncio.LimitOverrunError:
            return _Response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request too large\n")
        except asyncio.IncompleteReadError:
            return None  # closed before a full request head: no one to answer
        except asyncio.TimeoutError:
            return _Response(HTTPStatus.REQUEST_TIMEOUT, b"request timeout\n")
        try:
            method, target, headers = _parse_head(head)
        except ValueError:
            return _Response(HTTPStatus.BAD_REQUEST, b"bad request\n")
        if method not in ("GET", "HEAD"):
            return _Response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                b"method not allowed\n",
                extra_headers=(("Allow", "GET, HEAD"),),
            )
        response = self._route(target.split("?", 1)[0], headers)
        if method == "HEAD":
            # Same headers as GET, Content-Length included, without the body.
            return _Response(
                response.status,
                b"",
                response.content_type,
                (*response.extra_headers, ("Content-Length", str(len(response.body)))),
            )
        return response

    def _route(self, path: str, headers: Mapping[str, str]) -> _Response:
        if path == "/metrics":
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            try:
                body = encoder(self._registry)
            except Exception:
                logger.exception("metrics collection failed")
                return _Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"collection failed\n")
            return _Response(HTTPStatus.OK, body, content_type)
        if path == "/healthz":
            healthy, why = self.loop_health()
            status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            return _Response(status, f"{why}\n".encode())
        if path == "/readyz":
            reasons = []
            try:
                reasons = self._health.readiness().reasons()
            except Exception:
                logger.exception("health provider failed")
                reasons = ["health provider failed"]
            healthy, why = self.loop_health()
            if not healthy:
                reasons.append(why)
            if reasons:
                body = ("not ready: " + "; ".join(reasons) + "\n").encode()
                return _Response(HTTPStatus.SERVICE_UNAVAILABLE, body)
            return _Response(HTTPStatus.OK, b"ready\n")
        return _Response(HTTPStatus.NOT_FOUND, b"not found\n")


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Split a request head into method, target and lower-cased headers; ValueError if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise ValueError("malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError("malformed header")
        headers[name.lower()] = value.strip()
    return parts[0], parts[1], headers


def _serialize(response: _Response) -> bytes:
    headers = [
        f"HTTP/1.1 {response.status.value} {response.status.phrase}",
        f"Content-Type: {response.content_type}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    if not any(name == "Content-Length" for name, _ in response.extra_headers):
        headers.append(f"Content-Length: {len(response.body)}")
    headers.extend(f"{name}: {value}" for name, value in response.extra_headers)
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + response.body
