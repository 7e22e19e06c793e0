"""Prometheus metrics of the daemon and its HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``).

Two parts, both owned by the daemon and both living on its event loop:

- `DaemonMetrics` defines every ``kvsidecar_*`` metric on an injected `CollectorRegistry` and
  offers cheap ``record_*`` methods for the hot path. Gauges that mirror live state (registered
  workers, host pool use, in-flight moves, ...) are not set by the daemon: a custom collector reads
  them from a `StateProvider` at scrape time, so they can never drift from the truth.
- `MetricsServer` is a tiny HTTP/1.1 server on ``asyncio.start_server``: one short request per
  connection, bounded in size and time, answered from the loop without threads. A watchdog task
  measures event-loop lag for ``/healthz``; ``/readyz`` asks a `HealthProvider`.

The metric reference, with example PromQL, is ``docs/metrics.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Final, Literal, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from kvsidecar import __version__

__all__ = [
    "COMMAND_DURATION_BUCKETS",
    "LAYOUT_FIX_KINDS",
    "LOOP_LAG_BUCKETS",
    "MOVE_DURATION_BUCKETS",
    "MOVE_KINDS",
    "NAMESPACE",
    "DaemonMetrics",
    "HealthProvider",
    "LayoutFixKind",
    "MetricsServer",
    "MoveKind",
    "Readiness",
    "StateProvider",
    "StateSnapshot",
]

logger = logging.getLogger(__name__)

NAMESPACE: Final = "kvsidecar"
"""Prefix of every metric this module defines."""

MoveKind = Literal["offload", "onboard", "local", "peer_send", "peer_recv"]
"""Where a move goes: GPU→host pool, host pool→GPU, within this node, to or from a peer."""
MOVE_KINDS: Final[tuple[MoveKind, ...]] = get_args(MoveKind)

LayoutFixKind = Literal["permute", "blksize", "blksize_permute"]
"""Receive-side layout fix: NHD/HND permute, block-size remap, or both in one pass."""
LAYOUT_FIX_KINDS: Final[tuple[LayoutFixKind, ...]] = get_args(LayoutFixKind)

MOVE_DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""100 us (one small block on a fast path) to 10 s (a large peer pull on a slow link)."""

COMMAND_DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
"""Handling a command is bookkeeping on the loop: tens of microseconds when healthy."""

LOOP_LAG_BUCKETS: Final[tuple[float, ...]] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Lag of the watchdog's timer: anything above a few ms means something blocked the loop."""


# --------------------------------------------------------------------------------------------------
# What the daemon provides
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """Live daemon state, read once per scrape.

    Each per-engine mapping should name every registered engine (with 0 where nothing is pending),
    so that a series disappears exactly when its engine does.
    """

    registered_workers: Mapping[str, int] = field(default_factory=dict)
    """Workers with a live lease, by engine."""
    registered_buffer_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes of KV-cache buffers registered with the daemon, by engine."""
    aggregator_pending_requests: Mapping[str, int] = field(default_factory=dict)
    """Requests the completion aggregator still waits on, by engine."""
    host_pool_capacity_bytes: int = 0
    """Size of the daemon-owned host block pool (0 before it is allocated)."""
    host_pool_used_bytes: int = 0
    """Bytes of the host pool that hold blocks."""
    inflight_moves: int = 0
    """Moves submitted to the copy executor or a peer and not yet finished."""


class StateProvider(Protocol):
    """What the daemon implements so that state gauges are read at scrape time.

    Called on the event loop (the scrape is served there), so it may read daemon state without
    locks; it must be quick and must not block.
    """

    def metrics_state(self) -> StateSnapshot:
        """Return the current state."""
        ...


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


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _MoveSeries:
    """The label children one ``(kind, engine)`` move touches, cached for the hot path."""

    moved_bytes: Counter
    moves: Counter
    seconds: Counter
    duration: Histogram


class _StateCollector:
    """Builds the live-state gauges from a `StateProvider` at every scrape."""

    def __init__(self) -> None:
        self.provider: StateProvider | None = None

    def describe(self) -> Iterable[Metric]:
        # Lets the registry reserve the names (and catch clashes) without calling the provider.
        return self._families(StateSnapshot())

    def collect(self) -> Iterable[Metric]:
        provider = self.provider
        if provider is None:
            return []
        try:
            snapshot = provider.metrics_state()
        except Exception:
            # A bug in the provider must not take the other metrics (or the scrape) down with it;
            # the missing series are visible to `absent()` alerts.
            logger.exception("metrics state provider failed; state gauges left out of this scrape")
            return []
        return self._families(snapshot)

    @staticmethod
    def _families(s: StateSnapshot) -> list[Metric]:
        def per_engine(name: str, doc: str, values: Mapping[str, int]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=["engine"])
            for engine, value in values.items():
                family.add_metric([engine], value)
            return family

        def scalar(name: str, doc: str, value: int) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)

        return [
            per_engine(
                "registered_workers", "Workers with a live lease, by engine.", s.registered_workers
            ),
            per_engine(
                "registered_buffer_bytes",
                "Bytes of KV-cache buffers registered with the daemon, by engine.",
                s.registered_buffer_bytes,
            ),
            per_engine(
                "aggregator_pending_requests",
                "Requests the completion aggregator still waits on, by engine.",
                s.aggregator_pending_requests,
            ),
            scalar(
                "host_pool_capacity_bytes",
                "Size of the daemon-owned host block pool.",
                s.host_pool_capacity_bytes,
            ),
            scalar(
                "host_pool_used_bytes",
                "Bytes of the host block pool that hold blocks.",
                s.host_pool_used_bytes,
            ),
            scalar(
                "inflight_moves",
                "Moves submitted to the copy executor or a peer and not yet finished.",
                s.inflight_moves,
            ),
        ]


def _package_version(name: str) -> str:
    # importlib.metadata rather than `import torch`: the build label must not cost a torch import.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class DaemonMetrics:
    """Every ``kvsidecar_*`` metric, on an injected registry.

    The ``record_*`` methods are meant for the event-loop thread (the label-child caches are plain
    dicts) and cost a dict lookup plus a few locked increments once a label set has been seen.
    Label values outside the documented sets raise `ValueError` on first use, so that a typo cannot
    mint a new series.

    Byte-weighted throughput of moves is ``rate(moved_bytes_total) / rate(move_seconds_total)``
    (per engine) or ``rate(moved_bytes_total) / rate(move_duration_seconds_sum)`` (per kind): both
    denominators are sums of move durations, so the quotient is total bytes over total busy time,
    not a mean of per-move rates.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        state: StateProvider | None = None,
        build_labels: Mapping[str, str] | None = None,
    ) -> None:
        """Define the metrics on ``registry``.

        ``state`` may be given later with `attach_state`. ``build_labels`` overrides the detected
        ``version``/``python``/``torch`` values of ``kvsidecar_build_info``.
        """
        self.registry = registry
        ns = NAMESPACE

        self.moved_bytes = Counter(
            "moved_bytes",
            "Bytes moved, by move kind and engine.",
            ["kind", "engine"],
            namespace=ns,
            registry=registry,
        )
        self.moves = Counter(
            "moves",
            "Moves completed, by move kind and engine.",
            ["kind", "engine"],
            namespace=ns,
            registry=registry,
        )
        self.move_seconds = Counter(
            "move_seconds",
            "Seconds spent in completed moves, by move kind and engine "
            "(byte-weighted throughput = rate(moved_bytes_total) / rate(move_seconds_total)).",
            ["kind", "engine"],
            namespace=ns,
            registry=registry,
        )
        self.move_duration = Histogram(
            "move_duration_seconds",
            "Duration of completed moves, from submission to completion, by move kind.",
            ["kind"],
            namespace=ns,
            buckets=MOVE_DURATION_BUCKETS,
            registry=registry,
        )
        self.move_failures = Counter(
            "move_failures",
            "Moves that ended failed, by move kind and error code.",
            ["kind", "code"],
            namespace=ns,
            registry=registry,
        )
        self.layout_fixes = Counter(
            "layout_fixes",
            "Moves whose blocks went through a receive-side layout fix, by fix kind.",
            ["kind"],
            namespace=ns,
            registry=registry,
        )
        self.commands = Counter(
            "commands",
            "Commands handled, by command and result (ok or an error code).",
            ["command", "result"],
            namespace=ns,
            registry=registry,
        )
        self.command_duration = Histogram(
            "command_duration_seconds",
            "Time from decoding a command to sending its reply, by command.",
            ["command"],
            namespace=ns,
            buckets=COMMAND_DURATION_BUCKETS,
            registry=registry,
        )
        self.lease_expiries = Counter(
            "lease_expiries",
            "Worker leases that expired (worker presumed dead), by engine.",
            ["engine"],
            namespace=ns,
            registry=registry,
        )
        self.loop_lag = Histogram(
            "event_loop_lag_seconds",
            "How late the event-loop watchdog's timer fired.",
            namespace=ns,
            buckets=LOOP_LAG_BUCKETS,
            registry=registry,
        )
        self.insecure_transport = Gauge(
            "insecure_transport",
            "1 while a tcp endpoint runs without CurveZMQ encryption, else 0.",
            namespace=ns,
            registry=registry,
        )
        self.build_info = Info(
            "build",
            "Versions of kvsidecar and of what it runs on.",
            namespace=ns,
            registry=registry,
        )
        labels = {
            "version": __version__,
            "python": platform.python_version(),
            "torch": _package_version("torch"),
        }
        labels.update(build_labels or {})
        self.build_info.info(labels)

        self._state_collector = _StateCollector()
        self._state_collector.provider = state
        registry.register(self._state_collector)

        # Label-child caches: `.labels()` validates and takes the metric's lock on every call,
        # a dict lookup does neither.
        self._move_series: dict[tuple[str, str], _MoveSeries] = {}
        self._failure_series: dict[tuple[str, str], Counter] = {}
        self._command_series: dict[tuple[str, str], Counter] = {}
        self._command_duration_series: dict[str, Histogram] = {}
        self._lease_series: dict[str, Counter] = {}
        self._removals: dict[str, asyncio.TimerHandle] = {}

        # Label sets known up front start at 0, so that rate() and increase() see the first event.
        self._duration_series: dict[str, Histogram] = {
            kind: self.move_duration.labels(kind) for kind in MOVE_KINDS
        }
        self._fix_series: dict[str, Counter] = {
            kind: self.layout_fixes.labels(kind) for kind in LAYOUT_FIX_KINDS
        }

    def attach_state(self, provider: StateProvider | None) -> None:
        """Read the live-state gauges from ``provider`` from the next scrape; None omits them."""
        self._state_collector.provider = provider

    # ---- hot path --------------------------------------------------------------------------------

    def record_move(self, kind: MoveKind, engine: str, nbytes: int, seconds: float) -> None:
        """Count one successful move of ``nbytes`` bytes that took ``seconds``.

        ``seconds`` runs from submission to completion (a monotonic clock). A failed move is
        counted by `record_move_failure` alone, so that byte and time totals hold delivered data.
        """
        series = self._move_series.get((kind, engine))
        if series is None:
            series = self._new_move_series(kind, engine)
        if nbytes < 0:
            raise ValueError(f"negative byte count {nbytes}")
        # A negative (or NaN) duration would make the histogram's _sum decrease, which rate() reads
        # as a counter reset; a monotonic clock never yields one, so clamp rather than fail a move.
        if not seconds > 0.0:
            seconds = 0.0
        series.moved_bytes.inc(nbytes)
        series.moves.inc()
        series.seconds.inc(seconds)
        series.duration.observe(seconds)

    def record_move_failure(self, kind: MoveKind, code: str) -> None:
        """Count one move of ``kind`` that ended failed with error ``code``."""
        child = self._failure_series.get((kind, code))
        if child is None:
            if kind not in MOVE_KINDS:
                raise _unknown(kind, MOVE_KINDS, "move kind")
            child = self._failure_series[(kind, code)] = self.move_failures.labels(kind, code)
        child.inc()

    def record_layout_fix(self, kind: LayoutFixKind) -> None:
        """Count one move whose blocks went through layout fix ``kind``."""
        child = self._fix_series.get(kind)
        if child is None:
            raise _unknown(kind, LAYOUT_FIX_KINDS, "layout fix kind")
        child.inc()

    def record_command(self, command: str, result: str, seconds: float) -> None:
        """Count one handled ``command`` with ``result`` ("ok" or an error code) and its latency."""
        child = self._command_series.get((command, result))
        if child is None:
            child = self._command_series[(command, result)] = self.commands.labels(command, result)
        timer = self._command_duration_series.get(command)
        if timer is None:
            timer = self._command_duration_series[command] = self.command_duration.labels(command)
        child.inc()
        timer.observe(seconds if seconds > 0.0 else 0.0)

    def record_lease_expiry(self, engine: str) -> None:
        """Count one worker lease of ``engine`` that expired."""
        child = self._lease_series.get(engine)
        if child is None:
            child = self._lease_series[engine] = self.lease_expiries.labels(engine)
        child.inc()

    def observe_loop_lag(self, seconds: float) -> None:
        """Record one measurement of event-loop lag (`MetricsServer` calls this)."""
        self.loop_lag.observe(seconds if seconds > 0.0 else 0.0)

    def set_insecure_transport(self, insecure: bool) -> None:
        """Set whether any tcp endpoint runs without encryption."""
        self.insecure_transport.set(1 if insecure else 0)

    # ---- engine lifecycle ------------------------------------------------------------------------

    def add_engine(self, engine: str) -> None:
        """Start the per-engine counters of ``engine`` at 0 and cancel its pending removal.

        Optional (recording creates series too), but a series that exists before its first event
        lets ``rate()`` and ``increase()`` count that event.
        """
        handle = self._removals.pop(engine, None)
        if handle is not None:
            handle.cancel()
        for kind in MOVE_KINDS:
            if (kind, engine) not in self._move_series:
                self._new_move_series(kind, engine)
        if engine not in self._lease_series:
            self._lease_series[engine] = self.lease_expiries.labels(engine)

    def remove_engine(self, engine: str, *, grace_s: float = 0.0) -> None:
        """Remove every label set of ``engine``, now or after ``grace_s`` seconds.

        Removing a counter loses whatever it gained since the last scrape (typically the very lease
        expiry that made the engine leave), so a departing engine should get a grace period of two
        scrape intervals or more. A grace period needs a running event loop; `add_engine` cancels
        it when the engine comes back first. Live-state gauges need no removal: they follow the
        `StateProvider`.
        """
        pending = self._removals.pop(engine, None)
        if pending is not None:
            pending.cancel()
        if grace_s > 0.0:
            loop = asyncio.get_running_loop()
            self._removals[engine] = loop.call_later(grace_s, self._remove_now, engine)
        else:
            self._remove_now(engine)

    def _remove_now(self, engine: str) -> None:
        self._removals.pop(engine, None)
        for kind in MOVE_KINDS:
            self._move_series.pop((kind, engine), None)
            for metric in (self.moved_bytes, self.moves, self.move_seconds):
                metric.remove(kind, engine)
        self._lease_series.pop(engine, None)
        self.lease_expiries.remove(engine)

    def _new_move_series(self, kind: str, engine: str) -> _MoveSeries:
        duration = self._duration_series.get(kind)
        if duration is None:
            raise _unknown(kind, MOVE_KINDS, "move kind")
        series = _MoveSeries(
            moved_bytes=self.moved_bytes.labels(kind, engine),
            moves=self.moves.labels(kind, engine),
            seconds=self.move_seconds.labels(kind, engine),
            duration=duration,
        )
        self._move_series[(kind, engine)] = series
        return series


def _unknown(value: str, allowed: tuple[str, ...], what: str) -> ValueError:
    return ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


# --------------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------------

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
    it keeps the server free of keep-alive state. Collection runs on the loop; with the few hundred
    series the daemon exports it takes well under a millisecond.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        health: HealthProvider,
        port: int,
        host: str = "127.0.0.1",
        max_request_bytes: int = 8192,
        request_timeout_s: float = 5.0,
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
        self._connections: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = 0.0
        self._stalled_until = 0.0
        self._worst_recent_lag = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the listening socket and start the loop watchdog."""
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        self._loop = asyncio.get_running_loop()
        self._last_tick = self._loop.time()
        # The stream limit bounds how much of a request head is ever buffered.
        self._server = await asyncio.start_server(
            self._handle,
            self._host,
            self._requested_port,
            limit=self._max_request_bytes,
        )
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

    # ---- health ------------------------------------------------------------------------------

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

    # ---- requests ----------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            response: _Response | None
            if len(self._connections) > self._max_connections:
                response = _Response(HTTPStatus.SERVICE_UNAVAILABLE, b"too many connections\n")
            else:
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
                self._connections.discard(task)

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
