"""The blocking client, `SidecarClient`: one socket, calls in turn, a heartbeat thread.

Requests are built by `kvsidecar.client.requests._Requests`; this module only carries them
(``_call``), reconnects after a daemon restart, and runs the heartbeat. Import it from
`kvsidecar.client`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import torch
import zmq

from kvsidecar.client.codec import Ids, R, T, _check
from kvsidecar.client.common import _Registration
from kvsidecar.client.requests import _Call, _Requests
from kvsidecar.core import layout
from kvsidecar.wire.curve import KeyPair
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import (
    Collected,
    Error,
    Fixed,
    HelloReply,
    Moved,
    Pulled,
    Registered,
    Reported,
    Request,
    StatusReply,
)
from kvsidecar.wire.reports import CacheEvents, PeerCompletion, TransferStats
from kvsidecar.wire.types import Arrangement, BufferSetRef, Medium, MemoryOrder, WorkerRef

__all__ = ["SidecarClient"]

log = logging.getLogger("kvsidecar.client")


class SidecarClient(_Requests):
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
                        raise self._lost_error(type(req).__name__, req.id)
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

    def _run(self, call: _Call[R, T]) -> T:
        reply, frames = self._call(call.req, call.expected, call.data, call.timeout)
        return call.finish(reply, frames)

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
            backoff = self._start_reconnect(timeout)
            while True:
                # A fresh socket: nothing queued for the dead daemon is sent to the new one.
                self._sock.close(linger=0)
                self._sock = self._new_socket()
                try:
                    self.daemon = self.hello(timeout=backoff.hello_timeout())
                    break
                except SidecarError as exc:
                    time.sleep(self._retry_pause(backoff, exc))
            self._forget_workers()
            try:
                for reg in self._registrations:
                    self._run(self._register(reg, remember=False))
            except SidecarError:
                self._lost = True  # try again on the next call
                raise
            self._reconnected()

    # -- commands

    def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return self._run(self._hello(timeout))

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
        reg = _Registration(
            dict(kv_caches),
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
        reply = self._run(self._register(reg, timeout))
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
        self._run(self._grant(grantee, owner, read, write, timeout))

    def unregister(self, worker: WorkerRef | None = None, *, timeout: float | None = None) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        self._run(self._unregister(worker, timeout))

    def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now (the background heartbeat does this on its own)."""
        self._run(self._heartbeat(workers, timeout))

    def host_alloc(self, engine_id: str, count: int, *, timeout: float | None = None) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        return self._run(self._host_alloc(engine_id, count, timeout))

    def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine (all checked first: nothing freed on error)."""
        self._run(self._host_free(engine_id, ids, timeout))

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
        call = self._move(
            src, dst, src_ids, dst_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

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
        src, dst = BufferSetRef(worker, "device"), BufferSetRef(worker, "host")
        call = self._move(
            src, dst, device_ids, host_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

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
        src, dst = BufferSetRef(worker, "host"), BufferSetRef(worker, "device")
        call = self._move(
            src, dst, host_ids, device_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

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
        call = self._fix(
            target, block_ids, remote_memory_order, remote_block_size, layers, timeout=timeout
        )
        return self._run(call)

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
        call = self._pull(
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
            timeout=timeout,
        )
        return self._run(call)

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
        self._run(self._publish(engine_id, request_id, block_ids, lease_s, timeout))

    def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events (finished/failed sending and receiving)."""
        return self._run(self._take_peer_events(engine_id, timeout))

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
        call = self._report(
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
            timeout=timeout,
        )
        return self._run(call)

    def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions up to ``step`` (the scheduler's call).

        Waits up to ``timeout_s`` for every live worker's report of the step (see `Collect`);
        ``.output`` is the `AggregatedOutput`. Collecting the same step again returns the same
        answer, so a retry loses nothing.
        """
        return self._run(self._collect(engine_id, step, timeout_s, timeout))

    # --- end completion aggregation ---

    def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's engines, workers, buffers, host pool, in-flight moves and totals."""
        return self._run(self._status(timeout))

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
