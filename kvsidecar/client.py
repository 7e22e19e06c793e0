"""What an engine worker imports: `SidecarClient` (blocking) and `AsyncSidecarClient`.

Both speak the same protocol over a ZeroMQ DEALER socket, with typed methods for every command,
a per-call timeout, and `SidecarError` (carrying the wire error code) for every failure::

    from kvsidecar.client import SidecarClient

    with SidecarClient() as sidecar:                    # default endpoint of this user's daemon
        sidecar.register_kv_caches(kv_caches, engine_id="prefill", tp_rank=0, tp_size=2)
        ids = sidecar.host_alloc("prefill", 16)
        sidecar.offload(sidecar.worker, device_ids=[3, 4, 5], host_ids=ids[:3])

A registered client keeps its worker's lease with heartbeats (a background thread, or a task for
the async client) and keeps the fd channel open: closing the client, or the process dying, makes
the daemon release the worker's mappings.

The blocking client is not thread-safe: use one per thread (the heartbeat has its own socket).

Daemon restarts: a call in flight when the daemon dies fails at once with ``connection_lost``
(the fd channel closes); the next call, or the heartbeat, reconnects with backoff and registers
the same tensors again (new epochs), so an engine keeps running across a restart. For a tcp
endpoint with CurveZMQ pass ``curve=(daemon_public_key, client_key_pair)`` or set
``KVSIDECAR_SERVER_PUBLIC_KEY`` and ``KVSIDECAR_CLIENT_SECRET_KEY`` (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import torch
import zmq
import zmq.asyncio

from kvsidecar import layout
from kvsidecar.auth import KeyPair, client_keys_from_env, secure_client_socket
from kvsidecar.config import Config
from kvsidecar.errors import SidecarError
from kvsidecar.framing import IdArray, decode_ids, encode_ids
from kvsidecar.memory.cuda_ipc import export_cuda_tensors
from kvsidecar.memory.fd_channel import FdChannelClient, new_token
from kvsidecar.memory.shm import export_tensors
from kvsidecar.protocol import (  # peer
    PROTOCOL_VERSION,
    Arrangement,
    BufferSetRef,
    CacheEvents,
    Collect,
    Collected,
    CudaIpcRef,
    Error,
    Fixed,
    FixLayout,
    Grant,
    HandleRef,
    Heartbeat,
    Hello,
    HelloReply,
    HostAlloc,
    HostAllocated,
    HostFree,
    IdsDtype,
    LayerSpec,
    LayoutSpec,
    Medium,
    MemoryOrder,
    Move,
    Moved,
    Ok,
    PeerCompletion,
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
    ShmRef,
    Status,
    StatusReply,
    TakePeerEvents,
    TransferStats,
    Unregister,
    WorkerRef,
)

__all__ = [
    "AsyncSidecarClient",
    "BufferSetRef",
    "SidecarClient",
    "SidecarError",
    "WorkerRef",
    "default_endpoint",
]

log = logging.getLogger("kvsidecar.client")

Ids = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Block ids as an engine has them: a list, a numpy array, or a CPU integer tensor."""

R = TypeVar("R", bound=Reply)


def default_endpoint() -> str:
    """Return the endpoint a daemon started with this environment listens on (``KVSIDECAR_*``)."""
    return Config.load().endpoint


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
    handles: dict[int, HandleRef] = {}
    fds: list[int] = []
    if cpu:
        shm, fds = export_tensors([tensors[i] for i in cpu])
        for i, h in zip(cpu, shm, strict=True):
            handles[i] = ShmRef(h.fd_index, h.storage_nbytes, h.offset, h.nbytes)
    if gpu:
        for i, c in zip(gpu, export_cuda_tensors([tensors[i] for i in gpu]), strict=True):
            handles[i] = CudaIpcRef(**msgspec.structs.asdict(c))
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

    def _grant(self, grantee: str, owner: WorkerRef | None, read: bool, write: bool) -> Grant:
        return Grant(
            id=self._codec.next_id(),
            owner=owner or self.worker,
            grantee=grantee,
            read=read,
            write=write,
        )

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

    def _remember(self, kv_caches: Mapping[str, torch.Tensor], kwargs: dict[str, Any]) -> None:
        self._registrations.append((dict(kv_caches), kwargs))

    # --- end reliability and security ---

    def _hello(self) -> Hello:
        return Hello(
            id=self._codec.next_id(), protocol_version=PROTOCOL_VERSION, client_name=self.name
        )

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

    def _move(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        src_ids: Ids,
        dst_ids: Ids,
        layers: list[str] | None,
        *,
        request_ids: Sequence[str] = (),
    ) -> tuple[Move, tuple[IdArray, IdArray]]:
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
        return req, (s, d)

    def _fix(
        self,
        target: BufferSetRef,
        block_ids: Ids,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None,
    ) -> tuple[FixLayout, tuple[IdArray]]:
        ids = _as_id_array(block_ids)
        req = FixLayout(
            id=self._codec.next_id(),
            target=self._stamp(target),
            remote=LayoutSpec(remote_memory_order, remote_block_size),
            layers=layers,
            ids_dtype=_dtype_of(ids),
        )
        return req, (ids,)

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
    ) -> tuple[Pull, tuple[IdArray, IdArray]]:
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
        return req, frames

    def _pull_timeout(self, timeout: float | None, timeout_s: float) -> float:
        # The daemon bounds the pull itself; wait a little longer for its verdict.
        if timeout is not None:
            return timeout
        return self.timeout_s + (timeout_s if timeout_s > 0 else 60.0)

    def _publish(self, engine_id: str, request_id: str, ids: Ids, lease_s: float) -> Publish:
        arr = _as_id_array(ids)
        return Publish(
            id=self._codec.next_id(),
            engine_id=engine_id,
            request_id=request_id,
            lease_s=lease_s,
            ids_dtype=_dtype_of(arr),
        )

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
    ) -> Report:
        ref = worker or self.worker
        if epoch is None:
            epoch = self.epochs.get(ref)
            if epoch is None:
                raise SidecarError(
                    "unknown_worker", f"{ref.label()} was not registered by this client: pass epoch"
                )
        return Report(
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

    def _collect(self, engine_id: str, step: int, timeout_s: float) -> tuple[Collect, float]:
        req = Collect(id=self._codec.next_id(), engine_id=engine_id, step=step, timeout_s=timeout_s)
        # The daemon bounds its wait; give the reply the call's own timeout on top.
        return req, self.timeout_s + timeout_s

    # --- end completion aggregation ---

    def _alloc_ids(self, reply: HostAllocated, data: list[memoryview]) -> IdArray:
        if len(data) != 1:
            raise SidecarError("bad_frame", "host_allocated reply without its id frame")
        return decode_ids(data[0], reply.ids_dtype, max_ids=reply.count, what="host block").copy()

    def _close_fd_channel(self) -> None:
        if self._fd_channel is not None:
            self._fd_channel.close()
            self._fd_channel = None


class SidecarClient(_Base):
    """Blocking client. Connects and says hello in the constructor; use as a context manager.

    ``timeout_s`` bounds every call (override per call with ``timeout=``); a call that times out
    raises `SidecarError` with code ``timeout`` and its late reply is discarded. ``heartbeat``:
    renew the leases of registered workers from a background thread.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = 10.0,
        name: str = "",
        heartbeat: bool = True,
        context: zmq.Context[Any] | None = None,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_s, name, curve)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._new_socket()
        self._heartbeat_enabled = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._closed = False
        # One call at a time on the socket: the heartbeat thread reconnects through it too.
        self._lock = threading.RLock()
        try:
            self.daemon = self.hello()
        except BaseException:
            self.close()
            raise

    # -- plumbing

    def _call(
        self,
        req: Request,
        expected: type[R],
        data: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[R, list[memoryview]]:
        if self._closed:
            raise SidecarError("internal", "the client is closed")
        with self._lock:
            if self._lost or self._daemon_gone():
                self._lost = True
                self.reconnect()  # raises connection_lost while the daemon stays away
            self._sock.send_multipart([self._codec.encoder.encode(req), *data], copy=False)
            deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            if self._fd_channel is not None:  # EOF on it: the daemon died with our request
                poller.register(self._fd_channel.fileno(), zmq.POLLIN)
            while True:
                left = deadline - time.monotonic()
                ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
                if self._sock not in ready:
                    if ready and self._daemon_gone():
                        self._lost = True
                        raise self._lost_error(req)
                    if time.monotonic() >= deadline:
                        raise SidecarError(
                            "timeout",
                            f"no reply to {type(req).__name__} within the timeout",
                            request_id=req.id,
                        )
                    continue
                reply, frames = self._codec.decode(self._sock.recv_multipart(copy=False))
                if reply.id == req.id or (reply.id == 0 and isinstance(reply, Error)):
                    return _check(reply, expected), frames
                # A late reply to a call that timed out: drop it.

    # -- reliability: reconnect after a daemon restart

    def _new_socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._secure(sock)
        sock.connect(self.endpoint)
        return sock

    def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register every worker registered here.

        Retries with exponential backoff (50 ms doubling to 2 s) for up to ``timeout`` seconds
        (default: the client's ``timeout_s``); raises `SidecarError` ``connection_lost`` if the
        daemon does not come back in time (the next call tries again). The tensors stay where
        they are: they are exported again, with new epochs. Calls lock out meanwhile.
        """
        with self._lock:
            deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
            delay = 0.05
            # The hello below must not recurse into reconnect: the dead daemon's fd channel goes
            # now (a re-registration opens a new one), and the loss is cleared while trying.
            self._close_fd_channel()
            self._lost = False
            while True:
                # A fresh socket: nothing queued for the dead daemon is sent to the new one.
                self._sock.close(linger=0)
                self._sock = self._new_socket()
                left = deadline - time.monotonic()
                try:
                    self.daemon = self.hello(timeout=max(0.05, min(1.0, left)))
                    break
                except SidecarError as exc:
                    if time.monotonic() + delay >= deadline:
                        self._lost = True
                        raise SidecarError(
                            "connection_lost", f"the daemon did not come back: {exc}"
                        ) from None
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
            self._close_fd_channel()
            self.workers.clear()
            self.epochs.clear()
            try:
                for kv_caches, kwargs in self._registrations:
                    req = self._prepare_register(kv_caches, **kwargs)
                    reply = self._call(req, Registered)[0]
                    self.workers.append(reply.worker)
                    self.epochs[reply.worker] = reply.epoch
            except SidecarError:
                self._lost = True  # try again on the next call
                raise
            self.reconnects += 1
            log.info(
                "reconnected to %s; re-registered %d workers", self.endpoint, len(self.workers)
            )

    # -- commands

    def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return self._call(self._hello(), HelloReply, timeout=timeout)[0]

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        engine_id: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        model_hash: str = "",
        arrangement: Arrangement = "kv_first",
        memory_order: MemoryOrder | None = None,
        shape_order: layout.ShapeOrder = "NH",
        host_blocks: int = 0,
        timeout: float | None = None,
    ) -> Registered:
        """Register this worker's KV tensors (layer name -> tensor) with the daemon.

        Each tensor is described from its shape and strides (``arrangement`` says which dims are
        which; ``memory_order`` is checked when given) and exported by handle, never copied.
        ``host_blocks`` declares the engine's host-pool capacity (first worker of the engine).
        """
        req = self._prepare_register(
            kv_caches,
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            model_hash=model_hash,
            arrangement=arrangement,
            memory_order=memory_order,
            shape_order=shape_order,
            host_blocks=host_blocks,
        )
        reply = self._call(req, Registered, timeout=timeout)[0]
        self.workers.append(reply.worker)
        self.epochs[reply.worker] = reply.epoch
        self._remember(
            kv_caches,
            {
                "engine_id": engine_id,
                "tp_rank": tp_rank,
                "tp_size": tp_size,
                "pp_rank": pp_rank,
                "pp_size": pp_size,
                "dcp_rank": dcp_rank,
                "dcp_size": dcp_size,
                "model_hash": model_hash,
                "arrangement": arrangement,
                "memory_order": memory_order,
                "shape_order": shape_order,
                "host_blocks": host_blocks,
            },
        )
        self._start_heartbeat(reply.lease_s)
        return reply

    def grant(
        self,
        grantee: str,
        *,
        read: bool = True,
        write: bool = False,
        owner: WorkerRef | None = None,
        timeout: float | None = None,
    ) -> None:
        """Let engine ``grantee`` read and/or write this engine's blocks (see `Grant`).

        ``owner``: the registered worker whose engine grants (default: this client's worker).
        ``read=False, write=False`` revokes.
        """
        self._call(self._grant(grantee, owner, read, write), Ok, timeout=timeout)

    def unregister(self, worker: WorkerRef | None = None, *, timeout: float | None = None) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        ref = worker or self.worker
        req = Unregister(id=self._codec.next_id(), worker=ref, epoch=self.epochs.get(ref, 0))
        self._call(req, Ok, timeout=timeout)
        if ref in self.workers:
            self.workers.remove(ref)
        self._registrations = [r for r in self._registrations if _reg_ref(r) != ref]

    def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now (the background heartbeat does this on its own)."""
        refs = list(self.workers if workers is None else workers)
        self._call(self._heartbeat_request(refs), Ok, timeout=timeout)

    def host_alloc(self, engine_id: str, count: int, *, timeout: float | None = None) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        req = HostAlloc(id=self._codec.next_id(), engine_id=engine_id, count=count)
        reply, data = self._call(req, HostAllocated, timeout=timeout)
        return self._alloc_ids(reply, data)

    def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine (all checked first: nothing freed on error)."""
        arr = _as_id_array(ids)
        req = HostFree(id=self._codec.next_id(), engine_id=engine_id, ids_dtype=_dtype_of(arr))
        self._call(req, Ok, (arr,), timeout=timeout)

    def move(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        src_ids: Ids,
        dst_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks ``src_ids`` of ``src`` into ``dst_ids`` of ``dst`` (see `Move`).

        ``request_ids``: the engine requests these blocks belong to; the daemon reports them as
        finished sending (device source) / receiving (device destination) for the workers.
        """
        req, data = self._move(src, dst, src_ids, dst_ids, layers, request_ids=request_ids)
        return self._call(req, Moved, data, timeout=timeout)[0]

    def offload(
        self,
        worker: WorkerRef,
        device_ids: Ids,
        host_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy a worker's blocks into its host mirror (device -> host)."""
        return self.move(
            BufferSetRef(worker, "device"),
            BufferSetRef(worker, "host"),
            device_ids,
            host_ids,
            layers=layers,
            request_ids=request_ids,
            timeout=timeout,
        )

    def onboard(
        self,
        worker: WorkerRef,
        host_ids: Ids,
        device_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks from a worker's host mirror back into its KV cache (host -> device)."""
        return self.move(
            BufferSetRef(worker, "host"),
            BufferSetRef(worker, "device"),
            host_ids,
            device_ids,
            layers=layers,
            request_ids=request_ids,
            timeout=timeout,
        )

    def fix_layout(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        *,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Fixed:
        """Rewrite blocks that a raw copy filled in another layout into the registered one."""
        if isinstance(target, WorkerRef):
            target = BufferSetRef(target)
        req, data = self._fix(target, block_ids, remote_memory_order, remote_block_size, layers)
        return self._call(req, Fixed, data, timeout=timeout)[0]

    # --- peer (node-to-node transfer) ---

    def pull(
        self,
        engine_id: str,
        remote_endpoint: str,
        remote_engine_id: str,
        requests: Mapping[str, tuple[Ids, Ids]],
        *,
        tp_rank: int | None = None,
        pp_rank: int = 0,
        medium: Medium = "device",
        timeout_s: float = 0.0,
        remote_request_ids: Mapping[str, str] | None = None,
        plane: Literal["", "zmq", "nixl"] = "",
        timeout: float | None = None,
    ) -> Pulled:
        """Pull requests' blocks from another node's daemon: ``{request_id: (remote, local)}``.

        ``remote_endpoint`` is the remote daemon's ``peer_endpoint``; ``tp_rank`` None pulls for
        every rank of the engine. Returns when every request is received or failed (`Pulled`);
        ``timeout_s`` bounds it on the daemon (0: its ``peer_pull_timeout_s``). An incompatible
        peer raises `SidecarError` ``incompatible_peer`` naming the mismatch.
        """
        req, frames = self._pull(
            engine_id,
            remote_endpoint,
            remote_engine_id,
            requests,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            medium=medium,
            timeout_s=timeout_s,
            remote_request_ids=remote_request_ids,
            plane=plane,
        )
        return self._call(req, Pulled, frames, timeout=self._pull_timeout(timeout, timeout_s))[0]

    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Ids,
        *,
        lease_s: float = 0.0,
        timeout: float | None = None,
    ) -> None:
        """Hold a request's blocks for remote readers (producer side; see `Publish`)."""
        req = self._publish(engine_id, request_id, block_ids, lease_s)
        self._call(req, Ok, (_as_id_array(block_ids),), timeout=timeout)

    def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events (finished/failed sending and receiving)."""
        req = TakePeerEvents(id=self._codec.next_id(), engine_id=engine_id)
        return self._call(req, PeerEvents, timeout=timeout)[0].events

    # --- end peer ---

    # --- completion aggregation ---

    def report(
        self,
        step: int,
        *,
        finished_sending: Collection[str] = (),
        finished_recving: Collection[str] = (),
        invalid_block_ids: Collection[int] = (),
        failed_recving: Collection[str] = (),
        expected_finished_count: int = 0,
        kv_connector_stats: TransferStats | None = None,
        kv_cache_events: CacheEvents | None = None,
        worker: WorkerRef | None = None,
        epoch: int | None = None,
        timeout: float | None = None,
    ) -> Reported:
        """Report a worker's completions of engine step ``step`` (see `Report`).

        ``worker`` defaults to this client's worker and ``epoch`` to its registration's. Safe to
        retry: a copy of a counted report is acknowledged as a duplicate. ``step_collected``
        means the scheduler has collected that step: send the same content with the next step.
        """
        req = self._report(
            step,
            worker=worker,
            epoch=epoch,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids,
            failed_recving=failed_recving,
            expected_finished_count=expected_finished_count,
            kv_connector_stats=kv_connector_stats,
            kv_cache_events=kv_cache_events,
        )
        return self._call(req, Reported, timeout=timeout)[0]

    def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions up to ``step`` (the scheduler's call).

        Waits up to ``timeout_s`` for every live worker's report of the step (see `Collect`);
        ``.output`` is the `AggregatedOutput`. Collecting the same step again returns the same
        answer, so a retry loses nothing.
        """
        req, wait = self._collect(engine_id, step, timeout_s)
        return self._call(req, Collected, timeout=wait if timeout is None else timeout)[0]

    # --- end completion aggregation ---

    def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's engines, workers, buffers, host pool, in-flight moves and totals."""
        return self._call(Status(id=self._codec.next_id()), StatusReply, timeout=timeout)[0]

    # -- lifecycle

    def _start_heartbeat(self, lease_s: float) -> None:
        if not self._heartbeat_enabled or self._hb_thread is not None:
            return
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(lease_s / 3,),
            name="kvsidecar-heartbeat",
            daemon=True,
        )
        self._hb_thread.start()

    def _heartbeat_loop(self, interval: float) -> None:
        # Its own socket: zmq sockets must not be shared between threads.
        sock = self._new_socket()
        try:
            while not self._hb_stop.wait(interval):
                forgotten = False
                # Drain replies; an unknown_worker means the daemon forgot us (restart).
                while sock.poll(0, zmq.POLLIN):
                    reply, _ = self._codec.decode(sock.recv_multipart())
                    if isinstance(reply, Error):
                        log.warning("heartbeat refused: %s %s", reply.code, reply.message)
                        forgotten |= reply.code in ("unknown_worker", "unknown_engine")
                if (forgotten or self._lost or self._daemon_gone()) and self._registrations:
                    self._reconnect_from_heartbeat(interval)
                    continue
                with self._lock:
                    req = self._heartbeat_request(list(self.workers))
                sock.send(self._codec.encoder.encode(req))
        finally:
            sock.close(linger=0)

    def _reconnect_from_heartbeat(self, interval: float) -> None:
        # The engine may be idle: re-register now rather than on its next call. The lock is
        # only waited for briefly, so a long call of the engine's just delays this.
        if not self._lock.acquire(timeout=interval):
            return
        try:
            self._lost = True
            self.reconnect(timeout=interval)
        except SidecarError as exc:
            log.info("daemon not back yet: %s", exc)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the heartbeat, close the fd channel and the socket. Idempotent.

        Closing the fd channel makes the daemon release the workers registered through it.
        """
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        self._close_fd_channel()
        self._sock.close(linger=0)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSidecarClient(_Base):
    """asyncio client: ``async with AsyncSidecarClient(endpoint) as c:`` (or ``await c.start()``).

    Calls may run concurrently on one client; replies are matched to calls by request id.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = 10.0,
        name: str = "",
        heartbeat: bool = True,
        context: zmq.asyncio.Context | None = None,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_s, name, curve)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, asyncio.Future[tuple[Reply, list[memoryview]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._hb_task: asyncio.Task[None] | None = None
        self._heartbeat_enabled = heartbeat
        self._reconnect_lock = asyncio.Lock()
        self._watched_fd: int | None = None

    async def start(self) -> HelloReply:
        """Connect and say hello; returns the daemon's hello reply."""
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._secure(self._sock)
            self._sock.connect(self.endpoint)
            self._reader = asyncio.create_task(self._read_loop())
        self.daemon = await self.hello()
        return self.daemon

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                reply, data = self._codec.decode(frames)
            except SidecarError as exc:
                log.warning("dropping reply: %s", exc)
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result((reply, data))

    async def _call(
        self,
        req: Request,
        expected: type[R],
        data: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[R, list[memoryview]]:
        if self._sock is None:
            raise SidecarError("internal", "call start() (or use async with) first")
        if (self._lost or self._daemon_gone()) and not self._reconnect_lock.locked():
            self._lost = True
            await self.reconnect()
        fut: asyncio.Future[tuple[Reply, list[memoryview]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[req.id] = fut
        try:
            await self._sock.send_multipart([self._codec.encoder.encode(req), *data], copy=False)
            reply, frames = await asyncio.wait_for(
                fut, self.timeout_s if timeout is None else timeout
            )
        except asyncio.TimeoutError:
            raise SidecarError(
                "timeout", f"no reply to {type(req).__name__} within the timeout", request_id=req.id
            ) from None
        finally:
            self._pending.pop(req.id, None)
        return _check(reply, expected), frames

    async def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return (await self._call(self._hello(), HelloReply, timeout=timeout))[0]

    async def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        engine_id: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        model_hash: str = "",
        arrangement: Arrangement = "kv_first",
        memory_order: MemoryOrder | None = None,
        shape_order: layout.ShapeOrder = "NH",
        host_blocks: int = 0,
        timeout: float | None = None,
    ) -> Registered:
        """Register this worker's KV tensors; see `SidecarClient.register_kv_caches`."""
        req = self._prepare_register(
            kv_caches,
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            model_hash=model_hash,
            arrangement=arrangement,
            memory_order=memory_order,
            shape_order=shape_order,
            host_blocks=host_blocks,
        )
        reply = (await self._call(req, Registered, timeout=timeout))[0]
        self.workers.append(reply.worker)
        self.epochs[reply.worker] = reply.epoch
        self._remember(
            kv_caches,
            {
                "engine_id": engine_id,
                "tp_rank": tp_rank,
                "tp_size": tp_size,
                "pp_rank": pp_rank,
                "pp_size": pp_size,
                "dcp_rank": dcp_rank,
                "dcp_size": dcp_size,
                "model_hash": model_hash,
                "arrangement": arrangement,
                "memory_order": memory_order,
                "shape_order": shape_order,
                "host_blocks": host_blocks,
            },
        )
        self._watch_fd_channel()
        if self._heartbeat_enabled and self._hb_task is None:
            self._hb_task = asyncio.create_task(self._heartbeat_loop(reply.lease_s / 3))
        return reply

    async def grant(
        self,
        grantee: str,
        *,
        read: bool = True,
        write: bool = False,
        owner: WorkerRef | None = None,
        timeout: float | None = None,
    ) -> None:
        """Let engine ``grantee`` use this engine's blocks; see `SidecarClient.grant`."""
        await self._call(self._grant(grantee, owner, read, write), Ok, timeout=timeout)

    async def _heartbeat_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except SidecarError as exc:
                log.warning("heartbeat refused: %s", exc)
                if exc.code in ("unknown_worker", "unknown_engine", "connection_lost"):
                    self._lost = True
            if self._lost and not self._reconnect_lock.locked():
                with contextlib.suppress(SidecarError):
                    await self.reconnect(timeout=interval)

    # -- reliability: notice the daemon's death, reconnect after its restart

    def _watch_fd_channel(self) -> None:
        """Fail in-flight calls at once when the daemon closes the fd channel (it died)."""
        if self._fd_channel is None or self._watched_fd == self._fd_channel.fileno():
            return
        self._unwatch_fd_channel()
        fd = self._fd_channel.fileno()
        asyncio.get_running_loop().add_reader(fd, self._on_fd_channel_readable)
        self._watched_fd = fd

    def _unwatch_fd_channel(self) -> None:
        if self._watched_fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._watched_fd)
            self._watched_fd = None

    def _on_fd_channel_readable(self) -> None:
        if not self._daemon_gone():
            return
        self._unwatch_fd_channel()
        self._lost = True
        for rid, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(
                    SidecarError(
                        "connection_lost",
                        f"the daemon went away while request {rid} was in flight: its outcome "
                        "is unknown (treat a move's destination blocks as invalid)",
                        request_id=rid,
                    )
                )

    async def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register; see `SidecarClient.reconnect`."""
        async with self._reconnect_lock:
            if not self._lost and not self._daemon_gone() and self.daemon is not None:
                return  # another task reconnected while this one waited
            deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
            delay = 0.05
            self._unwatch_fd_channel()
            self._close_fd_channel()
            self._lost = False
            while True:
                await self._reset_socket()
                left = deadline - time.monotonic()
                try:
                    self.daemon = await self.hello(timeout=max(0.05, min(1.0, left)))
                    break
                except SidecarError as exc:
                    if time.monotonic() + delay >= deadline:
                        self._lost = True
                        raise SidecarError(
                            "connection_lost", f"the daemon did not come back: {exc}"
                        ) from None
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)
            self._unwatch_fd_channel()
            self._close_fd_channel()
            self.workers.clear()
            self.epochs.clear()
            try:
                for kv_caches, kwargs in self._registrations:
                    req = self._prepare_register(kv_caches, **kwargs)
                    reply = (await self._call(req, Registered))[0]
                    self.workers.append(reply.worker)
                    self.epochs[reply.worker] = reply.epoch
            except SidecarError:
                self._lost = True
                raise
            self._watch_fd_channel()
            self.reconnects += 1
            log.info(
                "reconnected to %s; re-registered %d workers", self.endpoint, len(self.workers)
            )

    async def _reset_socket(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._secure(self._sock)
        self._sock.connect(self.endpoint)
        self._reader = asyncio.create_task(self._read_loop())

    async def unregister(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        ref = worker or self.worker
        req = Unregister(id=self._codec.next_id(), worker=ref, epoch=self.epochs.get(ref, 0))
        await self._call(req, Ok, timeout=timeout)
        if ref in self.workers:
            self.workers.remove(ref)
        self._registrations = [r for r in self._registrations if _reg_ref(r) != ref]

    async def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now."""
        refs = list(self.workers if workers is None else workers)
        await self._call(self._heartbeat_request(refs), Ok, timeout=timeout)

    async def host_alloc(
        self, engine_id: str, count: int, *, timeout: float | None = None
    ) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        req = HostAlloc(id=self._codec.next_id(), engine_id=engine_id, count=count)
        reply, data = await self._call(req, HostAllocated, timeout=timeout)
        return self._alloc_ids(reply, data)

    async def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine."""
        arr = _as_id_array(ids)
        req = HostFree(id=self._codec.next_id(), engine_id=engine_id, ids_dtype=_dtype_of(arr))
        await self._call(req, Ok, (arr,), timeout=timeout)

    async def move(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        src_ids: Ids,
        dst_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks between buffer sets; see `SidecarClient.move`."""
        req, data = self._move(src, dst, src_ids, dst_ids, layers, request_ids=request_ids)
        return (await self._call(req, Moved, data, timeout=timeout))[0]

    async def offload(
        self,
        worker: WorkerRef,
        device_ids: Ids,
        host_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy a worker's blocks into its host mirror."""
        return await self.move(
            BufferSetRef(worker, "device"),
            BufferSetRef(worker, "host"),
            device_ids,
            host_ids,
            layers=layers,
            request_ids=request_ids,
            timeout=timeout,
        )

    async def onboard(
        self,
        worker: WorkerRef,
        host_ids: Ids,
        device_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks from a worker's host mirror into its KV cache."""
        return await self.move(
            BufferSetRef(worker, "host"),
            BufferSetRef(worker, "device"),
            host_ids,
            device_ids,
            layers=layers,
            request_ids=request_ids,
            timeout=timeout,
        )

    async def fix_layout(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        *,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Fixed:
        """Rewrite blocks in place from the remote layout; see `SidecarClient.fix_layout`."""
        if isinstance(target, WorkerRef):
            target = BufferSetRef(target)
        req, data = self._fix(target, block_ids, remote_memory_order, remote_block_size, layers)
        return (await self._call(req, Fixed, data, timeout=timeout))[0]

    # --- peer (node-to-node transfer) ---

    async def pull(
        self,
        engine_id: str,
        remote_endpoint: str,
        remote_engine_id: str,
        requests: Mapping[str, tuple[Ids, Ids]],
        *,
        tp_rank: int | None = None,
        pp_rank: int = 0,
        medium: Medium = "device",
        timeout_s: float = 0.0,
        remote_request_ids: Mapping[str, str] | None = None,
        plane: Literal["", "zmq", "nixl"] = "",
        timeout: float | None = None,
    ) -> Pulled:
        """Pull requests' blocks from another node's daemon; see `SidecarClient.pull`."""
        req, frames = self._pull(
            engine_id,
            remote_endpoint,
            remote_engine_id,
            requests,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            medium=medium,
            timeout_s=timeout_s,
            remote_request_ids=remote_request_ids,
            plane=plane,
        )
        timeout = self._pull_timeout(timeout, timeout_s)
        return (await self._call(req, Pulled, frames, timeout=timeout))[0]

    async def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Ids,
        *,
        lease_s: float = 0.0,
        timeout: float | None = None,
    ) -> None:
        """Hold a request's blocks for remote readers; see `SidecarClient.publish`."""
        req = self._publish(engine_id, request_id, block_ids, lease_s)
        await self._call(req, Ok, (_as_id_array(block_ids),), timeout=timeout)

    async def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events; see `SidecarClient.take_peer_events`."""
        req = TakePeerEvents(id=self._codec.next_id(), engine_id=engine_id)
        return (await self._call(req, PeerEvents, timeout=timeout))[0].events

    # --- end peer ---

    # --- completion aggregation ---

    async def report(
        self,
        step: int,
        *,
        finished_sending: Collection[str] = (),
        finished_recving: Collection[str] = (),
        invalid_block_ids: Collection[int] = (),
        failed_recving: Collection[str] = (),
        expected_finished_count: int = 0,
        kv_connector_stats: TransferStats | None = None,
        kv_cache_events: CacheEvents | None = None,
        worker: WorkerRef | None = None,
        epoch: int | None = None,
        timeout: float | None = None,
    ) -> Reported:
        """Report a worker's completions of one step; see `SidecarClient.report`."""
        req = self._report(
            step,
            worker=worker,
            epoch=epoch,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids,
            failed_recving=failed_recving,
            expected_finished_count=expected_finished_count,
            kv_connector_stats=kv_connector_stats,
            kv_cache_events=kv_cache_events,
        )
        return (await self._call(req, Reported, timeout=timeout))[0]

    async def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions; see `SidecarClient.collect`."""
        req, wait = self._collect(engine_id, step, timeout_s)
        return (await self._call(req, Collected, timeout=wait if timeout is None else timeout))[0]

    # --- end completion aggregation ---

    async def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's state; see `SidecarClient.status`."""
        return (await self._call(Status(id=self._codec.next_id()), StatusReply, timeout=timeout))[0]

    async def close(self) -> None:
        """Stop heartbeats and the reader, close the fd channel and the socket. Idempotent."""
        for task in (self._hb_task, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._hb_task = self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        self._unwatch_fd_channel()
        self._close_fd_channel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> AsyncSidecarClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
