"""Prometheus metrics of the daemon: every ``kvsidecar_*`` family, recorded on the hot path.

`DaemonMetrics` defines every ``kvsidecar_*`` metric on an injected `CollectorRegistry` and offers
cheap ``record_*`` methods for the hot path, on the daemon's event loop. Gauges that mirror live
state (registered workers, host pool use, in-flight moves, ...) are not set by the daemon: the
`kvsidecar.daemon.metrics.state` collector reads them from a `StateProvider` at scrape time, so
they can never drift from the truth.

The HTTP endpoint that serves the registry (and the probes) is `kvsidecar.daemon.metrics.server`.
The metric reference, with example PromQL, is ``docs/metrics.md``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import platform
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeVar, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvsidecar import __version__
from kvsidecar.daemon.metrics.state import StateCollector, StateProvider
from kvsidecar.daemon.metrics.tally import CounterFamily, HistogramFamily, Tally

__all__ = [
    "COMMAND_DURATION_BUCKETS",
    "LAYOUT_FIX_KINDS",
    "LOOP_LAG_BUCKETS",
    "MOVE_DURATION_BUCKETS",
    "MOVE_KINDS",
    "NAMESPACE",
    "DaemonMetrics",
    "LayoutFixKind",
    "MoveKind",
]

NAMESPACE: Final = "kvsidecar"
"""Prefix of every metric the daemon exports (`DaemonMetrics` gives it to the state gauges)."""

MoveKind = Literal["offload", "onboard", "local", "peer_send", "peer_recv"]
"""Where a move goes: GPU→host pool, host pool→GPU, within this node, to or from a peer."""
MOVE_KINDS: Final[tuple[MoveKind, ...]] = get_args(MoveKind)

LayoutFixKind = Literal["permute", "blksize", "blksize_permute"]
"""Receive-side layout fix: NHD/HND permute, block-size remap, or both in one pass."""
LAYOUT_FIX_KINDS: Final[tuple[LayoutFixKind, ...]] = get_args(LayoutFixKind)


def _ladder(low: float, high: float) -> tuple[float, ...]:
    """Bucket bounds 1, 2.5 and 5 times each power of ten, from ``low`` to ``high`` included."""
    # Parsed from decimal text, so that each bound is the float its literal would be: a bound is
    # a label value (``le="0.00025"``), and 2.5 * 10**-4 is not 0.00025.
    steps = (float(f"{m}e{e}") for e in range(-9, 10) for m in ("1", "2.5", "5"))
    return tuple(bound for bound in steps if low <= bound <= high)


MOVE_DURATION_BUCKETS: Final[tuple[float, ...]] = _ladder(0.0001, 10.0)
"""100 µs (one small block on a fast path) to 10 s (a large peer pull on a slow link)."""

COMMAND_DURATION_BUCKETS: Final[tuple[float, ...]] = (*_ladder(0.000025, 0.25), 1.0)
"""Handling a command is bookkeeping on the loop, far shorter than a move: 25 µs to 1 s."""

LOOP_LAG_BUCKETS: Final[tuple[float, ...]] = _ladder(0.001, 10.0)
"""Lag of the watchdog's timer: anything above a few ms means something blocked the loop."""


_Family = TypeVar("_Family", Counter, Gauge, Info)


def _define(
    metric_type: type[_Family],
    registry: CollectorRegistry,
    name: str,
    doc: str,
    labels: tuple[str, ...] = (),
) -> _Family:
    return metric_type(name, doc, labels, namespace=NAMESPACE, registry=registry)


def _histogram(
    registry: CollectorRegistry,
    name: str,
    doc: str,
    buckets: tuple[float, ...],
    labels: tuple[str, ...] = (),
) -> Histogram:
    return Histogram(name, doc, labels, namespace=NAMESPACE, buckets=buckets, registry=registry)


@dataclass(frozen=True, slots=True)
class _MoveFamilies:
    """What moves did: totals by kind and engine, durations by kind, failures, layout fixes.

    The four a successful move updates are kept by the `Tally` (the hot path); failures and
    layout fixes are prometheus_client counters.
    """

    moved_bytes: CounterFamily
    moves: CounterFamily
    seconds: CounterFamily
    duration: HistogramFamily
    failures: Counter
    layout_fixes: Counter

    @classmethod
    def define(cls, registry: CollectorRegistry, tally: Tally) -> _MoveFamilies:
        """Define the move metrics on ``tally`` and ``registry``."""
        by_kind_engine = ("kind", "engine")
        return cls(
            moved_bytes=tally.counter(
                "moved_bytes", "Bytes moved, by move kind and engine.", by_kind_engine
            ),
            moves=tally.counter(
                "moves", "Moves completed, by move kind and engine.", by_kind_engine
            ),
            seconds=tally.counter(
                "move_seconds",
                "Seconds spent in completed moves, by move kind and engine "
                "(byte-weighted throughput = rate(moved_bytes_total) / rate(move_seconds_total)).",
                by_kind_engine,
            ),
            duration=tally.histogram(
                "move_duration_seconds",
                "Duration of completed moves, from submission to completion, by move kind.",
                ("kind",),
                MOVE_DURATION_BUCKETS,
            ),
            failures=_define(
                Counter,
                registry,
                "move_failures",
                "Moves that ended failed, by move kind and error code.",
                ("kind", "code"),
            ),
            layout_fixes=_define(
                Counter,
                registry,
                "layout_fixes",
                "Moves whose blocks went through a receive-side layout fix, by fix kind.",
                ("kind",),
            ),
        )


@dataclass(frozen=True, slots=True)
class _CommandFamilies:
    """What commands did: how many, with which result, and how long each took (in the `Tally`)."""

    handled: CounterFamily
    duration: HistogramFamily

    @classmethod
    def define(cls, tally: Tally) -> _CommandFamilies:
        """Define the command metrics on ``tally``."""
        return cls(
            handled=tally.counter(
                "commands",
                "Commands handled, by command and result (ok or an error code).",
                ("command", "result"),
            ),
            duration=tally.histogram(
                "command_duration_seconds",
                "Time from decoding a command to sending its reply, by command.",
                ("command",),
                COMMAND_DURATION_BUCKETS,
            ),
        )


@dataclass(frozen=True, slots=True)
class _DaemonFamilies:
    """The daemon's own condition: expired worker leases, loop lag, unencrypted transport, build."""

    lease_expiries: Counter
    loop_lag: Histogram
    insecure_transport: Gauge
    build: Info

    @classmethod
    def define(
        cls, registry: CollectorRegistry, build_labels: Mapping[str, str] | None
    ) -> _DaemonFamilies:
        """Define the daemon metrics on ``registry``; ``build_labels`` see `DaemonMetrics`."""
        families = cls(
            lease_expiries=_define(
                Counter,
                registry,
                "lease_expiries",
                "Worker leases that expired (worker presumed dead), by engine.",
                ("engine",),
            ),
            loop_lag=_histogram(
                registry,
                "event_loop_lag_seconds",
                "How late the event-loop watchdog's timer fired.",
                LOOP_LAG_BUCKETS,
            ),
            insecure_transport=_define(
                Gauge,
                registry,
                "insecure_transport",
                "1 while a tcp endpoint runs without CurveZMQ encryption, else 0.",
            ),
            build=_define(Info, registry, "build", "Versions of kvsidecar and of what it runs on."),
        )
        labels = {
            "version": __version__,
            "python": platform.python_version(),
            "torch": _package_version("torch"),
        }
        labels.update(build_labels or {})
        families.build.info(labels)
        return families


def _package_version(name: str) -> str:
    # importlib.metadata rather than `import torch`: the build label must not cost a torch import.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclass(slots=True)
class _MoveSeries:
    """The `Tally` series one ``(kind, engine)`` move adds to, cached for the hot path."""

    moved_bytes: list[float]
    moves: list[float]
    seconds: list[float]
    duration: list[float]


class DaemonMetrics:
    """Every ``kvsidecar_*`` metric, on an injected registry.

    The ``record_*`` methods cost a dict lookup and a few additions under one lock once a label
    set has been seen (`kvsidecar.daemon.metrics.tally`); `record_command` may be called from
    any thread, the others from the event loop.
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
        self._tally = Tally(NAMESPACE)
        self._lock = self._tally.lock
        self._moves = _MoveFamilies.define(registry, self._tally)
        self._commands = _CommandFamilies.define(self._tally)
        registry.register(self._tally)
        self._daemon = _DaemonFamilies.define(registry, build_labels)
        self._state_collector = StateCollector(state, namespace=NAMESPACE)
        registry.register(self._state_collector)

        # Label-child caches: `.labels()` validates and takes the metric's lock on every call,
        # a dict lookup does neither.
        self._move_series: dict[tuple[str, str], _MoveSeries] = {}
        self._failure_series: dict[tuple[str, str], Counter] = {}
        self._command_series: dict[tuple[str, str], list[float]] = {}
        self._command_duration_series: dict[str, list[float]] = {}
        self._lease_series: dict[str, Counter] = {}
        self._removals: dict[str, asyncio.TimerHandle] = {}

        # Label sets known up front start at 0, so that rate() and increase() see the first event.
        self._duration_series: dict[str, list[float]] = {}
        with self._lock:
            for kind in MOVE_KINDS:
                self._duration_series[kind] = self._moves.duration.cell((kind,))
        self._fix_series: dict[str, Counter] = {
            kind: self._moves.layout_fixes.labels(kind) for kind in LAYOUT_FIX_KINDS
        }

    def attach_state(self, provider: StateProvider | None) -> None:
        """Read the live-state gauges from ``provider`` from the next scrape; None omits them."""
        self._state_collector.provider = provider

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
        with self._lock:
            series.moved_bytes[0] += nbytes
            series.moves[0] += 1
            series.seconds[0] += seconds
            duration = series.duration
            duration[bisect_left(MOVE_DURATION_BUCKETS, seconds)] += 1
            duration[-1] += seconds

    def record_move_failure(self, kind: MoveKind, code: str) -> None:
        """Count one move of ``kind`` that ended failed with error ``code``."""
        child = self._failure_series.get((kind, code))
        if child is None:
            if kind not in MOVE_KINDS:
                raise _unknown(kind, MOVE_KINDS, "move kind")
            child = self._failure_series[(kind, code)] = self._moves.failures.labels(kind, code)
        child.inc()

    def record_layout_fix(self, kind: LayoutFixKind) -> None:
        """Count one move whose blocks went through layout fix ``kind``."""
        child = self._fix_series.get(kind)
        if child is None:
            raise _unknown(kind, LAYOUT_FIX_KINDS, "layout fix kind")
        child.inc()

    def record_command(self, command: str, result: str, seconds: float) -> None:
        """Count one handled ``command`` with ``result`` ("ok" or an error code) and its latency."""
        if not seconds > 0.0:
            seconds = 0.0
        with self._lock:
            count = self._command_series.get((command, result))
            if count is None:
                count = self._command_series[(command, result)] = self._commands.handled.cell(
                    (command, result)
                )
            timer = self._command_duration_series.get(command)
            if timer is None:
                timer = self._command_duration_series[command] = self._commands.duration.cell(
                    (command,)
                )
            count[0] += 1
            timer[bisect_left(COMMAND_DURATION_BUCKETS, seconds)] += 1
            timer[-1] += seconds

    def record_lease_expiry(self, engine: str) -> None:
        """Count one worker lease of ``engine`` that expired."""
        child = self._lease_series.get(engine)
        if child is None:
            child = self._lease_series[engine] = self._daemon.lease_expiries.labels(engine)
        child.inc()

    def observe_loop_lag(self, seconds: float) -> None:
        """Record one measurement of event-loop lag (the `MetricsServer` watchdog calls this)."""
        self._daemon.loop_lag.observe(seconds if seconds > 0.0 else 0.0)

    def set_insecure_transport(self, insecure: bool) -> None:
        """Set whether any tcp endpoint runs without encryption."""
        self._daemon.insecure_transport.set(1 if insecure else 0)

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
            self._lease_series[engine] = self._daemon.lease_expiries.labels(engine)

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
        moves = self._moves
        with self._lock:
            for kind in MOVE_KINDS:
                self._move_series.pop((kind, engine), None)
                for family in (moves.moved_bytes, moves.moves, moves.seconds):
                    family.series.pop((kind, engine), None)
        self._lease_series.pop(engine, None)
        self._daemon.lease_expiries.remove(engine)

    def _new_move_series(self, kind: str, engine: str) -> _MoveSeries:
        duration = self._duration_series.get(kind)
        if duration is None:
            raise _unknown(kind, MOVE_KINDS, "move kind")
        labels = (kind, engine)
        with self._lock:
            series = _MoveSeries(
                moved_bytes=self._moves.moved_bytes.cell(labels),
                moves=self._moves.moves.cell(labels),
                seconds=self._moves.seconds.cell(labels),
                duration=duration,
            )
        self._move_series[(kind, engine)] = series
        return series


def _unknown(value: str, allowed: tuple[str, ...], what: str) -> ValueError:
    return ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
