"""`PeerService`: the daemon's node-to-node transfer service, and the wiring of its parts.

It owns what the producer and consumer sides share: the peer endpoint (a ROUTER on
``peer_endpoint``) and its ZAP handler, the links to other daemons, the data planes (the NIXL agent
among them), the handshake's answer (`PeerHello` -> `PeerWelcome` with every engine's
description, and NIXL metadata when asked), and the completion events. The two sides:

- producer (`kvsidecar.peer.producer`): publish, leases, reads served on the ZMQ plane, and the
  consumers' `Notify` messages;
- consumer (`kvsidecar.peer.pull`): `PeerService.pull` checks a pull, then runs its handshake,
  plan, transfer and completion steps, bounded by its timeout.

Completion events: every outcome becomes a `kvsidecar.wire.reports.PeerCompletion`, which goes
one way: `PeerService.emit` hands it to the sink the daemon gave (``on_completion``: its
completion aggregation and its connectors' worker events) and queues it in
`PeerService.completions`, which the ``take_peer_events`` command takes.

What a pull needs of the service is a `kvsidecar.peer.context.PullContext`, made once here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.node.auth import (
    PEER_DOMAIN,
    Transport,
    ZapHandler,
    close_zap_and_context,
    peer_link_curve,
    peer_transport,
    secure_server_socket,
)
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.identity import mint_daemon_id
from kvsidecar.node.registry import Registry, Worker
from kvsidecar.node.replies import ReplyBudget
from kvsidecar.peer.context import PlaneSet, PullContext, PullCounts
from kvsidecar.peer.handshake import describe_engine
from kvsidecar.peer.link import PeerLink
from kvsidecar.peer.links import PeerLinks
from kvsidecar.peer.local import LOCAL_PLANE, LocalLink, LocalPlane
from kvsidecar.peer.messages import (
    PEER_PROTOCOL_VERSION,
    Notify,
    PeerError,
    PeerHello,
    PeerRequest,
    PeerWelcome,
    ReadBlocks,
    ReadData,
)
from kvsidecar.peer.producer import Producer
from kvsidecar.peer.pull import check_pull
from kvsidecar.peer.zmq_plane import FRAME_BYTES, pack, packable
from kvsidecar.wire import zmqio
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Ok, Reply
from kvsidecar.wire.pulls import PeerEvents, Publish, Pull, TakePeerEvents
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.zmq_memory import keep_freed_memory

log = logging.getLogger("kvsidecar.peer")

PEER_RCVHWM = 256
"""Messages queued from one peer connection before libzmq stops reading it (TCP then pushes
back on that peer alone): a flood of peer messages cannot grow the daemon's memory."""
PEER_SNDHWM = 1024
"""Replies queued for one peer connection. A consumer has at most ``peer_max_in_flight`` reads
outstanding, so only a peer that does not read its replies reaches it; its replies are then
dropped (counted in `PeerService.replies_dropped_total`) rather than queued or waited for."""
PACKED_REPLY_BYTES = 64 << 20
"""Bytes of packed read replies (`kvsidecar.peer.zmq_plane.pack`: copies, unlike the zero-copy
views of the registered memory that unpacked replies send) queued at once, all peers together.
Past it replies go out unpacked, so consumers that do not read their replies hold no more memory
here than this. A consumer keeps ``peer_max_in_flight`` chunks outstanding (8 x 4 MiB by default),
so this lets a few pull at full speed at once."""
_PEER_TURN = 16
"""Peer messages served per turn of the event loop (the control socket, timers and the fd
channel run in between, however many peer messages wait)."""


class PeerService:
    """Node-to-node transfer for one daemon; `start` in startup, `close` in shutdown."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        executor: CopyExecutor,
        *,
        daemon_id: str = "",
        on_completion: Callable[[PeerCompletion], None] | None = None,
    ) -> None:
        """Wire the service to the node's parts; nothing is bound before `start`.

        ``daemon_id``: the daemon's own (a fresh `mint_daemon_id` when not given);
        ``on_completion``: the sink of every completion event (see the module doc).
        """
        self.config = config
        self.registry = registry
        self.executor = executor
        self.daemon_id = daemon_id or mint_daemon_id()
        """This daemon's id, as its peers see it."""
        self.completions: collections.deque[PeerCompletion] = collections.deque(maxlen=1 << 16)
        """Completion events not yet taken (oldest first), for ``take_peer_events``."""
        self._sink = on_completion
        self.producer = Producer(config, registry, self.emit)
        self.planes = PlaneSet(config, registry, self.daemon_id)
        self.counts = PullCounts()
        self.replies_dropped_total = 0
        """Peer replies dropped because their peer's queue was full (`PEER_SNDHWM`)."""
        self.unreadable_total = 0
        """Peer messages that did not decode (dropped)."""
        self._logged: dict[str, float] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._zap: ZapHandler | None = None  # authenticates peers on the endpoint
        self._transport: Transport | None = None
        self._sock: zmq.Socket[Any] | None = None
        """The peer endpoint: a plain socket, read from a loop reader callback on its fd and
        written without waiting. The asyncio socket's ``recv_multipart`` and ``send`` cost a
        future per message or frame, which a producer serving pulls would pay on every chunk."""
        self._read_scheduled = False
        """A call of `_on_peer_readable` is queued on the loop (never more than one)."""
        self.packed_budget = ReplyBudget(PACKED_REPLY_BYTES)
        """Bytes of packed read replies still queued (`PACKED_REPLY_BYTES`)."""
        self.links = PeerLinks(config, self._new_link)
        """The links to other daemons (`kvsidecar.peer.links`)."""
        # Pulls from this daemon itself (remote_endpoint ""): kvsidecar.peer.local.
        self._local_link = LocalLink(self.welcome, self.producer.on_notify)
        self.planes.by_name[LOCAL_PLANE] = LocalPlane(self.producer, registry, executor)
        self._pulls = PullContext(
            config=config,
            registry=registry,
            executor=executor,
            daemon_id=self.daemon_id,
            planes=self.planes,
            links=self.links,
            local_link=self._local_link,
            emit=self.emit,
            counts=self.counts,
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerRequest)

    @property
    def pulls_total(self) -> int:
        """Pulls run since the daemon started."""
        return self.counts.pulls

    @property
    def pulls_failed_total(self) -> int:
        """Pulls of which a request failed."""
        return self.counts.failed

    @property
    def bytes_pulled_total(self) -> int:
        """Bytes received by pulls."""
        return self.counts.nbytes

    async def start(self) -> None:
        """Create the NIXL agent (if configured), bind the peer endpoint, start the lease sweep."""
        cfg = self.config
        # A NIXL agent costs a progress thread, UCX workers and registrations (and, with
        # peer_nixl_wakeup_ms=0, a core busy-polling). A producer (peer endpoint set) needs it
        # from the start to serve reads; in "auto" mode a daemon without a peer endpoint creates
        # its agent at its first pull instead (`ensure_nixl`), so one that never pulls has none.
        # Without peer_nixl_trusted no agent is made (`PlaneSet.ensure_nixl`; Config refuses
        # peer_data_plane=nixl without it).
        if cfg.peer_data_plane == "nixl" or (cfg.peer_data_plane == "auto" and cfg.peer_endpoint):
            await self.planes.ensure_nixl()
            if self.planes.nixl is None and cfg.peer_data_plane == "nixl":
                raise SystemExit(
                    f"kvsidecar: peer_data_plane=nixl but NIXL fails: {self.planes.nixl_error}"
                )
        if cfg.peer_keep_freed_memory:
            keep_freed_memory()  # received ZMQ-plane chunks land in warm pages
        # One ZeroMQ I/O thread per data stream, so that the streams' connections are served
        # (read on the consumer, written on the producer) in parallel.
        self._ctx = zmq.asyncio.Context(io_threads=cfg.peer_streams)
        # Room for every link `PeerLinks` may hold (the configured peers' on top), each with its
        # monitor and data streams, and the endpoint's own sockets.
        links = cfg.peer_max_links + len(cfg.peer_list)
        self._ctx.set(zmq.MAX_SOCKETS, max(1023, links * 3 * (1 + cfg.peer_streams) + 64))
        # CURVE (or knowingly plain) on the peer endpoint and on links to other peers.
        self._transport = peer_transport(cfg)
        if cfg.peer_endpoint:
            self._bind(self._ctx, self._transport, cfg.peer_endpoint)
            self._tasks.append(asyncio.create_task(self._serve(), name="peer-serve"))
            log.info(
                "peer endpoint %s (planes: %s)",
                cfg.peer_endpoint,
                ", ".join(sorted(self.planes.by_name)),
            )
        self._tasks.append(asyncio.create_task(self.producer.lease_loop(), name="peer-leases"))
        self._tasks.append(asyncio.create_task(self.links.sweep(), name="peer-link-sweep"))

    def _bind(self, ctx: zmq.asyncio.Context, transport: Transport, endpoint: str) -> None:
        self._zap = ZapHandler(ctx)
        self._zap.policies[PEER_DOMAIN] = transport.policy
        self._zap.start()
        sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.ROUTER)
        secure_server_socket(sock, domain=PEER_DOMAIN, keys=transport.keys)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
        sock.setsockopt(zmq.RCVHWM, PEER_RCVHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        zmqio.bind_or_close(sock, endpoint, "peer endpoint")
        self._sock = sock

    async def close(self) -> None:
        """Close every link and the peer socket; release the NIXL registrations."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.links.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        await close_zap_and_context(self._zap, self._ctx)
        self._zap, self._ctx = None, None
        self.planes.close()

    def emit(self, event: PeerCompletion) -> None:
        """Hand a completion event to the sink, and queue it for ``take_peer_events``."""
        if self._sink is not None:
            self._sink(event)
        self.completions.append(event)

    def take_events(self, req: TakePeerEvents) -> PeerEvents:
        """Remove and return the queued events (of one engine, or all)."""
        taken = [e for e in self.completions if not req.engine_id or e.engine_id == req.engine_id]
        keep = [e for e in self.completions if req.engine_id and e.engine_id != req.engine_id]
        self.completions.clear()
        self.completions.extend(keep)
        return PeerEvents(id=req.id, events=taken)

    def publish(self, req: Publish, ids: IdArray) -> Ok:
        """Hold a request's blocks for remote readers until read or until the lease ends."""
        return self.producer.publish(req, ids)

    def pull(
        self,
        req: Pull,
        remote_ids: IdArray,
        local_ids: IdArray,
        may_read: Callable[[str], bool] = lambda _: True,
    ) -> Coroutine[Any, Any, Reply]:
        """Check a pull completely (typed errors, nothing sent), then return its coroutine.

        ``may_read(engine_id)``: whether the sender may read one of this daemon's engines; asked
        when the remote daemon turns out to be this one.
        """
        return check_pull(self._pulls, req, remote_ids, local_ids, may_read).run()

    async def _serve(self) -> None:
        """Serve the peer endpoint from a reader callback on its fd until cancelled."""
        assert self._sock is not None
        await zmqio.serve_readable(self._sock, self._on_peer_readable, self._schedule_read)

    def _schedule_read(self) -> None:
        if not self._read_scheduled:
            self._read_scheduled = True
            asyncio.get_running_loop().call_soon(self._on_peer_readable)

    def _on_peer_readable(self) -> None:
        # The fd is edge-triggered: it signals again only once ZMQ_EVENTS has reported nothing
        # left to read. `zmqio.try_recv` asks before each receive, after the previous message's
        # reply was sent (a send may take the edge), so returning on None leaves it armed. A
        # burst is served `_PEER_TURN` messages at a time: a peer that floods cannot hold the loop.
        self._read_scheduled = False
        for _ in range(_PEER_TURN):
            frames = None if self._sock is None else zmqio.try_recv(self._sock)
            if frames is None:
                return
            try:
                self._on_peer_message(frames)
            except Exception:  # a bug must not stop serving the other peers
                log.exception("unhandled error on a peer message")
        self._schedule_read()

    def _on_peer_message(self, frames: list[zmq.Frame]) -> None:
        assert self._sock is not None
        ident = frames[0].bytes
        try:
            msg = self._decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, IndexError) as exc:
            self.unreadable_total += 1
            self._warn_once_a_minute("unreadable", "unreadable peer message (%d so far): %s", exc)
            return
        reply: Any
        data: list[Any] = []
        packed = 0
        match msg:
            case PeerHello():
                reply = self.welcome(msg)
            case ReadBlocks():
                reply, data = self.producer.read(msg, frames[2:])
                if (
                    isinstance(reply, ReadData)
                    and packable(reply, data)
                    and self.packed_budget.take(reply.nbytes)
                ):
                    reply, data = pack(reply, data)
                    packed = reply.nbytes
            case Notify():
                self.producer.on_notify(msg)
                return
        self._reply(ident, [self._encoder.encode(reply), *data], packed=packed)

    def _reply(self, ident: bytes, frames: list[Any], *, packed: int = 0) -> None:
        """Queue a reply without waiting: a peer that does not read loses its replies.

        ``packed``: the bytes of a packed reply's frame, taken from `packed_budget` and given
        back once libzmq let go of the frame (or at once if it was not queued).
        """
        trackers: list[zmq.MessageTracker] = []
        try:
            if self._sock is None:
                raise zmq.ZMQError(msg="the peer socket is closed")
            # Never waiting for room: that would hold every other peer's replies behind a peer
            # that never reads.
            trackers = zmqio.send_frames(self._sock, [ident, *frames], track=packed > 0)
        except zmq.Again:
            self.replies_dropped_total += 1
            self._warn_once_a_minute(
                "dropped",
                "a peer does not read its replies: dropping them (%d so far, queue %d)",
                PEER_SNDHWM,
            )
        except zmq.ZMQError as exc:  # the peer went away (ROUTER_MANDATORY)
            log.debug("peer reply not sent: %s", exc)
        if not packed:
            return
        if trackers:
            self.packed_budget.track(trackers, packed)
        else:  # not queued, or small enough to be copied into libzmq's message
            self.packed_budget.give_back(packed)

    def _warn_once_a_minute(self, what: str, text: str, detail: object) -> None:
        # A flooding peer must not flood the log too: one line a minute per kind, with a count.
        now = time.monotonic()
        if now - self._logged.get(what, -1e9) >= 60.0:
            self._logged[what] = now
            count = self.unreadable_total if what == "unreadable" else self.replies_dropped_total
            log.warning(text, count, detail)

    def welcome(self, msg: PeerHello) -> PeerWelcome | PeerError:
        """Answer a handshake: this daemon's engines, data planes and verdicts on the claims.

        The same answer for another node's daemon (on the peer endpoint) and for a pull from
        this daemon itself (`kvsidecar.peer.local.LocalLink`); NIXL metadata when asked for.
        """
        if msg.protocol_version != PEER_PROTOCOL_VERSION:
            return PeerError(
                id=msg.id,
                code="version_mismatch",
                message=f"peer protocol {msg.protocol_version}, this daemon speaks "
                f"{PEER_PROTOCOL_VERSION}",
            )
        nixl = self.planes.nixl if msg.want_nixl else None
        if nixl is not None:
            nixl.sync(self.planes.registered_buffers())

        def addr(w: Worker, name: str) -> int:
            assert nixl is not None
            return nixl.addr((w.ref, name))

        engines = [
            describe_engine(e, addr if nixl is not None else None)
            for e in self.registry.engines.values()
            if e.workers
        ]
        return PeerWelcome(
            id=msg.id,
            protocol_version=PEER_PROTOCOL_VERSION,
            daemon_id=self.daemon_id,
            engines=engines,
            planes=sorted(self.planes.by_name),
            nixl_agent=self.daemon_id if nixl is not None else "",
            nixl_metadata=nixl.metadata() if nixl is not None else b"",
            verdicts=[self.producer.verdict(claim) for claim in msg.claims],
        )

    def _new_link(self, endpoint: str) -> PeerLink:
        """Connect a new link to another daemon's peer endpoint (for `PeerLinks`)."""
        assert self._ctx is not None
        cfg = self.config
        return PeerLink(
            self._ctx,
            endpoint,
            cfg.peer_max_in_flight,
            curve=peer_link_curve(self._transport) if self._transport else None,
            streams=cfg.peer_streams,
            # Replies from a peer are bounded like requests to this daemon; a read's data frame
            # by what a chunk asks for (a packed reply holds a whole chunk).
            max_reply_bytes=cfg.max_message_bytes,
            max_data_frame=cfg.peer_chunk_bytes + FRAME_BYTES,
        )
