"""How `AsyncSidecarClient` carries its calls, and keeps its daemon.

`_AsyncTransport` is held by the client beside its request builders, and works on the same
`_Session`. One DEALER socket read from an event-loop reader callback, calls in flight matched
to replies by request id, the fd channel watched for the daemon's death, reconnection after its
restart, and the heartbeat task.

The socket is a plain pyzmq socket read from an event-loop reader callback, like the daemon's,
not a ``zmq.asyncio`` socket read by a task: a task's wake-up and the ``zmq.asyncio`` futures
are a large share of a round trip (docs/benchmarks.md, "bench latency").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvsidecar.client.calls import _Call
from kvsidecar.client.codec import R, T, _check
from kvsidecar.client.common import _Session
from kvsidecar.client.requests import _Requests
from kvsidecar.wire import zmqio
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import HelloReply, Reply, Request

log = logging.getLogger("kvsidecar.client")


_BURST = 64
"""Replies read per reader callback before yielding to the loop."""


class _Expired(Exception):
    """A call's timer ran out (turned into the ``timeout`` error)."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class _AsyncTransport:
    """The asyncio transport of an `AsyncSidecarClient`: calls may run concurrently.

    ``requests`` builds what the transport sends by itself: hellos, the registrations replayed
    on a restarted daemon, and heartbeats.
    """

    def __init__(
        self,
        session: _Session,
        requests: _Requests,
        *,
        heartbeat: bool,
        context: zmq.asyncio.Context | None,
    ) -> None:
        self._session = session
        self._requests = requests
        # Bound once: every call encodes its request and decodes its reply.
        self._encode = session.codec.encoder.encode
        self._decode = session.codec.decode
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
        daemon = await self.run(self._requests.hello(None))
        self._session.daemon = daemon
        return daemon

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
        self._session.close_fd_channel()
        self._close_socket()

    def _open_socket(self) -> None:
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._session.secure(sock)
        sock.connect(self._session.endpoint)
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
                reply, data = self._decode(frames)
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

    async def call(
        self,
        req: Request,
        expected: type[R],
        data: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[R, list[memoryview]]:
        """Send ``req`` and await its reply, checked against ``expected``, and its frames.

        A daemon known to be away is reconnected first (unless a reconnection is under way).
        """
        if self._sock is None:
            raise SidecarError("internal", "call start() (or use async with) first")
        session = self._session
        # A watched fd channel sets ``lost`` itself; an unwatched one is asked (a syscall).
        gone = session.lost or (self._watched_fd is None and session.daemon_gone())
        if gone and not self._reconnect_lock.locked():
            session.lost = True
            await self.reconnect()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Reply, list[memoryview]]] = loop.create_future()
        self._pending[req.id] = fut
        # A timer on the future itself rather than `asyncio.wait_for`, which adds a waiter
        # future and a loop iteration to every call.
        wait = session.timeout_s if timeout is None else timeout
        timer = loop.call_later(wait, _expire, fut)
        try:
            await self._send([self._encode(req), *data], time.monotonic() + wait)
            reply, frames = await fut
        except _Expired:
            raise session.timeout_error(req) from None
        finally:
            timer.cancel()
            self._pending.pop(req.id, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # seen: a timeout that fired while the send waited is not news
        return _check(reply, expected), frames

    async def run(self, call: _Call[R, T]) -> T:
        """Carry ``call`` and return its result (what its ``finish`` makes of the reply)."""
        reply, frames = await self.call(call.req, call.expected, call.data, call.timeout)
        return call.finish(reply, frames)

    def keep_alive(self, lease_s: float) -> None:
        """After a registration: watch its fd channel, and renew its lease from a task."""
        self._watch_fd_channel()
        if self._heartbeat_enabled and self._hb_task is None:
            self._hb_task = asyncio.create_task(self._heartbeat_loop(lease_s / 3))

    async def _heartbeat_loop(self, interval: float) -> None:
        session = self._session
        while True:
            await asyncio.sleep(interval)
            try:
                await self.run(self._requests.heartbeat(None, None))
            except SidecarError as exc:
                log.warning("heartbeat refused: %s", exc)
                if exc.code in ("unknown_worker", "unknown_engine", "connection_lost"):
                    session.lost = True
            if session.lost and not self._reconnect_lock.locked():
                with contextlib.suppress(SidecarError):
                    await self.reconnect(timeout=interval)

    def _watch_fd_channel(self) -> None:
        """Fail in-flight calls at once when the daemon closes the fd channel (it died)."""
        channel = self._session.fd_channel
        if channel is None or self._watched_fd == channel.fileno():
            return
        self._unwatch_fd_channel()
        fd = channel.fileno()
        asyncio.get_running_loop().add_reader(fd, self._on_fd_channel_readable)
        self._watched_fd = fd

    def _unwatch_fd_channel(self) -> None:
        if self._watched_fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._watched_fd)
            self._watched_fd = None

    def _on_fd_channel_readable(self) -> None:
        session = self._session
        if not session.daemon_gone():
            return
        self._unwatch_fd_channel()
        session.lost = True
        for rid, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(session.lost_error("request", rid))

    async def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register; see `SidecarClient.reconnect`."""
        session, requests = self._session, self._requests
        async with self._reconnect_lock:
            if not session.lost and not session.daemon_gone() and session.daemon is not None:
                return  # another task reconnected while this one waited
            self._unwatch_fd_channel()
            backoff = session.start_reconnect(timeout)
            while True:
                await self._reset_socket()
                try:
                    session.daemon = await self.run(requests.hello(backoff.hello_timeout()))
                    break
                except SidecarError as exc:
                    await asyncio.sleep(session.retry_pause(backoff, exc))
            self._unwatch_fd_channel()
            session.forget_workers()
            try:
                for reg in session.registrations:
                    await self.run(requests.register(reg, remember=False))
            except SidecarError:
                session.lost = True
                raise
            self._watch_fd_channel()
            session.reconnected()

    async def _reset_socket(self) -> None:
        self._close_socket()
        self._open_socket()
