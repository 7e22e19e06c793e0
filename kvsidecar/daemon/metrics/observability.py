"""The daemon's metrics and probes: what the metrics modules need from a running daemon.

`kvsidecar.daemon.metrics.families` (the metrics), `kvsidecar.daemon.metrics.state` (the scrape-time
state) and `kvsidecar.daemon.metrics.server` (the HTTP endpoint) know nothing of the daemon; this
module is the glue, so that the daemon's services only call a handful of methods:

- `Observability` owns the daemon's `CollectorRegistry` (never the process-global one), its
  `DaemonMetrics` and, unless ``metrics_port`` is negative, its `MetricsServer`;
- `move_kind` / `fix_kind` classify a move the way the metrics label it;
- `snapshot` and `readiness` build the scrape-time state and the ``/readyz`` facts from the
  daemon's parts (`kvsidecar.daemon.server.Daemon`'s `metrics_state` / `readiness` call them).

``prometheus_client.disable_created_metrics()`` is process-wide, so it is not called here: the
CLI entry points (``kvsidecar serve``, ``python -m kvsidecar.daemon``) call it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from kvsidecar.daemon.metrics.cache import CacheMetrics, CacheState
from kvsidecar.daemon.metrics.families import DaemonMetrics, LayoutFixKind, MoveKind
from kvsidecar.daemon.metrics.server import MetricsServer, Readiness
from kvsidecar.daemon.metrics.state import StateProvider, StateSnapshot
from kvsidecar.daemon.metrics.tiers import TierMetrics, TierState
from kvsidecar.node.config import Config
from kvsidecar.node.registry import Registry
from kvsidecar.wire.protocol import Error, Move, Reply
from kvsidecar.wire.types import BufferDescriptor, BufferSetRef

__all__ = [
    "Observability",
    "fix_kind",
    "move_fix_kind",
    "move_kind",
    "readiness",
    "snapshot",
]

log = logging.getLogger("kvsidecar.observability")


class _HealthAdapter:
    """Adapts a readiness callable to `kvsidecar.daemon.metrics.server.HealthProvider`."""

    def __init__(self, ready: Callable[[], Readiness]) -> None:
        self._ready = ready

    def readiness(self) -> Readiness:
        return self._ready()


class Observability:
    """Metrics registry, recorders and the HTTP endpoint of one daemon.

    Construct with the config; `start` binds the endpoint (after the daemon's sockets, so that
    ``/readyz`` never says ready before they are bound), `close` unbinds it (last in shutdown, so
    that ``/readyz`` reports the drain while it runs).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = DaemonMetrics(self.registry)
        self.server: MetricsServer | None = None

    def cache_metrics(self, state: Callable[[], CacheState]) -> CacheMetrics:
        """Define the prefix cache's metrics on this registry, its gauges read from ``state``."""
        return CacheMetrics(self.registry, state)

    def tier_metrics(self, states: Callable[[], Iterable[TierState]]) -> TierMetrics:
        """Define the cache tiers' metrics on this registry, their gauges read from ``states``."""
        return TierMetrics(self.registry, states)

    async def start(self, state: StateProvider, ready: Callable[[], Readiness]) -> None:
        """Attach the state provider and bind the endpoint (none when ``metrics_port`` < 0)."""
        self.metrics.attach_state(state)
        if self.config.metrics_port < 0:
            log.info("metrics endpoint disabled (metrics_port < 0)")
            return
        server = MetricsServer(
            registry=self.registry,
            health=_HealthAdapter(ready),
            host=self.config.metrics_host,
            port=self.config.metrics_port,
            on_loop_lag=self.metrics.observe_loop_lag,
        )
        await server.start()
        self.server = server
        log.info("metrics, /healthz and /readyz on %s", server.url)

    async def close(self) -> None:
        """Unbind the endpoint. Idempotent."""
        server, self.server = self.server, None
        if server is not None:
            await server.close()

    @property
    def port(self) -> int:
        """The bound port of the endpoint (the real one when configured 0), 0 when there is none."""
        return 0 if self.server is None else self.server.port

    def loop_healthy(self) -> bool:
        """Whether the event-loop watchdog sees a responsive loop (True without an endpoint)."""
        return True if self.server is None else self.server.loop_health()[0]

    def command(self, command: str, reply: Reply, started: float) -> None:
        """Count one answered command with its result and the time since ``started``."""
        result = reply.code if isinstance(reply, Error) else "ok"
        self.metrics.record_command(command, result, time.perf_counter() - started)

    def move_done(self, kind: MoveKind, engine: str, nbytes: int, seconds: float) -> None:
        """Count one successful move."""
        self.metrics.record_move(kind, engine, nbytes, seconds)

    def move_failed(self, kind: MoveKind, code: str) -> None:
        """Count one failed move by its error code."""
        self.metrics.record_move_failure(kind, code)

    def layout_fixed(self, kind: LayoutFixKind | None) -> None:
        """Count one receive-side layout fix (None: the move needed none)."""
        if kind is not None:
            self.metrics.record_layout_fix(kind)

    def engine_added(self, engine: str) -> None:
        """Start an engine's series at 0 (cancels a pending removal)."""
        self.metrics.add_engine(engine)

    def engine_departed(self, engine: str) -> None:
        """Remove an engine's series after ``metrics_grace_s`` (so the last scrape sees them)."""
        self.metrics.remove_engine(engine, grace_s=self.config.metrics_grace_s)

    def lease_expired(self, engine: str) -> None:
        """Count one expired worker lease."""
        self.metrics.record_lease_expiry(engine)


def move_kind(src: BufferSetRef, dst: BufferSetRef) -> MoveKind:
    """Label a node-local move: into the host pool, out of it, or buffer to buffer."""
    if src.medium == "device" and dst.medium == "host":
        return "offload"
    if src.medium == "host" and dst.medium == "device":
        return "onboard"
    return "local"


def fix_kind(src: BufferDescriptor, dst: BufferDescriptor) -> LayoutFixKind | None:
    """Which receive-side fix a raw copy from ``src`` into ``dst`` layout needs, if any.

    Mirrors `kvsidecar.node.jobs`: a fix when the memory orders differ, or when the destination's
    blocks hold several source blocks and are HND (token-major concatenation is then wrong).
    """
    if src.arrangement == "mla" or src.num_heads == 1:
        return None
    ratio = dst.block_size // src.block_size if src.block_size else 1
    permute = src.memory_order != dst.memory_order
    if ratio > 1 and permute:
        return "blksize_permute"
    if ratio > 1 and dst.memory_order == "HND":
        return "blksize"
    return "permute" if permute else None


def move_fix_kind(registry: Registry, move: Move) -> LayoutFixKind | None:
    """Return the layout fix a checked `Move` applies (its strongest over its layers)."""
    src = registry.buffer_set(move.src)
    dst = registry.buffer_set(move.dst)
    names = move.layers or list(src.layers)
    kinds = {fix_kind(src.layers[n].descriptor, dst.layers[n].descriptor) for n in names}
    # Layers may differ (an MLA layer needs none); the move counts once, by its strongest fix.
    order: tuple[LayoutFixKind, ...] = ("blksize_permute", "blksize", "permute")
    for kind in order:
        if kind in kinds:
            return kind
    return None


def snapshot(
    registry: Registry,
    *,
    pool_capacity: int,
    pool_used: int,
    in_flight: int,
    pending: dict[str, int],
    defences: dict[tuple[str, str], int] | None = None,
) -> StateSnapshot:
    """Build the scrape-time state: per engine workers, buffer bytes, pending requests."""
    workers: dict[str, int] = {}
    buffers: dict[str, int] = {}
    for engine_id, engine in registry.engines.items():
        workers[engine_id] = len(engine.workers)
        buffers[engine_id] = sum(w.device.nbytes for w in engine.workers.values())
    # Exactly the registered engines (0 if nothing waits), so a series vanishes with its engine;
    # the aggregation keeps a departed engine's state a while longer, not its series.
    pending_all = {engine_id: pending.get(engine_id, 0) for engine_id in registry.engines}
    return StateSnapshot(
        registered_workers=workers,
        registered_buffer_bytes=buffers,
        aggregator_pending_requests=pending_all,
        host_pool_capacity_bytes=pool_capacity,
        host_pool_used_bytes=pool_used,
        inflight_moves=in_flight,
        host_blocks_capacity={e: engine.host_blocks for e, engine in registry.engines.items()},
        host_blocks_used={e: engine.host_used() for e, engine in registry.engines.items()},
        defence_events=defences or {},
    )


def readiness(
    *, sockets_bound: bool, pool_needed: bool, pool_allocated: bool, draining: bool
) -> Readiness:
    """Build the ``/readyz`` facts; a daemon without a host pool never waits for one."""
    return Readiness(
        sockets_bound=sockets_bound,
        host_pool_allocated=pool_allocated or not pool_needed,
        draining=draining,
    )
