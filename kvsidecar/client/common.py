"""What a client knows about its daemon, and how it gets it back after a restart.

The daemon's hello, the workers registered here and their epochs, the fd channel, and what a
reconnection needs: the registrations to replay, the loss flag, the backoff. A client's request
builders (`kvsidecar.client.requests`) and its transport (`kvsidecar.client.sync_transport`,
`kvsidecar.client.aio_transport`) share one `_Session`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kvsidecar.client.codec import _Codec
from kvsidecar.core import layout
from kvsidecar.memory.cuda_ipc import device_uuid
from kvsidecar.memory.cuda_sync import MoveSync, Sync, SyncBeforeSend
from kvsidecar.memory.fd_client import FdChannelClient
from kvsidecar.wire.curve import KeyPair, client_keys_from_env, secure_client_socket
from kvsidecar.wire.endpoints import default_endpoint
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import HelloReply, Registered, Request
from kvsidecar.wire.types import Arrangement, BufferSetRef, MemoryOrder, MoveEvents, WorkerRef

log = logging.getLogger("kvsidecar.client")


@dataclass(frozen=True, slots=True)
class _Registration:
    """A worker's ``register_kv_caches`` arguments, kept to replay it on a restarted daemon."""

    kv_caches: dict[str, torch.Tensor]
    engine_id: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dcp_rank: int
    dcp_size: int
    model_hash: str
    arrangement: Arrangement
    memory_order: MemoryOrder | None
    shape_order: layout.ShapeOrder
    host_blocks: int

    @property
    def worker(self) -> WorkerRef:
        """The worker this registration names."""
        return WorkerRef(self.engine_id, self.tp_rank, self.pp_rank, self.dcp_rank)


class _Backoff:
    """When a reconnection tries again: 50 ms doubling to 2 s, until its deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.delay = 0.05

    def hello_timeout(self) -> float:
        """How long the next hello may wait: what is left, within [50 ms, 1 s]."""
        return max(0.05, min(1.0, self.deadline - time.monotonic()))

    def pause(self, exc: SidecarError) -> float:
        """Return the pause before the next try after ``exc``; raise when the deadline is nearer."""
        if time.monotonic() + self.delay >= self.deadline:
            raise SidecarError("connection_lost", f"the daemon did not come back: {exc}") from None
        delay, self.delay = self.delay, min(2 * self.delay, 2.0)
        return delay


class _Session:
    """What a client knows about its daemon: the hello, its workers, the fd channel, the loss.

    One per client, shared by its request builders (which read epochs and GPUs, and record
    registrations) and its transport (which watches the fd channel, and replays the
    registrations on a restarted daemon). Its containers are changed in place, never replaced:
    the builders hold them directly.
    """

    def __init__(
        self,
        endpoint: str | None,
        timeout_s: float,
        name: str,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.curve = curve or client_keys_from_env(self.endpoint)
        """(daemon's public key, our key pair) for a CURVE tcp endpoint; None: plain."""
        self.timeout_s = timeout_s
        self.name = name
        self.codec = _Codec()
        self.daemon: HelloReply | None = None
        """The daemon's hello reply (versions, fd socket, lease, limits)."""
        self.workers: list[WorkerRef] = []
        """Workers registered through this client (kept alive by its heartbeats)."""
        self.epochs: dict[WorkerRef, int] = {}
        """Registration epoch of each worker registered here (`Registered.epoch`)."""
        self.fd_channel: FdChannelClient | None = None
        self.registrations: list[_Registration] = []
        """Every successful registration's tensors and arguments, replayed on reconnection."""
        self.lost = False
        """Set when the daemon went away (fd channel EOF); the next call reconnects first."""
        self.reconnects = 0
        """Completed reconnections (daemon restarts survived)."""
        self.cuda_syncs: dict[WorkerRef, Sync] = {}
        """Per worker registered here with CUDA tensors: its GPU's `Sync`."""
        self.device_syncs: dict[tuple[torch.device, bool], Sync] = {}
        """One `Sync` per GPU (and kind), made once: its events live as long as the client."""

    @property
    def available(self) -> bool:
        """Whether the daemon is reachable as far as this client knows (see the clients')."""
        if not self.lost and self.daemon_gone():
            self.lost = True
        return not self.lost

    @property
    def worker(self) -> WorkerRef:
        """The (first) worker this client registered."""
        if not self.workers:
            raise SidecarError("unknown_worker", "this client has not registered a worker")
        return self.workers[0]

    def stamp(self, ref: BufferSetRef) -> BufferSetRef:
        """Add the epoch of a worker registered here, so a later registration fences the call."""
        epoch = self.epochs.get(ref.worker, 0)
        if ref.epoch or not epoch:
            return ref
        return BufferSetRef(ref.worker, ref.medium, epoch)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of the daemon when the endpoint needs it."""
        if self.curve is not None:
            server_public, keys = self.curve
            secure_client_socket(sock, server_public=server_public, keys=keys)

    def daemon_gone(self) -> bool:
        """Whether the daemon closed our fd channel (it exited, or restarted)."""
        return self.fd_channel is not None and self.fd_channel.peer_closed()

    @staticmethod
    def lost_error(what: str, request_id: int) -> SidecarError:
        """Make the error of a call in flight when the daemon went away (``what``: the request)."""
        return SidecarError(
            "connection_lost",
            f"the daemon went away while {what} {request_id} was in flight: its "
            "outcome is unknown (treat a move's destination blocks as invalid)",
            request_id=request_id,
        )

    @staticmethod
    def timeout_error(req: Request) -> SidecarError:
        """Make the error of a call whose reply did not come within its timeout."""
        return SidecarError(
            "timeout", f"no reply to {type(req).__name__} within the timeout", request_id=req.id
        )

    def registered(self, reply: Registered) -> Registered:
        """Track a worker the daemon accepted (a registration, or its replay on reconnect)."""
        self.workers.append(reply.worker)
        self.epochs[reply.worker] = reply.epoch
        return reply

    def forget(self, ref: WorkerRef) -> None:
        """After an unregistration: the worker is no longer this client's, nor replayed."""
        self.cuda_syncs.pop(ref, None)
        if ref in self.workers:
            self.workers.remove(ref)
        self.registrations[:] = [r for r in self.registrations if r.worker != ref]

    def forget_workers(self) -> None:
        """Before replaying the registrations on a restarted daemon: it knows none of them."""
        self.close_fd_channel()
        self.workers.clear()
        self.epochs.clear()
        self.cuda_syncs.clear()

    def track_gpu(self, reg: _Registration, worker: WorkerRef) -> None:
        """Remember the GPU of a worker registered with CUDA tensors (see `gpu_sync`)."""
        device = next((t.device for t in reg.kv_caches.values() if t.is_cuda), None)
        if device is None:
            self.cuda_syncs.pop(worker, None)
            return
        events = self.daemon is not None and "cuda_events" in self.daemon.capabilities
        key = (device, events)
        sync = self.device_syncs.get(key)
        if sync is None:
            sync = MoveSync(device, device_uuid(device.index or 0)) if events else None
            sync = sync or SyncBeforeSend(device)
            self.device_syncs[key] = sync
        self.cuda_syncs[worker] = sync

    def gpu_sync(self, src: BufferSetRef, dst: BufferSetRef) -> Sync | None:
        """Return the `Sync` of a move touching GPU memory registered here (None: it does not).

        A move between two of this client's GPUs sends the events of the first; the other
        GPU's stream is synchronised before sending.
        """
        found = [
            sync
            for ref in (src, dst)
            if ref.medium == "device" and (sync := self.cuda_syncs.get(ref.worker)) is not None
        ]
        if len(found) == 2 and found[0] is not found[1]:
            SyncBeforeSend(found[1].device).before()
        return found[0] if found else None

    def ready(self, ref: BufferSetRef) -> MoveEvents | None:
        """Order a copy of ``ref``'s GPU memory after what the caller's stream enqueued so far.

        Records the ready event on the caller's current stream (a daemon without
        ``cuda_events``: synchronises that stream) and returns the events to send; None for
        memory that is not this client's GPU memory. The copy's reply comes once it finished on
        the GPU, so a caller that waits for it may read the blocks.
        """
        sync = self.cuda_syncs.get(ref.worker) if ref.medium == "device" else None
        return None if sync is None else sync.before()

    def start_reconnect(self, timeout: float | None) -> _Backoff:
        """Begin a reconnection: drop the dead daemon's fd channel and start the clock.

        The hellos that follow must not recurse into a reconnection: the fd channel goes now (a
        re-registration opens a new one), and the loss is cleared while trying.
        """
        self.close_fd_channel()
        self.lost = False
        return _Backoff(self.timeout_s if timeout is None else timeout)

    def retry_pause(self, backoff: _Backoff, exc: SidecarError) -> float:
        """Return the pause before the next hello; give up (``connection_lost``) at the deadline."""
        try:
            return backoff.pause(exc)
        except SidecarError:
            self.lost = True  # the next call tries again
            raise

    def reconnected(self) -> None:
        """Count a reconnection that re-registered every worker."""
        self.reconnects += 1
        log.info("reconnected to %s; re-registered %d workers", self.endpoint, len(self.workers))

    def close_fd_channel(self) -> None:
        """Close the fd channel (the daemon then releases the workers registered through it)."""
        if self.fd_channel is not None:
            self.fd_channel.close()
            self.fd_channel = None
