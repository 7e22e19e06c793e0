"""`PeerService`: the daemon's node-to-node transfer service.

Producer side: a ROUTER on ``peer_endpoint`` answers handshakes (`PeerHello` -> `PeerWelcome`
with every engine's description, and NIXL metadata when asked), serves reads on the ZMQ plane,
and counts consumers' `Notify` messages. Blocks of a request are held from a `Publish` until
every producer rank was read by its ``expected_readers`` consumer ranks (then
``finished_sending``), or until the lease ends (then ``finished_sending`` too, counted in
``leases_expired_total``, and later reads of that request are refused).

Consumer side: `PeerService.pull` handshakes with the remote daemon, checks compatibility
(typed ``incompatible_peer`` error naming the mismatch, before any byte moves), plans every local
rank's reads (`kvsidecar.peer.plan`), runs them on the chosen data plane, fixes layouts on the
copy executor, notifies the producer ranks, and reports each request as finished or failed. A
pull is bounded by its timeout: a dead or silent peer fails the request, it never hangs.

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
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
import zmq.asyncio

from kvsidecar.daemon.auth import (  # security
    PEER_DOMAIN,
    Transport,
    ZapHandler,
    peer_link_curve,
    peer_transport,
    secure_server_socket,
)
from kvsidecar.daemon.config import Config
from kvsidecar.daemon.executor import CopyExecutor
from kvsidecar.daemon.jobs import fix_layers
from kvsidecar.daemon.registry import BufferSet, Registry, Worker
from kvsidecar.peer.handshake import IncompatiblePeer, check_compatible, describe_engine
from kvsidecar.peer.link import PeerGone, PeerLink, PeerRefused
from kvsidecar.peer.messages import (
    PEER_PROTOCOL_VERSION,
    Notify,
    PeerEngine,
    PeerError,
    PeerHello,
    PeerRequest,
    PeerWelcome,
    PeerWorker,
    ReadBlocks,
)
from kvsidecar.peer.nixl_plane import NixlPlane
from kvsidecar.peer.plan import PlanError, RankPlan, plan_rank
from kvsidecar.peer.planes import DataPlane, ReadTarget
from kvsidecar.peer.zmq_plane import ZmqPlane, serve_read
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Ok, PeerEvents, Publish, Pull, Pulled, Reply, TakePeerEvents
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.types import WorkerRef

log = logging.getLogger("kvsidecar.peer")

_MAX_RANGES = 1 << 20
_EXPIRED_MEMORY = 4096
"""How many expired request ids are remembered to refuse late reads."""


@dataclass(eq=False)
class _Held:
    """A published request (or notifications that came before its publish)."""

    deadline: float
    published: bool = False
    expected: int = 1
    readers: dict[tuple[int, int], set[str]] = field(default_factory=dict)


@dataclass(eq=False)
class _Rank:
    """One local rank taking part in a pull."""

    worker: Worker
    buffers: BufferSet
    desc: PeerWorker


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
        self.planes: dict[str, DataPlane] = {"zmq": ZmqPlane(config.peer_chunk_bytes)}
        self.nixl: NixlPlane | None = None
        self._nixl_error: str | None = None
        self._nixl_lock = asyncio.Lock()
        self.leases_expired_total = 0
        self.pulls_total = 0
        self.pulls_failed_total = 0
        self.bytes_pulled_total = 0
        self.bytes_served_total = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._zap: ZapHandler | None = None  # security: authenticates peers on the endpoint
        self._transport: Transport | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._links: dict[str, PeerLink] = {}
        self._held: dict[tuple[str, str], _Held] = {}
        self._expired: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._tasks: list[asyncio.Task[Any]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerRequest)

    # ------------------------------------------------------------------ lifecycle

    async def _ensure_nixl(self) -> None:
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
        # without a peer endpoint creates its agent at its first pull instead (`_ensure_nixl`),
        # so a daemon that never pulls never spends a core on it.
        if cfg.peer_data_plane == "nixl" or (cfg.peer_data_plane == "auto" and cfg.peer_endpoint):
            await self._ensure_nixl()
            if self.nixl is None and cfg.peer_data_plane == "nixl":
                raise SystemExit(
                    f"kvsidecar: peer_data_plane=nixl but NIXL fails: {self._nixl_error}"
                )
        self._ctx = zmq.asyncio.Context()
        # security: CURVE (or knowingly plain) on the peer endpoint and on links to other peers
        self._transport = peer_transport(cfg)
        if cfg.peer_endpoint:
            self._zap = ZapHandler(self._ctx)
            self._zap.policies[PEER_DOMAIN] = self._transport.policy
            self._zap.start()
            sock = self._ctx.socket(zmq.ROUTER)
            secure_server_socket(sock, domain=PEER_DOMAIN, keys=self._transport.keys)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
            sock.bind(cfg.peer_endpoint)
            self._sock = sock
            self._tasks.append(asyncio.create_task(self._serve_loop(), name="peer-serve"))
            log.info(
                "peer endpoint %s (planes: %s)", cfg.peer_endpoint, ", ".join(sorted(self.planes))
            )
        self._tasks.append(asyncio.create_task(self._lease_loop(), name="peer-leases"))

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
        if self._zap is not None:  # security
            await self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.nixl is not None:
            self.nixl.close()

    # ------------------------------------------------------------------ events

    def _emit(self, event: PeerCompletion) -> None:
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

    # ------------------------------------------------------------------ producer

    def publish(self, req: Publish, ids: IdArray) -> Ok:
        """Hold a request's blocks for remote readers until read or until the lease ends."""
        engine = self.registry.engine(req.engine_id)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= _num_blocks(engine)):
            raise SidecarError("out_of_range", "published block ids outside the engine's cache")
        lease = req.lease_s if req.lease_s > 0 else self.config.peer_lease_s
        key = (req.engine_id, req.request_id)
        held = self._held.setdefault(key, _Held(deadline=0.0))
        held.published = True
        held.deadline = time.monotonic() + lease
        self._expired.pop(key, None)
        self._check_sent(key)
        return Ok(id=req.id)

    def _on_notify(self, msg: Notify) -> None:
        key = (msg.engine_id, msg.request_id)
        held = self._held.get(key)
        if held is None:
            # Read before its publish arrived: remembered for one lease, then forgotten.
            held = self._held[key] = _Held(deadline=time.monotonic() + self.config.peer_lease_s)
        held.expected = max(held.expected, msg.expected_readers)
        held.readers.setdefault((msg.tp_rank, msg.pp_rank), set()).add(msg.reader)
        self._check_sent(key)

    def _check_sent(self, key: tuple[str, str]) -> None:
        held = self._held.get(key)
        engine = self.registry.engines.get(key[0])
        if held is None or not held.published or engine is None:
            return
        ranks = {(w.ref.tp_rank, w.ref.pp_rank) for w in engine.workers.values()}
        if all(len(held.readers.get(r, ())) >= held.expected for r in ranks):
            del self._held[key]
            self._emit(PeerCompletion(engine_id=key[0], finished_sending=frozenset({key[1]})))

    async def _lease_loop(self) -> None:
        period = min(0.25, self.config.peer_lease_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for key, held in list(self._held.items()):
                if held.deadline > now:
                    continue
                del self._held[key]
                if not held.published:
                    continue
                self.leases_expired_total += 1
                self._expired[key] = None
                while len(self._expired) > _EXPIRED_MEMORY:
                    self._expired.popitem(last=False)
                log.info("lease of %s/%s expired unread: blocks released", *key)
                ids = frozenset({key[1]})
                self._emit(
                    PeerCompletion(engine_id=key[0], finished_sending=ids, expired_sending=ids)
                )

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
                reply, data = self._read(msg, frames[2:])
            case Notify():
                self._on_notify(msg)
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
            nixl.sync(self._registered_buffers())

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

    def _registered_buffers(self) -> list[tuple[Any, torch.Tensor]]:
        return [
            ((w.ref, name), lb.mapped.flat)
            for w in self.registry.workers.values()
            for name, lb in w.device.layers.items()
        ]

    def _read(self, msg: ReadBlocks, data: list[zmq.Frame]) -> tuple[Any, list[Any]]:
        if len(data) != 1:
            return PeerError(id=msg.id, code="bad_message", message="a read has 1 frame"), []
        if (msg.engine_id, msg.request_id) in self._expired:
            return PeerError(
                id=msg.id,
                code="expired",
                message=f"request {msg.request_id!r} was released when its lease expired",
            ), []
        worker = next(
            (
                w
                for w in self.registry.workers.values()
                if w.ref.engine_id == msg.engine_id
                and (w.ref.tp_rank, w.ref.pp_rank) == (msg.tp_rank, msg.pp_rank)
            ),
            None,
        )
        if worker is None:
            return PeerError(
                id=msg.id,
                code="unknown_worker",
                message=f"no worker {msg.engine_id}/tp{msg.tp_rank}.pp{msg.pp_rank}",
            ), []
        reply, frames = serve_read(msg, data[0].buffer, worker.device.layers, _MAX_RANGES)
        if not isinstance(reply, PeerError):
            self.bytes_served_total += reply.nbytes
        return reply, frames

    # ------------------------------------------------------------------ consumer

    def pull(
        self, req: Pull, remote_ids: IdArray, local_ids: IdArray
    ) -> Coroutine[Any, Any, Reply]:
        """Check a pull completely (typed errors, nothing sent), then return its coroutine."""
        engine = self.registry.engine(req.engine_id)
        if not req.remote_endpoint.startswith(("tcp://", "ipc://")):
            raise SidecarError("invalid_message", "remote_endpoint must be tcp:// or ipc://")
        if not req.items:
            raise SidecarError("invalid_message", "a pull needs at least one item")
        ids = [it.request_id for it in req.items]
        if len(set(ids)) != len(ids):
            raise SidecarError("invalid_message", "a request id appears twice in one pull")
        if any(it.num_remote < 0 or it.num_local < 0 for it in req.items):
            raise SidecarError("invalid_message", "negative id counts")
        if (
            sum(it.num_remote for it in req.items) != remote_ids.size
            or sum(it.num_local for it in req.items) != local_ids.size
        ):
            raise SidecarError("length_mismatch", "item id counts do not match the id frames")
        workers = sorted(
            (
                w
                for w in engine.workers.values()
                if req.tp_rank is None
                or (w.ref.tp_rank, w.ref.pp_rank) == (req.tp_rank, req.pp_rank)
            ),
            key=lambda w: (w.ref.pp_rank, w.ref.tp_rank),
        )
        if not workers:
            raise SidecarError(
                "unknown_worker", f"no worker tp{req.tp_rank}.pp{req.pp_rank} of {engine.engine_id}"
            )
        sets = [w.buffer_set(req.medium) for w in workers]
        num_blocks = sets[0].num_blocks
        if local_ids.size:
            if int(local_ids.min()) < 0 or int(local_ids.max()) >= num_blocks:
                raise SidecarError("out_of_range", f"local block ids outside 0..{num_blocks - 1}")
            if np.unique(local_ids).size != local_ids.size:
                raise SidecarError("duplicate_destination", "a local block id appears twice")
        local_desc = describe_engine(engine, medium=req.medium)
        by_rank = {(d.tp_rank, d.pp_rank): d for d in local_desc.workers}
        ranks = [
            _Rank(w, s, by_rank[(w.ref.tp_rank, w.ref.pp_rank)])
            for w, s in zip(workers, sets, strict=True)
        ]
        timeout = req.timeout_s if req.timeout_s > 0 else self.config.peer_pull_timeout_s
        splits_r = np.cumsum([it.num_remote for it in req.items])[:-1]
        splits_l = np.cumsum([it.num_local for it in req.items])[:-1]
        per_item = list(
            zip(
                req.items,
                np.split(remote_ids.astype(np.int64), splits_r),
                np.split(local_ids.astype(np.int64), splits_l),
                strict=True,
            )
        )
        return self._pull(req, local_desc, ranks, per_item, timeout)

    def _link(self, endpoint: str) -> PeerLink:
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

    async def _drop_link(self, endpoint: str) -> None:
        # A fresh connection next time: nothing queued for the old peer may reach a new one.
        link = self._links.pop(endpoint, None)
        if link is not None:
            await link.close()

    async def _pull(
        self,
        req: Pull,
        local: PeerEngine,
        ranks: list[_Rank],
        items: list[tuple[Any, Any, Any]],
        timeout: float,
    ) -> Reply:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        self.pulls_total += 1
        worker_ref = None if req.tp_rank is None else ranks[0].worker.ref
        all_local = np.concatenate([lids for _, _, lids in items]) if items else np.zeros(0)

        def fail(code: str, message: str, failed: list[str], invalid: Any) -> Pulled:
            self.pulls_failed_total += 1
            inv = frozenset(int(i) for i in invalid)
            self._emit(
                PeerCompletion(
                    engine_id=req.engine_id,
                    worker=worker_ref,
                    failed_recving=frozenset(failed),
                    invalid_block_ids=inv,
                )
            )
            return Pulled(
                id=req.id,
                finished=[],
                failed=failed,
                invalid_block_ids=sorted(inv),
                nbytes=0,
                seconds=loop.time() - started,
                plane="",
                error_code=code,
                error=message,
            )

        every = [it.request_id for it, _, _ in items]
        link = self._link(req.remote_endpoint)
        pref = req.plane or self.config.peer_data_plane
        if pref in ("auto", "nixl") and self.config.peer_data_plane != "zmq":
            await self._ensure_nixl()
        wants_nixl = self.nixl is not None and pref in ("auto", "nixl")
        try:
            welcome = await link.request(
                PeerHello(
                    id=link.next_id(),
                    protocol_version=PEER_PROTOCOL_VERSION,
                    daemon_id=self.daemon_id,
                    want_nixl=wants_nixl,
                ),
                timeout=min(self.config.peer_handshake_timeout_s, deadline - loop.time()),
            )
        except PeerGone as exc:
            await self._drop_link(req.remote_endpoint)
            return fail("peer_unavailable", str(exc), every, all_local)
        except PeerRefused as exc:
            return fail("incompatible_peer", str(exc), every, all_local)
        if not isinstance(welcome, PeerWelcome):
            return fail("peer_unavailable", "unexpected handshake reply", every, all_local)
        remote = next((e for e in welcome.engines if e.engine_id == req.remote_engine_id), None)
        if remote is None:
            self._emit_failed(req, worker_ref, every, all_local)
            raise SidecarError(
                "unknown_engine",
                f"remote daemon {req.remote_endpoint} has no engine {req.remote_engine_id!r}",
            )
        try:
            plane_name = self._choose_plane(welcome, pref)
        except SidecarError:
            self._emit_failed(req, worker_ref, every, all_local)
            raise
        plans: list[list[RankPlan]] = []
        try:
            check_compatible(local, remote)
            for _, rids, lids in items:
                plans.append(
                    [
                        plan_rank(
                            local,
                            r.desc,
                            remote,
                            rids,
                            lids,
                            max_frame=min(1 << 20, self.config.peer_chunk_bytes),
                        )
                        for r in ranks
                    ]
                )
        except (IncompatiblePeer, PlanError) as exc:
            self._emit_failed(req, worker_ref, every, all_local)
            raise SidecarError("incompatible_peer", str(exc)) from None
        plane = self.planes[plane_name]
        if plane_name == "nixl":
            assert self.nixl is not None
            try:
                self.nixl.load_remote(welcome.nixl_agent, welcome.nixl_metadata)
                self.nixl.sync(self._registered_buffers())
            except Exception as exc:
                return fail("peer_unavailable", f"NIXL setup failed: {exc}", every, all_local)
        remote_workers = {(w.tp_rank, w.pp_rank): w for w in remote.workers}

        async def one_item(index: int) -> tuple[bool, int, str]:
            item, _, lids = items[index]
            rid = item.remote_request_id or item.request_id
            reads = []
            for rank, plan in zip(ranks, plans[index], strict=True):
                layers = [rank.buffers.layers[n] for n in rank.desc.layers]
                for rp in plan.reads:
                    target = ReadTarget(
                        link=link,
                        engine_id=remote.engine_id,
                        request_id=rid,
                        remote=remote_workers[(rp.remote_tp_rank, rp.remote_pp_rank)],
                        remote_agent=welcome.nixl_agent,
                        local_layers=layers,
                    )
                    reads.append(plane.read(target, rp, deadline))
            try:
                nbytes = sum(await asyncio.gather(*reads))
                await self._fix(ranks, plans[index], lids, deadline - loop.time())
            except (PeerGone, PeerRefused, TimeoutError, asyncio.TimeoutError) as exc:
                return False, 0, str(exc) or type(exc).__name__
            for rank, plan in zip(ranks, plans[index], strict=True):
                reader = f"{self.daemon_id}/{rank.worker.ref.label()}"
                for tp, pp in plan.notify:
                    msg = Notify(
                        id=link.next_id(),
                        engine_id=remote.engine_id,
                        request_id=rid,
                        tp_rank=tp,
                        pp_rank=pp,
                        reader=reader,
                        expected_readers=plan.expected_readers,
                    )
                    try:
                        await link.send(msg)
                    except (PeerGone, zmq.ZMQError):
                        log.warning("notification for %s not sent", rid)
            return True, nbytes, ""

        results = await asyncio.gather(*(one_item(i) for i in range(len(items))))
        finished = [items[i][0].request_id for i, r in enumerate(results) if r[0]]
        failed = [items[i][0].request_id for i, r in enumerate(results) if not r[0]]
        invalid = sorted(
            int(b) for i, r in enumerate(results) if not r[0] for b in items[i][2].tolist()
        )
        nbytes = sum(r[1] for r in results)
        self.bytes_pulled_total += nbytes
        errors = [r[2] for r in results if not r[0]]
        if failed:
            self.pulls_failed_total += 1
            if not link.connected:
                await self._drop_link(req.remote_endpoint)
        self._emit(
            PeerCompletion(
                engine_id=req.engine_id,
                worker=worker_ref,
                finished_recving=frozenset(finished),
                failed_recving=frozenset(failed),
                invalid_block_ids=frozenset(invalid),
            )
        )
        return Pulled(
            id=req.id,
            finished=finished,
            failed=failed,
            invalid_block_ids=invalid,
            nbytes=nbytes,
            seconds=loop.time() - started,
            plane=plane_name,
            error_code="peer_unavailable" if failed else "",
            error=errors[0] if errors else "",
        )

    def _emit_failed(
        self, req: Pull, worker: WorkerRef | None, failed: list[str], invalid: Any
    ) -> None:
        self.pulls_failed_total += 1
        self._emit(
            PeerCompletion(
                engine_id=req.engine_id,
                worker=worker,
                failed_recving=frozenset(failed),
                invalid_block_ids=frozenset(int(i) for i in invalid),
            )
        )

    def _choose_plane(self, welcome: PeerWelcome, pref: str) -> str:
        both_nixl = self.nixl is not None and "nixl" in welcome.planes and welcome.nixl_metadata
        if pref == "nixl" and not both_nixl:
            raise SidecarError(
                "incompatible_peer",
                f"peer_data_plane=nixl but the remote daemon offers {welcome.planes}",
            )
        return "nixl" if both_nixl and pref in ("auto", "nixl") else "zmq"

    async def _fix(
        self, ranks: list[_Rank], plans: list[RankPlan], lids: IdArray, timeout: float
    ) -> None:
        jobs = []
        index = torch.from_numpy(np.ascontiguousarray(lids, dtype=np.int64))
        for rank, plan in zip(ranks, plans, strict=True):
            if not plan.fixes or not lids.size:
                continue
            targets = [(rank.buffers.layers[name], order) for name, order in plan.fixes]
            ratio = plan.block_size_ratio

            def run(targets: list[Any] = targets, ratio: int = ratio) -> int:
                fix_layers(targets, index, ratio)
                return 0

            jobs.append(self.executor.submit(run, reads={}, writes={rank.buffers.key: lids}))
        if jobs:
            await asyncio.wait_for(asyncio.gather(*jobs), max(timeout, 0.001))


async def sock_send(sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
    """Send a multipart reply without copying the data frames."""
    await sock.send_multipart(frames, copy=False)


def _num_blocks(engine: Any) -> int:
    first = next(iter(engine.workers.values()), None)
    return 0 if first is None else int(first.device.num_blocks)
