"""Every command of both clients, written once.

A command is a `_Call`: its request built from the method's arguments, the reply type it
expects, its data frames, its timeout, and the method's result made from the reply.

`_Requests` holds one builder per command. A client's public method (`kvsidecar.client.sync`,
`kvsidecar.client.aio`) only passes its arguments to the builder; its transport
(`kvsidecar.client.sync_transport`, `kvsidecar.client.aio_transport`) carries the `_Call` over
the socket, checks the reply against ``expected`` and applies ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal

import numpy as np

from kvsidecar.client.codec import Ids, R, T, _as_id_array, _dtype_of
from kvsidecar.client.common import _Base, _Registration
from kvsidecar.client.export import export_layers
from kvsidecar.memory.fd_channel import FdChannelClient, new_token
from kvsidecar.wire.cache import (
    CacheHits,
    CacheLoad,
    CacheLoaded,
    CacheLookup,
    CacheStore,
    CacheStored,
    TakeWorkerEvents,
)
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
    PeerEvents,
    Publish,
    Pull,
    Pulled,
    PullItem,
    Register,
    Registered,
    Reply,
    Report,
    Reported,
    Request,
    Status,
    StatusReply,
    TakePeerEvents,
    Unregister,
)
from kvsidecar.wire.reports import CacheEvents, PeerCompletion, TransferStats
from kvsidecar.wire.types import BufferSetRef, LayoutSpec, Medium, MemoryOrder, WorkerRef


@dataclass(frozen=True, slots=True)
class _Call(Generic[R, T]):
    """One command ready to send: ``finish`` turns the checked reply into the method's result."""

    req: Request
    expected: type[R]
    finish: Callable[[R, list[memoryview]], T]
    data: Sequence[Any] = ()
    timeout: float | None = None


def _reply(reply: R, frames: list[memoryview]) -> R:
    return reply


def _nothing(reply: Reply, frames: list[memoryview]) -> None:
    return None


def _events(reply: PeerEvents, frames: list[memoryview]) -> list[PeerCompletion]:
    return reply.events


def _alloc_ids(reply: HostAllocated, data: list[memoryview]) -> IdArray:
    if len(data) != 1:
        raise SidecarError("bad_frame", "host_allocated reply without its id frame")
    return decode_ids(data[0], reply.ids_dtype, max_ids=reply.count, what="host block").copy()


def _key_frame(keys: Sequence[bytes]) -> tuple[int, bytes]:
    """Return the keys' common size and the keys packed into one frame (all of one size)."""
    size = len(keys[0]) if keys else 32
    if any(len(k) != size for k in keys):
        raise SidecarError("invalid_message", "block keys must all have the same length")
    return size, b"".join(keys)


def _pull_frames(
    requests: Mapping[str, tuple[Ids, Ids]], remote_request_ids: Mapping[str, str] | None
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
        items.append(PullItem(request_id, int(r.size), int(loc.size), rid))
    empty = np.zeros(0, np.int64)
    frames = (
        np.concatenate(remote_parts) if remote_parts else empty,
        np.concatenate(local_parts) if local_parts else empty,
    )
    return items, frames


class _Requests(_Base):
    """One `_Call` builder per command, on the state both clients share."""

    def _hello(self, timeout: float | None = None) -> _Call[HelloReply, HelloReply]:
        req = Hello(
            id=self._codec.next_id(), protocol_version=PROTOCOL_VERSION, client_name=self.name
        )
        return _Call(req, HelloReply, _reply, timeout=timeout)

    def _prepare_register(self, reg: _Registration) -> Register:
        """Export the tensors, send their fds on the fd channel, build the Register request."""
        specs, fds = export_layers(
            reg.kv_caches,
            arrangement=reg.arrangement,
            memory_order=reg.memory_order,
            shape_order=reg.shape_order,
        )
        token = b""
        if fds:
            if self.daemon is None:
                raise SidecarError("internal", "hello() must come first")
            if self._fd_channel is None:
                # Kept open for the worker's life: its closing tells the daemon we are gone.
                self._fd_channel = FdChannelClient(self.daemon.fd_socket, timeout=self.timeout_s)
            token = new_token()
            self._fd_channel.send(token, fds)
        return Register(
            id=self._codec.next_id(),
            protocol_version=PROTOCOL_VERSION,
            worker=reg.worker,
            tp_size=reg.tp_size,
            pp_size=reg.pp_size,
            dcp_size=reg.dcp_size,
            model_hash=reg.model_hash,
            layers=specs,
            host_blocks=reg.host_blocks,
            fd_token=token,
        )

    def _register(
        self, reg: _Registration, timeout: float | None = None, *, remember: bool = True
    ) -> _Call[Registered, Registered]:
        """Register ``reg``'s tensors.

        ``remember`` keeps them for a replay after a daemon restart (the replay itself does not).
        """
        req = self._prepare_register(reg)

        def finish(reply: Registered, frames: list[memoryview]) -> Registered:
            if remember:
                self._registrations.append(reg)
            return self._registered(reply)

        return _Call(req, Registered, finish, timeout=timeout)

    def _grant(
        self, grantee: str, owner: WorkerRef | None, read: bool, write: bool, timeout: float | None
    ) -> _Call[Ok, None]:
        req = Grant(
            id=self._codec.next_id(),
            owner=owner or self.worker,
            grantee=grantee,
            read=read,
            write=write,
        )
        return _Call(req, Ok, _nothing, timeout=timeout)

    def _unregister(self, worker: WorkerRef | None, timeout: float | None) -> _Call[Ok, None]:
        ref = worker or self.worker
        req = Unregister(id=self._codec.next_id(), worker=ref, epoch=self.epochs.get(ref, 0))

        def finish(reply: Ok, frames: list[memoryview]) -> None:
            if ref in self.workers:
                self.workers.remove(ref)
            self._registrations = [r for r in self._registrations if r.worker != ref]

        return _Call(req, Ok, finish, timeout=timeout)

    def _heartbeat_request(self, refs: Sequence[WorkerRef]) -> Heartbeat:
        epochs = [self.epochs.get(r, 0) for r in refs]
        return Heartbeat(id=self._codec.next_id(), workers=list(refs), epochs=epochs)

    def _heartbeat(
        self, workers: Sequence[WorkerRef] | None, timeout: float | None
    ) -> _Call[Ok, None]:
        refs = list(self.workers if workers is None else workers)
        return _Call(self._heartbeat_request(refs), Ok, _nothing, timeout=timeout)

    def _host_alloc(
        self, engine_id: str, count: int, timeout: float | None
    ) -> _Call[HostAllocated, IdArray]:
        req = HostAlloc(id=self._codec.next_id(), engine_id=engine_id, count=count)
        return _Call(req, HostAllocated, _alloc_ids, timeout=timeout)

    def _host_free(self, engine_id: str, ids: Ids, timeout: float | None) -> _Call[Ok, None]:
        arr = _as_id_array(ids)
        req = HostFree(id=self._codec.next_id(), engine_id=engine_id, ids_dtype=_dtype_of(arr))
        return _Call(req, Ok, _nothing, (arr,), timeout)

    def _move(
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
        s, d = _as_id_array(src_ids), _as_id_array(dst_ids)
        if s.dtype != d.dtype:
            s, d = s.astype(np.int64), d.astype(np.int64)
        req = Move(
            id=self._codec.next_id(),
            src=self._stamp(src),
            dst=self._stamp(dst),
            layers=layers,
            ids_dtype=_dtype_of(s),
            request_ids=list(request_ids),
        )
        return _Call(req, Moved, _reply, (s, d), timeout)

    def _fix(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None,
        *,
        timeout: float | None,
    ) -> _Call[Fixed, Fixed]:
        if isinstance(target, WorkerRef):
            target = BufferSetRef(target)
        ids = _as_id_array(block_ids)
        req = FixLayout(
            id=self._codec.next_id(),
            target=self._stamp(target),
            remote=LayoutSpec(remote_memory_order, remote_block_size),
            layers=layers,
            ids_dtype=_dtype_of(ids),
        )
        return _Call(req, Fixed, _reply, (ids,), timeout)

    # --- peer (node-to-node transfer) ---

    def _pull(
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
    ) -> _Call[Pulled, Pulled]:
        items, frames = _pull_frames(requests, remote_request_ids)
        req = Pull(
            id=self._codec.next_id(),
            engine_id=engine_id,
            remote_endpoint=remote_endpoint,
            remote_engine_id=remote_engine_id,
            items=items,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            medium=medium,
            timeout_s=timeout_s,
            plane=plane,
        )
        # The daemon bounds the pull itself; wait a little longer for its verdict.
        if timeout is None:
            timeout = self.timeout_s + (timeout_s if timeout_s > 0 else 60.0)
        return _Call(req, Pulled, _reply, frames, timeout)

    def _publish(
        self, engine_id: str, request_id: str, ids: Ids, lease_s: float, timeout: float | None
    ) -> _Call[Ok, None]:
        arr = _as_id_array(ids)
        req = Publish(
            id=self._codec.next_id(),
            engine_id=engine_id,
            request_id=request_id,
            lease_s=lease_s,
            ids_dtype=_dtype_of(arr),
        )
        return _Call(req, Ok, _nothing, (arr,), timeout)

    def _take_peer_events(
        self, engine_id: str, timeout: float | None
    ) -> _Call[PeerEvents, list[PeerCompletion]]:
        req = TakePeerEvents(id=self._codec.next_id(), engine_id=engine_id)
        return _Call(req, PeerEvents, _events, timeout=timeout)

    # --- end peer ---

    # --- completion aggregation (kvsidecar/daemon/completions.py) ---

    def _report(
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
        ref = worker or self.worker
        if epoch is None:
            epoch = self.epochs.get(ref)
            if epoch is None:
                raise SidecarError(
                    "unknown_worker", f"{ref.label()} was not registered by this client: pass epoch"
                )
        req = Report(
            id=self._codec.next_id(),
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

    def _collect(
        self, engine_id: str, step: int, timeout_s: float, timeout: float | None
    ) -> _Call[Collected, Collected]:
        req = Collect(id=self._codec.next_id(), engine_id=engine_id, step=step, timeout_s=timeout_s)
        # The daemon bounds its wait; give the reply the call's own timeout on top.
        wait = self.timeout_s + timeout_s if timeout is None else timeout
        return _Call(req, Collected, _reply, timeout=wait)

    # --- end completion aggregation ---

    # --- prefix cache and connectors (kvsidecar/daemon/cache.py, worker_events.py) ---

    def _cache_lookup(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        tp_size: int,
        pin_s: float,
        timeout: float | None,
    ) -> _Call[CacheHits, CacheHits]:
        size, frame = _key_frame(keys)
        req = CacheLookup(
            id=self._codec.next_id(),
            fingerprint=fingerprint,
            tp_size=tp_size,
            key_size=size,
            pin_s=pin_s,
        )
        return _Call(req, CacheHits, _reply, (frame,), timeout)

    def _cache_store(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        worker: WorkerRef | None,
        not_after: float,
        capacity_bytes: int = 0,
        timeout: float | None,
    ) -> _Call[CacheStored, CacheStored]:
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        req = CacheStore(
            id=self._codec.next_id(),
            source=self._stamp(BufferSetRef(worker or self.worker)),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            not_after=not_after,
            capacity_bytes=capacity_bytes,
        )
        return _Call(req, CacheStored, _reply, (frame, ids), timeout)

    def _cache_load(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        worker: WorkerRef | None,
        pin_id: int,
        timeout: float | None,
    ) -> _Call[CacheLoaded, CacheLoaded]:
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        req = CacheLoad(
            id=self._codec.next_id(),
            target=self._stamp(BufferSetRef(worker or self.worker)),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            pin_id=pin_id,
        )
        return _Call(req, CacheLoaded, _reply, (frame, ids), timeout)

    def _take_worker_events(
        self, worker: WorkerRef | None, timeout: float | None
    ) -> _Call[PeerEvents, list[PeerCompletion]]:
        ref = worker or self.worker
        req = TakeWorkerEvents(id=self._codec.next_id(), worker=ref, epoch=self.epochs.get(ref, 0))
        return _Call(req, PeerEvents, _events, timeout=timeout)

    # --- end prefix cache ---

    def _status(self, timeout: float | None) -> _Call[StatusReply, StatusReply]:
        return _Call(Status(id=self._codec.next_id()), StatusReply, _reply, timeout=timeout)
