"""Which handler answers a checked request: one `match` over the request union.

`Router` is built at start-up with the daemon's services (`kvsidecar.daemon.moves`,
`registration`, `cache.commands`, the completions, the peer service) and is the route of the
control socket (`kvsidecar.daemon.control`), which has decoded, checked and authorized each
request once before it gets here. ``status`` is assembled here from the parts that own its fields.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any

from kvsidecar import __version__
from kvsidecar.daemon.cache.commands import CacheCommands
from kvsidecar.daemon.cache.worker_events import WorkerEvents
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.control import ControlSocket, Dispatched, ReplyTo
from kvsidecar.daemon.limits.access import AccessControl, Principal
from kvsidecar.daemon.metrics.families import MoveKind
from kvsidecar.daemon.metrics.observability import Observability
from kvsidecar.daemon.moves import Moves
from kvsidecar.daemon.registration import Registrations, check_version
from kvsidecar.daemon.state import DaemonState, MoveTotals
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.registry import Engine, Registry, check_epoch
from kvsidecar.peer.service import PeerService
from kvsidecar.wire.batch import MoveBatch
from kvsidecar.wire.cache import CacheLoad, CacheLookup, CacheStore, TakeWorkerEvents
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Collect,
    FixLayout,
    Grant,
    Heartbeat,
    Hello,
    HostAlloc,
    HostFree,
    Move,
    Register,
    Reply,
    Report,
    Request,
    Status,
    StatusReply,
    Unregister,
)
from kvsidecar.wire.pulls import PeerEvents, Publish, Pull, Pulled, TakePeerEvents
from kvsidecar.wire.types import WorkerRef


class Router:
    """Routes each checked request to its handler (see the module doc)."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        *,
        state: DaemonState,
        totals: MoveTotals,
        control: ControlSocket,
        executor: CopyExecutor,
        pool: HostPool | None,
        access: AccessControl,
        observability: Observability,
        completions: CompletionService,
        worker_events: WorkerEvents,
        registrations: Registrations,
        moves: Moves,
        cache: CacheCommands,
        peer: PeerService,
    ) -> None:
        self._config = config
        self._registry = registry
        self._state = state
        self._totals = totals
        self._control = control
        self._executor = executor
        self._pool = pool
        self._access = access
        self._observability = observability
        self._completions = completions
        self._worker_events = worker_events
        self._registrations = registrations
        self._moves = moves
        self._cache = cache
        self._peer = peer
        self._started_at = time.monotonic()

    def dispatch(
        self, req: Request, data: list[memoryview], reply_to: ReplyTo, who: Principal
    ) -> Dispatched:
        """Answer a request inline (a reply and its data frames), or return what answers later.

        ``who`` sent it (`authorize` already let it through); registrations, grants and pulls
        need it again further on. That is a coroutine (run as a task), the future of a peer
        pull's reply, or for copy jobs their outcome (the job answers through ``reply_to``
        itself, or has answered already: None).
        """
        match req:
            case Move():  # the most frequent command: matched first
                return self._moves.move(req, data, reply_to)
            case Hello():
                check_version(req.protocol_version)
                return self._registrations.hello(req), ()
            case Status():
                return self.status(req, who), ()
            case Heartbeat():
                return self._registrations.heartbeat(req, who), ()
            case HostAlloc():
                return self._moves.host_alloc(req)
            case HostFree():
                return self._moves.host_free(req, data[0]), ()
            case MoveBatch():
                return self._moves.move_batch(req, data, reply_to)
            case Grant():
                return self._registrations.grant(req, who), ()
            case CacheLookup():
                return self._cache.lookup(req, data, reply_to.user)
            case CacheStore():
                return self._cache.store(req, data, reply_to, reply_to.user)
            case CacheLoad():
                return self._cache.load(req, data, reply_to, reply_to.user)
            case TakeWorkerEvents():
                check_epoch(self._registry.worker(req.worker), req.epoch)
                return PeerEvents(id=req.id, events=self._worker_events.take(req.worker)), ()
            case FixLayout():
                return self._moves.fix_layout(req, data, reply_to)
            case Pull():
                remote = self._moves.ids(data[0], req.ids_dtype, "remote block")
                local = self._moves.ids(data[1], req.ids_dtype, "local block")

                # A pull served by this very daemon (an empty endpoint, or its own peer
                # endpoint) reads its own engines' published blocks: the same user's, or granted.
                def may_read(engine_id: str) -> bool:
                    acl = self._access
                    return acl.same_user(who, engine_id) or acl.may(who, engine_id, write=False)

                pulled = self._peer.pull(req, remote, local, may_read)
                return self._counted_pull(req, pulled)
            case Publish():
                ids = self._moves.ids(data[0], req.ids_dtype, "block")
                return self._peer.publish(req, ids), ()
            case TakePeerEvents():
                return self._peer.take_events(req), ()
            case Report():
                return self._completions.report(req), ()
            case Collect():
                return self._completions.collect(req)
            case Register():
                check_version(req.protocol_version)
                return self._registrations.register(req, who)
            case Unregister():
                check_epoch(self._registry.worker(req.worker), req.epoch)
                return self._registrations.unregister(req)
        raise SidecarError(
            "unknown_message", f"no handler for {type(req).__name__}"
        )  # pragma: no cover

    async def _counted_pull(self, req: Pull, work: Coroutine[Any, Any, Reply]) -> Reply:
        """Run a pull; count the bytes it brought as a move (``local`` when on this node)."""
        reply = await work
        if isinstance(reply, Pulled) and reply.nbytes:
            kind: MoveKind = "peer_recv" if req.remote_endpoint else "local"
            self._observability.move_done(kind, req.engine_id, reply.nbytes, reply.seconds)
        return reply

    def status(self, req: Status, who: Principal) -> StatusReply:
        """Answer ``status``: the engines, the pool, the moves, the cache and the pulls.

        The engines and cache namespaces are the sender's user's own; an administrator sees all.
        """
        now = time.monotonic()
        executor, pool, totals, peer = self._executor, self._pool, self._totals, self._peer

        def in_flight(ref: WorkerRef) -> int:
            return executor.in_flight_for(ref)

        def visible(engine: Engine) -> bool:
            return self._access.owns(who, engine)

        return StatusReply(
            id=req.id,
            daemon_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=now - self._started_at,
            endpoint=self._config.endpoint,
            engines=self._registry.engine_infos(now, in_flight, visible),
            host_pool_bytes=0 if pool is None else pool.capacity_bytes,
            host_pool_used_bytes=0 if pool is None else pool.used_bytes,
            in_flight_moves=executor.in_flight,
            moves_total=totals.moves,
            moves_failed_total=totals.moves_failed,
            bytes_moved_total=totals.bytes_moved,
            errors_total=self._control.errors_total,
            draining=self._state.draining,
            metrics_port=self._observability.port,
            cache_namespaces=self._cache.namespaces(None if who.admin else who.user),
            pulls_total=peer.pulls_total,
            pulls_failed_total=peer.pulls_failed_total,
            bytes_pulled_total=peer.bytes_pulled_total,
            published_requests=peer.producer.published,
            cache_tiers=self._cache.tiers(),
        )
