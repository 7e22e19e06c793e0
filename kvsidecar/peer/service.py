"""`PeerService`: the daemon's node-to-node transfer service, and the wiring of its parts.

It owns what the producer and consumer sides share: the peer endpoint (a ROUTER on
``peer_endpoint``) and its ZAP handler, the links to other daemons, the data planes (the NIXL agent
among them), the handshake's answer (`PeerHello` -> `PeerWelcome` with every engine's
description, and NIXL metadata when asked), and the completion events. The two sides:

- producer (`kvsidecar.peer.producer`): publish, leases, reads served on the ZMQ plane, and the
  consumers' `Notify` messages;
- consumer (`kvsidecar.peer.pull`): `PeerService.pull` checks a pull, then runs its handshake,
  plan, transfer and completion steps, bounded by its timeout.

Completion events: every outcome becomes a `kvsidecar.wire.protocol.PeerCompletion`. They queue in
`PeerService.completions` (taken with the ``take_peer_events`` command) unless
`PeerService.on_completion` is set: the completion aggregation service (issue 4) sets that hook
and receives every event as it happens instead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from kvsidecar.daemon.auth import (  # security
    PEER_DOMAIN,
    Transport,
    ZapHandler,
    close_zap_and_context,
    peer_link_curve,
    peer_transport,
    secure_server_socket,
)
from kvsidecar.daemon.config import Config
from kvsidecar.daemon.executor import CopyExecutor
from kvsidecar.daemon.registry import Registry, Worker
from kvsidecar.peer.handshake import describe_engine
from kvsidecar.peer.link import PeerLink
from kvsidecar.peer.local import LOCAL_PLANE, LocalLink, LocalPlane
from kvsidecar.peer.messages import (
    PEER_PROTOCOL_VERSION,
    Notify,
    PeerError,
    PeerHello,
    PeerRequest,
    PeerWelcome,
    ReadBlocks,
)
from kvsidecar.peer.nixl_plane import NixlPlane
from kvsidecar.peer.planes import DataPlane
from kvsidecar.peer.producer import Producer
from kvsidecar.peer.pull import check_pull
from kvsidecar.peer.zmq_plane import ZmqPlane
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Ok, PeerEvents, Publish, Pull, Reply, TakePeerEvents
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.peer")


class PeerService:
    """Node-to-node transfer for one daemon; `start` in startup, `close` in shutdown."""

    def __init__(self, config: Config, registry: Registry, executor: CopyExecutor) -> None:
        self.config = config
        self.registry = registry
        self.executor = executor
        self.daemon_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.completions: collections.deque[PeerCompletion] = collections.deque(maxlen=1 << 16)
        """Completion events not yet taken (oldest first); unused while `on_completion` is set."""
        self.on_completion: Callable[[PeerCompletion], None] | None = None
        """Hook for the completion aggregation: receives every event instead of the queue."""
        self.producer = Producer(config, registry, self.emit)
        self.planes: dict[str, DataPlane] = {"zmq": ZmqPlane(config.peer_chunk_bytes)}
        self.nixl: NixlPlane | None = None
        self._nixl_error: str | None = None
        self._nixl_lock = asyncio.Lock()
        self.pulls_total = 0
        self.pulls_failed_total = 0
        self.bytes_pulled_total = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._zap: ZapHandler | None = None  # security: authenticates peers on the endpoint
        self._transport: Transport | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._links: dict[str, PeerLink] = {}
        # Pulls from this daemon itself (remote_endpoint ""): kvsidecar.peer.local.
        self._local_link = LocalLink(self)
        self.planes[LOCAL_PLANE] = LocalPlane(self, registry, executor)
        self._tasks: list[asyncio.Task[Any]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerRequest)

    # ------------------------------------------------------------------ lifecycle

    async def ensure_nixl(self) -> None:
        """Create the NIXL agent once, off the loop; remember a failure instead of retrying."""
        # Under the lock, so that concurrent first pulls create one agent between them.
        async with self._nixl_lock:
            if self.nixl is not None or self._nixl_error is not None:
                return
            try:
                # Creating an agent takes most of a second: keep the loop free meanwhile.
                self.nixl = await asyncio.get_running_loop().run_in_executor(
                    None, NixlPlane, self.daemon_id
                )
                self.planes["nixl"] = self.nixl
            except Exception as exc:
                self._nixl_error = str(exc) or type(exc).__name__
                log.info("NIXL not available (%s): peers use the ZMQ plane", exc)

    async def start(self) -> None:
        """Create the NIXL agent (if configured), bind the peer endpoint, start the lease sweep."""
        cfg = self.config
        # NIXL's UCX progress thread busy-polls a core for the agent's whole life. A producer
        # (peer endpoint set) needs it from the start to serve reads; in "auto" mode a daemon
        # without a peer endpoint creates its agent at its first pull instead (`ensure_nixl`),
        # so a daemon that never pulls never spends a core on it.
        if cfg.peer_data_plane == "nixl" or (cfg.peer_data_plane == "auto" and cfg.peer_endpoint):
            await self.ensure_nixl()
            if self.nixl is None and cfg.peer_data_plane == "nixl":
                raise SystemExit(
                    f"kvsidecar: peer_data_plane=nixl but NIXL fails: {self._nixl_error}"
                )
        self._ctx = zmq.asyncio.Context()
        # security: CURVE (or knowingly plain) on the peer endpoint and on links to other peers
        self._transport = peer_transport(cfg)
        if cfg.peer_endpoint:
            self._bind(self._ctx, self._transport, cfg.peer_endpoint)
            self._tasks.append(asyncio.create_task(self._serve_loop(), name="peer-serve"))
            log.info(
                "peer endpoint %s (planes: %s)", cfg.peer_endpoint, ", ".join(sorted(self.planes))
            )
        self._tasks.append(asyncio.create_task(self.producer.lease_loop(), name="peer-leases"))

    def _bind(self, ctx: zmq.asyncio.Context, transport: Transport, endpoint: str) -> None:
        self._zap = ZapHandler(ctx)
        self._zap.policies[PEER_DOMAIN] = transport.policy
        self._zap.start()
        sock = ctx.socket(zmq.ROUTER)
        secure_server_socket(sock, domain=PEER_DOMAIN, keys=transport.keys)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.bind(endpoint)
        self._sock = sock

    async def close(self) -> None:
        """Close every link and the peer socket; release the NIXL registrations."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        await close_zap_and_context(self._zap, self._ctx)  # security
        self._zap, self._ctx = None, None
        if self.nixl is not None:
            self.nixl.close()

    # ------------------------------------------------------------------ events

    def emit(self, event: PeerCompletion) -> None:
        """Hand a completion event to `on_completion`, or queue it when no hook is set."""
        if self.on_completion is not None:
            self.on_completion(event)
        else:
            self.completions.append(event)

    def take_events(self, req: TakePeerEvents) -> PeerEvents:
        """Remove and return the queued events (of one engine, or all)."""
        taken = [e for e in self.completions if not req.engine_id or e.engine_id == req.engine_id]
        keep = [e for e in self.completions if req.engine_id and e.engine_id != req.engine_id]
        self.completions.clear()
        self.completions.extend(keep)
        return PeerEvents(id=req.id, events=taken)

    # ------------------------------------------------------------------ commands

    def publish(self, req: Publish, ids: IdArray) -> Ok:
        """Hold a request's blocks for remote readers until read or until the lease ends."""
        return self.producer.publish(req, ids)

    def pull(
        self, req: Pull, remote_ids: IdArray, local_ids: IdArray
    ) -> Coroutine[Any, Any, Reply]:
        """Check a pull completely (typed errors, nothing sent), then return its coroutine."""
        return check_pull(self, req, remote_ids, local_ids).run()

    # ------------------------------------------------------------------ peer endpoint

    async def _serve_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                await self._on_peer_message(frames)
            except Exception:  # a bug must not stop serving the other peers
                log.exception("unhandled error on a peer message")

    async def _on_peer_message(self, frames: list[zmq.Frame]) -> None:
        assert self._sock is not None
        ident = frames[0].bytes
        try:
            msg = self._decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, IndexError) as exc:
            log.warning("unreadable peer message: %s", exc)
            return
        reply: Any
        data: list[Any] = []
        match msg:
            case PeerHello():
                reply = self._welcome(msg)
            case ReadBlocks():
                reply, data = self.producer.read(msg, frames[2:])
            case Notify():
                self.producer.on_notify(msg)
                return
        try:
            await sock_send(self._sock, [ident, self._encoder.encode(reply), *data])
        except zmq.ZMQError as exc:  # the peer went away
            log.debug("peer reply not sent: %s", exc)

    def _welcome(self, msg: PeerHello) -> PeerWelcome | PeerError:
        if msg.protocol_version != PEER_PROTOCOL_VERSION:
            return PeerError(
                id=msg.id,
                code="version_mismatch",
                message=f"peer protocol {msg.protocol_version}, this daemon speaks "
                f"{PEER_PROTOCOL_VERSION}",
            )
        nixl = self.nixl if msg.want_nixl else None
        if nixl is not None:
            nixl.sync(self.registered_buffers())

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
            planes=sorted(self.planes),
            nixl_agent=self.daemon_id if nixl is not None else "",
            nixl_metadata=nixl.metadata() if nixl is not None else b"",
        )

    def registered_buffers(self) -> list[tuple[Any, torch.Tensor]]:
        """Every registered layer buffer, keyed as the NIXL agent registers it."""
        return [
            ((w.ref, name), lb.mapped.flat)
            for w in self.registry.workers.values()
            for name, lb in w.device.layers.items()
        ]

    # ------------------------------------------------------------------ links

    def link(self, endpoint: str) -> PeerLink:
        """Return the link to the daemon at ``endpoint``; connect on first use or after a drop.

        ``endpoint`` "" is this daemon itself (`kvsidecar.peer.local.LocalLink`).
        """
        if not endpoint:
            return self._local_link
        link = self._links.get(endpoint)
        if link is None or link.closed:
            assert self._ctx is not None
            link = PeerLink(
                self._ctx,
                endpoint,
                self.config.peer_max_in_flight,
                curve=peer_link_curve(self._transport) if self._transport else None,  # security
            )
            self._links[endpoint] = link
        return link

    async def drop_link(self, endpoint: str) -> None:
        """Close the link to ``endpoint``; the next pull from it connects afresh."""
        # A fresh connection next time: nothing queued for the old peer may reach a new one.
        link = self._links.pop(endpoint, None)
        if link is not None:
            await link.close()


async def sock_send(sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
    """Send a multipart reply without copying the data frames."""
    await sock.send_multipart(frames, copy=False)
