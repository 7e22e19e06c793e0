"""Every command of both clients, written once, without I/O.

A command is a `_Call`: its request built from the method's arguments, the reply type it
expects, its data frames, its timeout, and the method's result made from the reply.

`_Requests` holds one builder per command, named after the client method it serves (the
prefix-cache commands are in `kvsidecar.client.cache_requests`). A client's public method
(`kvsidecar.client.sync`, `kvsidecar.client.aio`) passes its arguments to the builder and the
`_Call` to its transport (`kvsidecar.client.sync_transport`, `kvsidecar.client.aio_transport`),
which carries it over the socket, checks the reply against ``expected`` and applies ``finish``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvsidecar.client.calls import _Call, _events, _nothing, _reply
from kvsidecar.client.codec import Ids, _as_id_array, _dtype_of
from kvsidecar.client.common import _Registration, _Session
from kvsidecar.client.export import export_layers
from kvsidecar.memory.cuda_sync import Sync
from kvsidecar.memory.fd_client import MAX_FDS, FdChannelClient
from kvsidecar.wire.batch import MoveBatch, MovedBatch, MoveItem
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray, decode_ids
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Collect,
    Collected,
    Fixed,
    FixLayout,
    Grant,
    Heartbeat,
    Hello,
    HelloReply,
    HostAlloc,
    HostAllocated,
    HostFree,
    Move,
    Moved,
    Ok,
    Register,
    Registered,
    Report,
    Reported,
    Status,
    StatusReply,
    Unregister,
)
from kvsidecar.wire.pulls import PeerEvents, Publish, Pull, Pulled, PullItem, TakePeerEvents
from kvsidecar.wire.reports import CacheEvents, PeerCompletion, TransferStats
from kvsidecar.wire.types import BufferSetRef, LayoutSpec, Medium, MemoryOrder, WorkerRef


@dataclass(frozen=True, slots=True)
class BatchMove:
    """One move of a `SidecarClient.move_batch`: the arguments of a `SidecarClient.move`."""

    src: BufferSetRef
    dst: BufferSetRef
    src_ids: Ids
    dst_ids: Ids
    layers: list[str] | None = None
    request_ids: Sequence[str] = ()


def _then(sync: Sync) -> Callable[[Moved, list[memoryview]], Moved]:
    """Make a move's finish that has the caller's stream wait for the daemon's copy."""

    def finish(reply: Moved, frames: list[memoryview]) -> Moved:
        sync.after()
        return reply

    return finish


def _alloc_ids(reply: HostAllocated, data: list[memoryview]) -> IdArray:
    if len(data) != 1:
        raise SidecarError("bad_frame", "host_allocated reply without its id frame")
    return decode_ids(data[0], reply.ids_dtype, max_ids=reply.count, what="host block").copy()


def _pull_frames(
    requests: Mapping[str, tuple[Ids, Ids]],
    remote_request_ids: Mapping[str, str] | None,
    prompt_digests: Mapping[str, str] | None = None,
) -> tuple[list[PullItem], tuple[IdArray, IdArray]]:
    """Return a pull's items, and its remote and local id frames (every request's ids in turn)."""
    items = []
    remote_parts, local_parts = [], []
    for request_id, (remote_ids, local_ids) in requests.items():
        r = _as_id_array(remote_ids).astype(np.int64)
        loc = _as_id_array(local_ids).astype(np.int64)
        remote_parts.append(r)
        local_parts.append(loc)
        rid = (remote_request_ids or {}).get(request_id, "")
        digest = (prompt_digests or {}).get(request_id, "")
        items.append(PullItem(request_id, int(r.size), int(loc.size), rid, digest))
    empty = np.zeros(0, np.int64)
    frames = (
        np.concatenate(remote_parts) if remote_parts else empty,
        np.concatenate(local_parts) if local_parts else empty,
    )
    return items, frames


class _Requests:
    """One `_Call` builder per command, reading and updating a client's `_Session`."""

    def __init__(self, session: _Session) -> None:
        self._session = session
        # Bound once: every command takes an id, and every move asks for the GPUs and epochs.
        self._next_id = session.codec.next_id
        self._stamp = session.stamp
        self._cuda_syncs = session.cuda_syncs

    def hello(self, timeout: float | None = None) -> _Call[HelloReply, HelloReply]:
        """Build the hello that checks versions and learns the daemon's limits."""
        req = Hello(
            id=self._next_id(), protocol_version=PROTOCOL_VERSION, client_name=self._session.name
        )
        return _Call(req, HelloReply, _reply, timeout=timeout)

    def _prepare_register(self, reg: _Registration) -> Register:
        """Export the tensors, send their fds on the fd channel, build the Register request."""
        session = self._session
        if session.daemon is None:
            raise SidecarError("internal", "hello() must come first")
        capabilities = session.daemon.capabilities
        specs, sources = export_layers(
            reg.kv_caches,
            arrangement=reg.arrangement,
            memory_order=reg.memory_order,
            shape_order=reg.shape_order,
            capabilities=capabilities,
        )
        if len(sources) > MAX_FDS and "fd_tokens" not in capabilities:
            raise SidecarError(
                "handle_error", f"{len(sources)} fds to send; this daemon takes at most {MAX_FDS}"
            )
        if session.fd_channel is None:
            # Kept open for the worker's life: its closing tells the daemon we are gone. Also
            # for GPU memory (no fds to send): the daemon then releases a dead worker's mappings,
            # and with them its GPU memory, at once instead of at its lease's end.
            session.fd_channel = FdChannelClient(
                session.daemon.fd_socket, timeout=session.timeout_s
            )
        tokens = session.fd_channel.send_all(sources)
        return Register(
            id=self._next_id(),
            protocol_version=PROTOCOL_VERSION,
            worker=reg.worker,
            tp_size=reg.tp_size,
            pp_size=reg.pp_size,
            dcp_size=reg.dcp_size,
            model_hash=reg.model_hash,
            layers=specs,
            host_blocks=reg.host_blocks,
            fd_token=tokens[0],
            fd_tokens=tokens[1:],
        )

    def register(
        self, reg: _Registration, timeout: float | None = None, *, remember: bool = True
    ) -> _Call[Registered, Registered]:
        """Build the registration of ``reg``'s tensors (their fds go now, on the fd channel).

        ``remember`` keeps them for a replay after a daemon restart (the replay itself does not).
        """
        req = self._prepare_register(reg)
        session = self._session

        def finish(reply: Registered, frames: list[memoryview]) -> Registered:
            if remember:
                session.registrations.append(reg)
            session.track_gpu(reg, reply.worker)
            return session.registered(reply)

        return _Call(req, Registered, finish, timeout=timeout)

    def grant(
        self,
        grantee: str,
        owner: WorkerRef | None,
        read: bool,
        write: bool,
        timeout: float | None,
        *,
        grantee_user: str = "",
    ) -> _Call[Ok, None]:
        """Build a grant (or, neither ``read`` nor ``write``, a revocation)."""
        req = Grant(
            id=self._next_id(),
            owner=owner or self._session.worker,
            grantee=grantee,
            read=read,
            write=write,
            grantee_user=grantee_user,
        )
        return _Call(req, Ok, _nothing, timeout=timeout)

    def unregister(self, worker: WorkerRef | None, timeout: float | None) -> _Call[Ok, None]:
        """Build the release of a worker (default: the client's); done, the client forgets it."""
        session = self._session
        ref = worker or session.worker
        req = Unregister(id=self._next_id(), worker=ref, epoch=session.epochs.get(ref, 0))

        def finish(reply: Ok, frames: list[memoryview]) -> None:
            session.forget(ref)

        return _Call(req, Ok, finish, timeout=timeout)

    def heartbeat_request(self, refs: Sequence[WorkerRef]) -> Heartbeat:
        """Build the heartbeat of ``refs`` at their epochs (the heartbeat loops send it bare)."""
        epochs = [self._session.epochs.get(r, 0) for r in refs]
        return Heartbeat(id=self._next_id(), workers=list(refs), epochs=epochs)

    def heartbeat(
        self, workers: Sequence[WorkerRef] | None, timeout: float | None
    ) -> _Call[Ok, None]:
        """Build a lease renewal of ``workers`` (default: every worker registered here)."""
        refs = list(self._session.workers if workers is None else workers)
        return _Call(self.heartbeat_request(refs), Ok, _nothing, timeout=timeout)

    def host_alloc(
        self, engine_id: str, count: int, timeout: float | None
    ) -> _Call[HostAllocated, IdArray]:
        """Build an allocation of host-pool block ids; its result is the ids."""
        req = HostAlloc(id=self._next_id(), engine_id=engine_id, count=count)
        return _Call(req, HostAllocated, _alloc_ids, timeout=timeout)

    def host_free(self, engine_id: str, ids: Ids, timeout: float | None) -> _Call[Ok, None]:
        """Build the release of host-pool block ids."""
        arr = _as_id_array(ids)
        req = HostFree(id=self._next_id(), engine_id=engine_id, ids_dtype=_dtype_of(arr))
        return _Call(req, Ok, _nothing, (arr,), timeout)

    def move(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        src_ids: Ids,
        dst_ids: Ids,
        layers: list[str] | None,
        *,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> _Call[Moved, Moved]:
        """Build a move; on this client's GPU memory it is ordered against the caller's stream."""
        s, d = _as_id_array(src_ids), _as_id_array(dst_ids)
        if s.dtype != d.dtype:
            s, d = s.astype(np.int64), d.astype(np.int64)
        sync = self._session.gpu_sync(src, dst) if self._cuda_syncs else None
        req = Move(
            id=self._next_id(),
            src=self._stamp(src),
            dst=self._stamp(dst),
            layers=layers,
            ids_dtype=_dtype_of(s),
            request_ids=list(request_ids),
            events=None if sync is None else sync.before(),
        )
        return _Call(req, Moved, _reply if sync is None else _then(sync), (s, d), timeout)

    def move_batch(
        self, moves: Sequence[BatchMove], checksum: bool | None, timeout: float | None
    ) -> _Call[MovedBatch, MovedBatch]:
        """Build one command of many moves: their ids end to end in two frames."""
        items, src_parts, dst_parts = [], [], []
        for m in moves:
            s = _as_id_array(m.src_ids).astype(np.int64)
            d = _as_id_array(m.dst_ids).astype(np.int64)
            src_parts.append(s)
            dst_parts.append(d)
            items.append(
                MoveItem(
                    src=self._stamp(m.src),
                    dst=self._stamp(m.dst),
                    num_src=int(s.size),
                    num_dst=int(d.size),
                    layers=m.layers,
                    request_ids=list(m.request_ids),
                )
            )
        empty = np.zeros(0, np.int64)
        frames = (
            np.concatenate(src_parts) if src_parts else empty,
            np.concatenate(dst_parts) if dst_parts else empty,
        )
        req = MoveBatch(id=self._next_id(), items=items, checksum=checksum)
        return _Call(req, MovedBatch, _reply, frames, timeout)

    def fix_layout(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None,
        *,
        timeout: float | None,
    ) -> _Call[Fixed, Fixed]:
        """Build the in-place rewrite of blocks copied raw from another layout."""
        if isinstance(target, WorkerRef):
            target = BufferSetRef(target)
        ids = _as_id_array(block_ids)
        req = FixLayout(
            id=self._next_id(),
            target=self._stamp(target),
            remote=LayoutSpec(remote_memory_order, remote_block_size),
            layers=layers,
            ids_dtype=_dtype_of(ids),
        )
        return _Call(req, Fixed, _reply, (ids,), timeout)

    def pull(
        self,
        engine_id: str,
        remote_endpoint: str,
        remote_engine_id: str,
        requests: Mapping[str, tuple[Ids, Ids]],
        *,
        tp_rank: int | None,
        pp_rank: int,
        medium: Medium,
        timeout_s: float,
        remote_request_ids: Mapping[str, str] | None,
        plane: Literal["", "zmq", "nixl"],
        timeout: float | None,
        prompt_digests: Mapping[str, str] | None = None,
    ) -> _Call[Pulled, Pulled]:
        """Build a pull from another daemon; a rank's pull is ordered against its stream."""
        items, frames = _pull_frames(requests, remote_request_ids, prompt_digests)
        req = Pull(
            id=self._next_id(),
            engine_id=engine_id,
            remote_endpoint=remote_endpoint,
            remote_engine_id=remote_engine_id,
            items=items,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            medium=medium,
            timeout_s=timeout_s,
            plane=plane,
            events=None
            if tp_rank is None
            else self._session.ready(BufferSetRef(WorkerRef(engine_id, tp_rank, pp_rank), medium)),
        )
        # The daemon bounds the pull itself; wait a little longer for its verdict.
        if timeout is None:
            # The daemon refuses a timeout that is not finite: wait for its answer, not forever.
            pull_s = timeout_s if 0 < timeout_s < math.inf else 60.0
            timeout = self._session.timeout_s + pull_s
        return _Call(req, Pulled, _reply, frames, timeout)

    def publish(
        self,
        engine_id: str,
        request_id: str,
        ids: Ids,
        *,
        lease_s: float,
        timeout: float | None,
        prompt_digest: str = "",
    ) -> _Call[Ok, None]:
        """Build the hold of a request's blocks for remote readers."""
        arr = _as_id_array(ids)
        req = Publish(
            id=self._next_id(),
            engine_id=engine_id,
            request_id=request_id,
            lease_s=lease_s,
            ids_dtype=_dtype_of(arr),
            prompt_digest=prompt_digest,
        )
        return _Call(req, Ok, _nothing, (arr,), timeout)

    def take_peer_events(
        self, engine_id: str, timeout: float | None
    ) -> _Call[PeerEvents, list[PeerCompletion]]:
        """Build the take of queued peer completion events; its result is the events."""
        req = TakePeerEvents(id=self._next_id(), engine_id=engine_id)
        return _Call(req, PeerEvents, _events, timeout=timeout)

    def report(
        self,
        step: int,
        *,
        worker: WorkerRef | None,
        epoch: int | None,
        finished_sending: Collection[str],
        finished_recving: Collection[str],
        invalid_block_ids: Collection[int],
        failed_recving: Collection[str],
        expected_finished_count: int,
        kv_connector_stats: TransferStats | None,
        kv_cache_events: CacheEvents | None,
        timeout: float | None,
    ) -> _Call[Reported, Reported]:
        """Build a worker's report of one step (at its registration's epoch unless given)."""
        ref = worker or self._session.worker
        if epoch is None:
            epoch = self._session.epochs.get(ref)
            if epoch is None:
                raise SidecarError(
                    "unknown_worker", f"{ref.label()} was not registered by this client: pass epoch"
                )
        req = Report(
            id=self._next_id(),
            worker=ref,
            epoch=epoch,
            step=step,
            finished_sending=frozenset(finished_sending),
            finished_recving=frozenset(finished_recving),
            invalid_block_ids=frozenset(int(i) for i in invalid_block_ids),
            failed_recving=frozenset(failed_recving),
            expected_finished_count=expected_finished_count,
            kv_connector_stats=kv_connector_stats,
            kv_cache_events=kv_cache_events,
        )
        return _Call(req, Reported, _reply, timeout=timeout)

    def collect(
        self, engine_id: str, step: int, timeout_s: float, timeout: float | None
    ) -> _Call[Collected, Collected]:
        """Build the scheduler's collection of an engine's completions up to ``step``."""
        req = Collect(id=self._next_id(), engine_id=engine_id, step=step, timeout_s=timeout_s)
        # The daemon bounds its wait; give the reply the call's own timeout on top.
        wait = self._session.timeout_s + timeout_s if timeout is None else timeout
        return _Call(req, Collected, _reply, timeout=wait)

    def status(self, timeout: float | None) -> _Call[StatusReply, StatusReply]:
        """Build the status query."""
        return _Call(Status(id=self._next_id()), StatusReply, _reply, timeout=timeout)
