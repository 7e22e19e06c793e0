"""The asyncio client, `AsyncSidecarClient`: concurrent calls matched to replies by request id.

Requests are built by `kvsidecar.client.requests._Requests`; this module only carries them
(``_call`` and a reader callback on the socket), watches the fd channel, reconnects after a daemon
restart, and runs the heartbeat task. Import it from `kvsidecar.client`.

The socket is a plain pyzmq socket read from an event-loop reader callback, like the daemon's,
not a ``zmq.asyncio`` socket read by a task: the task's wake-up and the ``zmq.asyncio``
futures cost about 60 µs of a 300 µs round trip on the 2-core test machine (measured side by
side against the daemon's status command; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import torch
import zmq
import zmq.asyncio

from kvsidecar.client.codec import Ids, R, T, _check
from kvsidecar.client.common import _Registration
from kvsidecar.client.requests import _Call, _Requests
from kvsidecar.core import layout
from kvsidecar.wire import zmqio
from kvsidecar.wire.curve import KeyPair
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import (
    Collected,
    Fixed,
    HelloReply,
    Moved,
    Pulled,
    Registered,
    Reply,
    Reported,
    Request,
    StatusReply,
)
from kvsidecar.wire.reports import CacheEvents, PeerCompletion, TransferStats
from kvsidecar.wire.types import Arrangement, BufferSetRef, Medium, MemoryOrder, WorkerRef

__all__ = ["AsyncSidecarClient"]

log = logging.getLogger("kvsidecar.client")


_BURST = 64
"""Replies read per reader callback before yielding to the loop."""


class _Expired(Exception):
    """A call's timer ran out (turned into the ``timeout`` error)."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class AsyncSidecarClient(_Requests):
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
        self._sock: zmq.Socket[Any] | None = None
        self._pending: dict[int, asyncio.Future[tuple[Reply, list[memoryview]]]] = {}
        self._sock_fd: int | None = None
        """The socket's ZMQ_FD while the loop watches it (`_on_readable`)."""
        self._hb_task: asyncio.Task[None] | None = None
        self._heartbeat_enabled = heartbeat
        self._reconnect_lock = asyncio.Lock()
        self._watched_fd: int | None = None

    async def start(self) -> HelloReply:
        """Connect and say hello; returns the daemon's hello reply."""
        if self._sock is None:
            self._open_socket()
        self.daemon = await self.hello()
        return self.daemon

    def _open_socket(self) -> None:
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._secure(sock)
        sock.connect(self.endpoint)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._sock_fd = int(sock.getsockopt(zmq.FD))
        loop.add_reader(self._sock_fd, self._on_readable)
        loop.call_soon(self._on_readable)  # anything that came before the reader existed

    def _close_socket(self) -> None:
        if self._sock_fd is not None:
            with contextlib.suppress(Exception):  # the loop may be closing
                asyncio.get_running_loop().remove_reader(self._sock_fd)
            self._sock_fd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _on_readable(self) -> None:
        # ZMQ_FD is edge-triggered: read until ZMQ_EVENTS says nothing is left (which re-arms
        # it), in slices so that a flood of replies does not hold the loop.
        for _ in range(_BURST):
            sock = self._sock
            frames = None if sock is None else zmqio.try_recv(sock)
            if frames is None:
                return
            try:
                reply, data = self._codec.decode(frames)
            except SidecarError as exc:
                log.warning("dropping reply: %s", exc)
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result((reply, data))
        asyncio.get_running_loop().call_soon(self._on_readable)

    async def _send(self, frames: list[Any], deadline: float) -> None:
        """Queue one request's frames; waits (until ``deadline``) only while the queue is full."""
        delay = 0.0005
        while True:
            sock = self._sock
            if sock is None:
                raise SidecarError("connection_lost", "the client was closed")
            try:
                zmqio.send_frames(sock, frames)
                break
            except zmq.Again:  # high-water mark reached: the daemon is not reading
                if time.monotonic() + delay >= deadline:
                    raise _Expired from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.05)
        # The send may have taken the fd's edge: a reply waiting now would go unnoticed.
        if zmqio.readable(sock):
            asyncio.get_running_loop().call_soon(self._on_readable)

    async def _call(
        self,
        req: Request,
        expected: type[R],
        data: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[R, list[memoryview]]:
        if self._sock is None:
            raise SidecarError("internal", "call start() (or use async with) first")
        # A watched fd channel sets ``_lost`` itself; an unwatched one is asked (a syscall).
        gone = self._lost or (self._watched_fd is None and self._daemon_gone())
        if gone and not self._reconnect_lock.locked():
            self._lost = True
            await self.reconnect()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Reply, list[memoryview]]] = loop.create_future()
        self._pending[req.id] = fut
        # A timer on the future itself rather than `asyncio.wait_for`, which adds a waiter
        # future and a loop iteration to every call.
        wait = self.timeout_s if timeout is None else timeout
        timer = loop.call_later(wait, _expire, fut)
        try:
            await self._send([self._codec.encoder.encode(req), *data], time.monotonic() + wait)
            reply, frames = await fut
        except _Expired:
            raise SidecarError(
                "timeout", f"no reply to {type(req).__name__} within the timeout", request_id=req.id
            ) from None
        finally:
            timer.cancel()
            self._pending.pop(req.id, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # seen: a timeout that fired while the send waited is not news
        return _check(reply, expected), frames

    async def _run(self, call: _Call[R, T]) -> T:
        reply, frames = await self._call(call.req, call.expected, call.data, call.timeout)
        return call.finish(reply, frames)

    async def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return await self._run(self._hello(timeout))

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
        reply = await self._run(self._register(reg, timeout))
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
        await self._run(self._grant(grantee, owner, read, write, timeout))

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
                fut.set_exception(self._lost_error("request", rid))

    async def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register; see `SidecarClient.reconnect`."""
        async with self._reconnect_lock:
            if not self._lost and not self._daemon_gone() and self.daemon is not None:
                return  # another task reconnected while this one waited
            self._unwatch_fd_channel()
            backoff = self._start_reconnect(timeout)
            while True:
                await self._reset_socket()
                try:
                    self.daemon = await self.hello(timeout=backoff.hello_timeout())
                    break
                except SidecarError as exc:
                    await asyncio.sleep(self._retry_pause(backoff, exc))
            self._unwatch_fd_channel()
            self._forget_workers()
            try:
                for reg in self._registrations:
                    await self._run(self._register(reg, remember=False))
            except SidecarError:
                self._lost = True
                raise
            self._watch_fd_channel()
            self._reconnected()

    async def _reset_socket(self) -> None:
        self._close_socket()
        self._open_socket()

    async def unregister(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        await self._run(self._unregister(worker, timeout))

    async def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now."""
        await self._run(self._heartbeat(workers, timeout))

    async def host_alloc(
        self, engine_id: str, count: int, *, timeout: float | None = None
    ) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        return await self._run(self._host_alloc(engine_id, count, timeout))

    async def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine."""
        await self._run(self._host_free(engine_id, ids, timeout))

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
        call = self._move(
            src, dst, src_ids, dst_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

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
        src, dst = BufferSetRef(worker, "device"), BufferSetRef(worker, "host")
        call = self._move(
            src, dst, device_ids, host_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

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
        src, dst = BufferSetRef(worker, "host"), BufferSetRef(worker, "device")
        call = self._move(
            src, dst, host_ids, device_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

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
        call = self._fix(
            target, block_ids, remote_memory_order, remote_block_size, layers, timeout=timeout
        )
        return await self._run(call)

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
        return await self._run(call)

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
        await self._run(self._publish(engine_id, request_id, block_ids, lease_s, timeout))

    async def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events; see `SidecarClient.take_peer_events`."""
        return await self._run(self._take_peer_events(engine_id, timeout))

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
        return await self._run(call)

    async def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions; see `SidecarClient.collect`."""
        return await self._run(self._collect(engine_id, step, timeout_s, timeout))

    # --- end completion aggregation ---

    async def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's state; see `SidecarClient.status`."""
        return await self._run(self._status(timeout))

    async def close(self) -> None:
        """Stop heartbeats and the reader, close the fd channel and the socket. Idempotent."""
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._hb_task
        self._hb_task = None
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        self._unwatch_fd_channel()
        self._close_fd_channel()
        self._close_socket()

    async def __aenter__(self) -> AsyncSidecarClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
