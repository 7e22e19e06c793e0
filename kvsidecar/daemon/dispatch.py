"""Which handler answers a checked request: one `match` over the request union.

`Dispatch` gathers the daemon's handler mixins (`kvsidecar.daemon.edge` reads and checks
requests, `registration`, `commands` and `cache_commands` answer them) and routes each request
to its handler; `kvsidecar.daemon.server.Daemon` adds the lifecycle and owns the state declared
here.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import msgspec

from kvsidecar.daemon.cache.worker_events import WorkerEvents
from kvsidecar.daemon.cache_commands import CacheCommands
from kvsidecar.daemon.edge import Dispatched, ReplyTo
from kvsidecar.daemon.limits.access import Principal  # security
from kvsidecar.daemon.metrics.families import MoveKind
from kvsidecar.daemon.registration import Registration, _check_version
from kvsidecar.daemon.short_moves import ShortMoves
from kvsidecar.node.jobs import prepare_fix
from kvsidecar.node.registry import check_epoch
from kvsidecar.peer.service import PeerService  # peer
from kvsidecar.wire.batch import MoveBatch
from kvsidecar.wire.cache import CacheLoad, CacheLookup, CacheStore, TakeWorkerEvents
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import (
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


class Dispatch(ShortMoves, Registration, CacheCommands):
    """Routes requests to their handlers (the base of `kvsidecar.daemon.server.Daemon`)."""

    # Owned and set by `Daemon`.
    peer: PeerService | None
    worker_events: WorkerEvents

    def _peer_service(self) -> PeerService:
        """Return the peer service; a typed error when a peer command comes before or after it."""
        if self.peer is None:
            raise SidecarError("shutting_down", "node-to-node transfer is not running")
        return self.peer

    def _with_pulls(self, reply: StatusReply) -> StatusReply:
        """Add the peer service's totals to a ``status`` reply."""
        peer = self.peer
        if peer is None:
            return reply
        return msgspec.structs.replace(
            reply,
            pulls_total=peer.pulls_total,
            pulls_failed_total=peer.pulls_failed_total,
            bytes_pulled_total=peer.bytes_pulled_total,
            published_requests=peer.producer.published,
        )

    def _dispatch(
        self, req: Request, data: list[memoryview], reply_to: ReplyTo, who: Principal
    ) -> Dispatched:
        """Answer a request inline (a reply and its data frames), or return what answers later.

        ``who`` sent it (`authorize` already let it through); registrations, grants and pulls
        need it again further on.

        That is a coroutine (run as a task), the future of a peer pull's reply, or for copy
        jobs their outcome (the job answers through ``reply_to`` itself).
        """
        match req:
            case Hello():
                _check_version(req.protocol_version)
                return self._hello(req), ()
            case Status():
                return self._with_pulls(self._status(req)), ()
            case Heartbeat():
                return self._heartbeat(req), ()
            case HostAlloc():
                return self._host_alloc(req)
            case HostFree():
                return self._host_free(req, data[0]), ()
            case Move():
                return self._move(req, data, reply_to)
            case MoveBatch():
                return self._move_batch(req, data, reply_to)
            case Grant():  # security
                return self._grant(req, who), ()
            # --- prefix cache and connectors (kvsidecar/daemon/cache_commands.py) ---
            case CacheLookup():
                return self._cache_lookup(req, data, reply_to.user), ()
            case CacheStore():
                return self._cache_store(req, data, reply_to, reply_to.user)
            case CacheLoad():
                return self._cache_load(req, data, reply_to, reply_to.user)
            case TakeWorkerEvents():
                check_epoch(self.registry.worker(req.worker), req.epoch)
                return PeerEvents(id=req.id, events=self.worker_events.take(req.worker)), ()
            # --- end prefix cache ---
            case FixLayout():
                ids = self._ids(data[0], req.ids_dtype, "block")
                job = prepare_fix(self.registry, req, ids)
                return self._run_job(job, req.id, move=False, respond=reply_to)
            # --- peer (kvsidecar.peer.service) ---
            case Pull():
                remote = self._ids(data[0], req.ids_dtype, "remote block")
                local = self._ids(data[1], req.ids_dtype, "local block")

                # A pull served by this very daemon (an empty endpoint, or its own peer
                # endpoint) reads its own engines' published blocks: the same user's, or granted.
                def may_read(engine_id: str) -> bool:
                    acl = self.access
                    return acl.same_user(who, engine_id) or acl.may(who, engine_id, write=False)

                pulled = self._peer_service().pull(req, remote, local, may_read)
                return self._counted_pull(req, pulled)
            case Publish():
                ids = self._ids(data[0], req.ids_dtype, "block")
                return self._peer_service().publish(req, ids), ()
            case TakePeerEvents():
                return self._peer_service().take_events(req), ()
            # --- end peer ---
            # --- completions (kvsidecar/completions.py) ---
            case Report():
                return self.completions.report(req), ()
            case Collect():
                return self.completions.collect(req)
            # --- end completions ---
            case Register():
                _check_version(req.protocol_version)
                return self._register(req, who)
            case Unregister():
                check_epoch(self.registry.worker(req.worker), req.epoch)
                return self._unregister(req)
        raise SidecarError(
            "unknown_message", f"no handler for {type(req).__name__}"
        )  # pragma: no cover

    async def _counted_pull(self, req: Pull, work: Coroutine[Any, Any, Reply]) -> Reply:
        """Run a pull; count the bytes it brought as a move (``local`` when on this node)."""
        reply = await work
        if isinstance(reply, Pulled) and reply.nbytes:
            kind: MoveKind = "peer_recv" if req.remote_endpoint else "local"
            self.observability.move_done(kind, req.engine_id, reply.nbytes, reply.seconds)
        return reply
