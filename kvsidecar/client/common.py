"""What both clients share: the codec, tensor export, and every request built from its arguments.

`_Base` holds the client state (daemon, workers, epochs, registrations kept for a reconnect) and
turns each command's arguments into a `_Call`: the request, the reply type it expects, its id
frames, its timeout, and what to make of the reply. A flavour (`kvsidecar.client.sync`,
`kvsidecar.client.aio`) only carries calls over its socket, so each public method is one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import torch
import zmq

from kvsidecar.core import layout
from kvsidecar.memory.cuda_ipc import export_cuda_tensors
from kvsidecar.memory.fd_channel import FdChannelClient, new_token
from kvsidecar.memory.shm import export_tensors
from kvsidecar.wire.curve import KeyPair, client_keys_from_env, secure_client_socket
from kvsidecar.wire.endpoints import default_endpoint
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray, decode_ids, encode_ids
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Collect,
    Collected,
    Error,
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
from kvsidecar.wire.types import (
    Arrangement,
    BufferSetRef,
    HandleRef,
    IdsDtype,
    LayerSpec,
    LayoutSpec,
    Medium,
    MemoryOrder,
    WorkerRef,
)

Ids = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Block ids as an engine has them: a list, a numpy array, or a CPU integer tensor."""

R = TypeVar("R", bound=Reply)
T = TypeVar("T")


def _as_id_array(ids: Ids) -> IdArray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype == np.int32:
        return encode_ids(arr, "int32")
    return encode_ids(arr, "int64")


def _dtype_of(arr: IdArray) -> IdsDtype:
    return "int32" if arr.dtype.itemsize == 4 else "int64"


class _Codec:
    """Encoding of requests and decoding of replies, shared by both clients."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Reply)
        self.ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self.ids)

    def decode(self, frames: Sequence[bytes | zmq.Frame]) -> tuple[Reply, list[memoryview]]:
        if not frames:
            raise SidecarError("bad_frame", "empty reply")
        head = frames[0]
        raw = head.buffer if isinstance(head, zmq.Frame) else head
        try:
            reply = self.decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise SidecarError("bad_frame", f"unreadable reply: {exc}") from None
        data = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames[1:]]
        return reply, data


def _check(reply: Reply, expected: type[R]) -> R:
    if isinstance(reply, Error):
        raise SidecarError(reply.code, reply.message, request_id=reply.id)
    if not isinstance(reply, expected):
        raise SidecarError(
            "internal", f"expected {expected.__name__}, the daemon sent {type(reply).__name__}"
        )
    return reply


def _reply(reply: R, frames: list[memoryview]) -> R:
    return reply


def _nothing(reply: Reply, frames: list[memoryview]) -> None:
    return None


@dataclass(frozen=True, slots=True)
class _Call(Generic[R, T]):
    """One command ready to send: ``finish`` turns the checked reply into the method's result."""

    req: Request
    expected: type[R]
    finish: Callable[[R, list[memoryview]], T]
    data: Sequence[Any] = ()
    timeout: float | None = None


def export_layers(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    arrangement: Arrangement,
    memory_order: MemoryOrder | None,
    shape_order: layout.ShapeOrder,
) -> tuple[list[LayerSpec], list[int]]:
    """Describe and export every tensor: the layer specs, and the shm fds to send (not owned).

    CPU tensors must live in shared memory (`kvsidecar.memory.allocate_kv_caches`, or
    ``share_memory_()`` under torch's file_descriptor strategy); CUDA tensors go by CUDA IPC.
    """
    if not kv_caches:
        raise SidecarError("invalid_message", "kv_caches is empty")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    descs = [
        layout.describe_tensor(
            t, arrangement=arrangement, memory_order=memory_order, shape_order=shape_order
        )
        for t in tensors
    ]
    cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    gpu = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
    if len(cpu) + len(gpu) != len(tensors):
        raise SidecarError("invalid_message", "KV tensors must be on the CPU or a CUDA device")
    # The memory modules' handles are the wire types (ShmHandle is ShmRef, CudaIpcHandle is
    # CudaIpcRef): they go into the request as they are.
    handles: dict[int, HandleRef] = {}
    fds: list[int] = []
    if cpu:
        shm, fds = export_tensors([tensors[i] for i in cpu])
        handles.update(zip(cpu, shm, strict=True))
    if gpu:
        handles.update(zip(gpu, export_cuda_tensors([tensors[i] for i in gpu]), strict=True))
    specs = [LayerSpec(n, d, handles[i]) for i, (n, d) in enumerate(zip(names, descs, strict=True))]
    return specs, fds


def _reg_ref(registration: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> WorkerRef:
    kw = registration[1]
    return WorkerRef(kw["engine_id"], kw["tp_rank"], kw["pp_rank"], kw["dcp_rank"])


class _Base:
    """State and request building shared by both clients."""

    def __init__(
        self,
        endpoint: str | None,
        timeout_s: float,
        name: str,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self._curve = curve or client_keys_from_env(self.endpoint)
        """(daemon's public key, our key pair) for a CURVE tcp endpoint; None: plain."""
        self.timeout_s = timeout_s
        self.name = name
        self._codec = _Codec()
        self.daemon: HelloReply | None = None
        """The daemon's hello reply (versions, fd socket, lease, limits)."""
        self.workers: list[WorkerRef] = []
        """Workers registered through this client (kept alive by its heartbeats)."""
        self.epochs: dict[WorkerRef, int] = {}
        """Registration epoch of each worker registered here (`Registered.epoch`)."""
        self._fd_channel: FdChannelClient | None = None
        # --- reliability: what a re-registration after a daemon restart needs ---
        self._registrations: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []
        """Every successful registration's tensors and arguments, replayed by ``reconnect``."""
        self._lost = False
        """Set when the daemon went away (fd channel EOF); the next call reconnects first."""
        self.reconnects = 0
        """Completed reconnections (daemon restarts survived)."""

    @property
    def worker(self) -> WorkerRef:
        """The (first) worker this client registered."""
        if not self.workers:
            raise SidecarError("unknown_worker", "this client has not registered a worker")
        return self.workers[0]

    # --- reliability and security: epochs, grants, loss of the daemon ---

    def _stamp(self, ref: BufferSetRef) -> BufferSetRef:
        """Add the epoch of a worker registered here, so a later registration fences the call."""
        epoch = self.epochs.get(ref.worker, 0)
        if ref.epoch or not epoch:
            return ref
        return BufferSetRef(ref.worker, ref.medium, epoch)

    def _heartbeat_request(self, refs: Sequence[WorkerRef]) -> Heartbeat:
        epochs = [self.epochs.get(r, 0) for r in refs]
        return Heartbeat(id=self._codec.next_id(), workers=list(refs), epochs=epochs)

    def _secure(self, sock: zmq.Socket[Any]) -> None:
        if self._curve is not None:
            server_public, keys = self._curve
            secure_client_socket(sock, server_public=server_public, keys=keys)

    def _daemon_gone(self) -> bool:
        """Whether the daemon closed our fd channel (it exited, or restarted)."""
        return self._fd_channel is not None and self._fd_channel.peer_closed()

    @staticmethod
    def _lost_error(req: Request) -> SidecarError:
        return SidecarError(
            "connection_lost",
            f"the daemon went away while {type(req).__name__} {req.id} was in flight: its "
            "outcome is unknown (treat a move's destination blocks as invalid)",
            request_id=req.id,
        )

    def _registered(self, reply: Registered) -> Registered:
        """Track a worker the daemon accepted (a registration, or its replay on reconnect)."""
        self.workers.append(reply.worker)
        self.epochs[reply.worker] = reply.epoch
        return reply

    def _forget_workers(self) -> None:
        """Before replaying the registrations on a restarted daemon: it knows none of them."""
        self._close_fd_channel()
        self.workers.clear()
        self.epochs.clear()

    # --- end reliability and security ---

    # --- requests: one `_Call` per command ---

    def _hello(self, timeout: float | None = None) -> _Call[HelloReply, HelloReply]:
        req = Hello(
            id=self._codec.next_id(), protocol_version=PROTOCOL_VERSION, client_name=self.name
        )
        return _Call(req, HelloReply, _reply, timeout=timeout)

    def _prepare_register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
        dcp_rank: int,
        dcp_size: int,
        model_hash: str,
        arrangement: Arrangement,
        memory_order: MemoryOrder | None,
        shape_order: layout.ShapeOrder,
        host_blocks: int,
    ) -> Register:
        """Export the tensors, send their fds on the fd channel, build the Register request."""
        specs, fds = export_layers(
            kv_caches, arrangement=arrangement, memory_order=memory_order, shape_order=shape_order
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
            worker=WorkerRef(engine_id, tp_rank, pp_rank, dcp_rank),
            tp_size=tp_size,
            pp_size=pp_size,
            dcp_size=dcp_size,
            model_hash=model_hash,
            layers=specs,
            host_blocks=host_blocks,
            fd_token=token,
        )

    def _register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        *,
        remember: bool = True,
    ) -> _Call[Registered, Registered]:
        """Register ``kv_caches`` with `_prepare_register`'s ``kwargs``.

        ``remember`` keeps them for a replay after a daemon restart (the replay itself does not).
        """
        req = self._prepare_register(kv_caches, **kwargs)

        def finish(reply: Registered, frames: list[memoryview]) -> Registered:
            if remember:
                self._registrations.append((dict(kv_caches), kwargs))
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
            self._registrations = [r for r in self._registrations if _reg_ref(r) != ref]

        return _Call(req, Ok, finish, timeout=timeout)

    def _heartbeat(
        self, workers: Sequence[WorkerRef] | None, timeout: float | None
    ) -> _Call[Ok, None]:
        refs = list(self.workers if workers is None else workers)
        return _Call(self._heartbeat_request(refs), Ok, _nothing, timeout=timeout)

    def _host_alloc(
        self, engine_id: str, count: int, timeout: float | None
    ) -> _Call[HostAllocated, IdArray]:
        req = HostAlloc(id=self._codec.next_id(), engine_id=engine_id, count=count)
        return _Call(req, HostAllocated, self._alloc_ids, timeout=timeout)

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
        timeout: float | None = None,
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
        plane: Literal["", "zmq", "nixl"] = "",
        timeout: float | None = None,
    ) -> _Call[Pulled, Pulled]:
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
        frames = (
            np.concatenate(remote_parts) if remote_parts else empty,
            np.concatenate(local_parts) if local_parts else empty,
        )
        return _Call(req, Pulled, _reply, frames, self._pull_timeout(timeout, timeout_s))

    def _pull_timeout(self, timeout: float | None, timeout_s: float) -> float:
        # The daemon bounds the pull itself; wait a little longer for its verdict.
        if timeout is not None:
            return timeout
        return self.timeout_s + (timeout_s if timeout_s > 0 else 60.0)

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

    # --- completion aggregation (kvsidecar/completions.py) ---

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
        timeout: float | None = None,
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

    def _status(self, timeout: float | None) -> _Call[StatusReply, StatusReply]:
        return _Call(Status(id=self._codec.next_id()), StatusReply, _reply, timeout=timeout)

    def _alloc_ids(self, reply: HostAllocated, data: list[memoryview]) -> IdArray:
        if len(data) != 1:
            raise SidecarError("bad_frame", "host_allocated reply without its id frame")
        return decode_ids(data[0], reply.ids_dtype, max_ids=reply.count, what="host block").copy()

    def _close_fd_channel(self) -> None:
        if self._fd_channel is not None:
            self._fd_channel.close()
            self._fd_channel = None


def _events(reply: PeerEvents, frames: list[memoryview]) -> list[PeerCompletion]:
    return reply.events
