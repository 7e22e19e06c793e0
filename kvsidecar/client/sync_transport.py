"""How `SidecarClient` carries its calls, and keeps its daemon.

`_BlockingTransport` is held by the client beside its request builders, and works on the same
`_Session`. One DEALER socket, one call at a time: send, then poll the socket and the fd channel
until the reply with the call's id comes (late replies to calls that timed out are dropped), the
daemon's death shows, or the timeout passes. Reconnection after a daemon restart, and the
heartbeat thread (its own socket).

A call may also be *submitted* (`Pending`): sent at once, its reply collected later by polling,
so that an engine worker starts a copy and carries on with its forward pass. Replies are routed
by id to whichever call (waited for or submitted) they answer; a submitted call that outlives its
timeout, or whose daemon goes away, settles with the same errors as a blocking one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic

import zmq

from kvsidecar.client.calls import _Call
from kvsidecar.client.codec import R, T, _check
from kvsidecar.client.common import _Session
from kvsidecar.client.requests import _Requests
from kvsidecar.memory.fd_client import FdChannelClient
from kvsidecar.wire import zmqio
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Error, Reply, Request

log = logging.getLogger("kvsidecar.client")

SUBMIT_LOCK_WAIT_S = 0.05
"""How long a submit or poll waits for the socket while a reconnection holds it: an engine
step is not held up by a daemon that is away (the submit fails with ``connection_lost``)."""

PUMP_SLICE_S = 0.05
"""Longest a wait for submitted calls holds the socket at one time (`_BlockingTransport.pump`)."""


class Pending(Generic[T]):
    """A submitted call (`SidecarClient.submit_*`): poll with `done`, wait with `wait`/`result`.

    It settles once: with the reply's result, or with the `SidecarError` of a failed call
    (``timeout`` past the call's timeout, ``connection_lost`` when the daemon went away).
    """

    def __init__(self, transport: _BlockingTransport, call: _Call[Any, T], deadline: float) -> None:
        self._transport = transport
        self._call = call
        self.deadline = deadline
        """``time.monotonic()`` past which the call fails with ``timeout``."""
        self.request_id = call.req.id
        self._settled = False
        self._value: T | None = None
        self._error: SidecarError | None = None

    def done(self) -> bool:
        """Whether the call has settled, reading any reply that arrived (never blocks long)."""
        if not self._settled:
            self._transport.pump(0.0)
        return self._settled

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the call to settle; return whether it did."""
        end = time.monotonic() + max(0.0, timeout)
        while not self._settled:
            left = end - time.monotonic()
            self._transport.pump(max(0.0, left))
            if left <= 0:
                break
        return self._settled

    def result(self) -> T:
        """Return the call's result, waiting (at most until its deadline); raise its error."""
        while not self._settled:
            self._transport.pump(max(0.0, self.deadline - time.monotonic()) + 0.001)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _settle(
        self, reply: Reply | None, frames: list[memoryview], error: SidecarError | None
    ) -> None:
        if self._settled:
            return
        self._settled = True
        if error is None and reply is not None:
            try:
                self._value = self._call.finish(_check(reply, self._call.expected), frames)
            except SidecarError as exc:
                error = exc
        self._error = error


class _BlockingTransport:
    """The blocking transport of a `SidecarClient`: its socket, its submitted calls, its heartbeat.

    ``requests`` builds what the transport sends by itself: hellos, the registrations replayed
    on a restarted daemon, and heartbeats.
    """

    def __init__(
        self,
        session: _Session,
        requests: _Requests,
        *,
        heartbeat: bool,
        context: zmq.Context[Any] | None,
    ) -> None:
        self._session = session
        self._requests = requests
        # Bound once: every call encodes its request and decodes its reply.
        self._encode = session.codec.encoder.encode
        self._decode = session.codec.decode
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._new_socket()
        self._heartbeat_enabled = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._closed = False
        # One call at a time on the socket: the heartbeat thread reconnects through it too.
        self._lock = threading.RLock()
        self._pending: dict[int, Pending[Any]] = {}
        """Submitted calls not settled yet, by request id."""
        self._poller: zmq.Poller | None = None
        self._polled: tuple[zmq.Socket[Any], FdChannelClient | None] | None = None
        """What `_reply_poller`'s poller watches."""

    def start(self) -> None:
        """Say hello (the socket connected when made); on failure close, and raise."""
        try:
            self._session.daemon = self.run(self._requests.hello(None))
        except BaseException:
            self.close()
            raise

    def call(
        self,
        req: Request,
        expected: type[R],
        data: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[R, list[memoryview]]:
        """Send ``req`` and wait for its reply, checked against ``expected``, and its frames.

        A daemon known to be away is reconnected first. Replies to other calls that come
        meanwhile go to their submitted calls (or, late, are dropped).
        """
        if self._closed:
            raise SidecarError("internal", "the client is closed")
        session = self._session
        with self._lock:
            if session.lost or session.daemon_gone():
                session.lost = True
                self.reconnect()  # raises connection_lost while the daemon stays away
            # One send of all frames (`zmqio.send_frames`), not pyzmq's send_multipart, which
            # works out each frame's flags anew.
            zmqio.send_frames(self._sock, [self._encode(req), *data], copy=False, block=True)
            deadline = time.monotonic() + (session.timeout_s if timeout is None else timeout)
            poller = self._reply_poller()
            while True:
                left = deadline - time.monotonic()
                ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
                if self._sock not in ready:
                    if ready and session.daemon_gone():
                        session.lost = True
                        raise session.lost_error(type(req).__name__, req.id)
                    if time.monotonic() >= deadline:
                        raise session.timeout_error(req)
                    continue
                # All of a message is there once its first frame is: read without blocking.
                reply, frames = self._decode(zmqio.recv_frames(self._sock))
                if reply.id == req.id or (reply.id == 0 and isinstance(reply, Error)):
                    return _check(reply, expected), frames
                self._route(reply, frames)  # a submitted call's, or a late one: dropped

    def _reply_poller(self) -> zmq.Poller:
        """Return the poller a call waits on: the socket, and the fd channel once there is one.

        Kept while both stay the same (a reconnection or a registration changes them), so that a
        call does not make and register a poller of its own.
        """
        sock, channel = self._sock, self._session.fd_channel
        if self._poller is None or self._polled != (sock, channel):
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            if channel is not None:  # EOF on it: the daemon died with our request
                self._poller.register(channel.fileno(), zmq.POLLIN)
            self._polled = (sock, channel)
        return self._poller

    def run(self, call: _Call[R, T]) -> T:
        """Carry ``call`` and return its result (what its ``finish`` makes of the reply)."""
        reply, frames = self.call(call.req, call.expected, call.data, call.timeout)
        return call.finish(reply, frames)

    def submit(self, call: _Call[R, T]) -> Pending[T]:
        """Send ``call`` now and return its `Pending`; never reconnects (the heartbeat does).

        Raises `SidecarError` ``connection_lost`` at once when the daemon is known to be away
        or a reconnection holds the socket. A death not seen yet is not looked for here (that
        costs a system call per call): the call then fails with ``connection_lost`` when polled,
        as every call in flight does (the poll watches the fd channel).
        """
        if self._closed:
            raise SidecarError("internal", "the client is closed")
        if not self._lock.acquire(timeout=SUBMIT_LOCK_WAIT_S):
            raise SidecarError("connection_lost", "the client is reconnecting to its daemon")
        try:
            session = self._session
            if session.lost:
                raise SidecarError("connection_lost", "the daemon went away; reconnecting")
            timeout = session.timeout_s if call.timeout is None else call.timeout
            pending = Pending(self, call, time.monotonic() + timeout)
            self._pending[call.req.id] = pending
            frames = [self._encode(call.req), *call.data]
            zmqio.send_frames(self._sock, frames, copy=False, block=True)
            return pending
        finally:
            self._lock.release()

    def _route(self, reply: Reply, frames: list[memoryview]) -> None:
        """Hand a reply to the submitted call it answers (a reply nobody waits for is dropped)."""
        pending = self._pending.pop(reply.id, None)
        if pending is not None:
            pending._settle(reply, frames, None)

    def _fail_pending(self, make: Callable[[Pending[Any]], SidecarError]) -> None:
        """Settle every submitted call with the error ``make(pending)`` returns."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p._settle(None, [], make(p))

    def pump(self, wait: float) -> None:
        """Read replies for submitted calls for up to ``wait`` seconds; settle what ended.

        The socket is held in slices of at most `PUMP_SLICE_S`, so that the heartbeat thread
        (which takes the lock to read the registered workers) is never starved by a long wait.
        """
        end = time.monotonic() + wait
        while self._pending:
            if not self._lock.acquire(timeout=SUBMIT_LOCK_WAIT_S):
                return
            try:
                self._pump_slice(min(PUMP_SLICE_S, max(0.0, end - time.monotonic())))
            finally:
                self._lock.release()
            if time.monotonic() >= end:
                return

    def _pump_slice(self, wait: float) -> None:
        """One slice of `pump`, under the lock: fail what ended, then read what arrives.

        One poll watches the socket and the fd channel. The daemon never writes on the channel,
        so it is read (to learn whether the daemon closed it) only when it polled readable: a
        poll that finds nothing costs one system call, which is most of a step's share.
        """
        session = self._session
        now = time.monotonic()
        for p in [p for p in self._pending.values() if p.deadline <= now]:
            del self._pending[p.request_id]
            p._settle(None, [], session.timeout_error(p._call.req))
        if not self._pending:
            return
        ready = dict(self._reply_poller().poll(int(wait * 1000)))
        channel = session.fd_channel
        if channel is not None and channel.fileno() in ready and session.daemon_gone():
            session.lost = True
            self._fail_pending(lambda p: session.lost_error("a submitted call", p.request_id))
            return
        if self._sock not in ready:
            return
        # Asking the socket's events costs no system call; a receive that finds nothing would.
        while zmqio.readable(self._sock):
            reply, frames = self._decode(zmqio.recv_frames(self._sock))
            self._route(reply, frames)

    def _new_socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._session.secure(sock)
        sock.connect(self._session.endpoint)
        return sock

    def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register; see `SidecarClient.reconnect`."""
        session, requests = self._session, self._requests
        with self._lock:
            backoff = session.start_reconnect(timeout)
            # Submitted calls cannot be answered on the new socket: their outcome is unknown.
            self._fail_pending(lambda p: session.lost_error("a submitted call", p.request_id))
            while True:
                # A fresh socket: nothing queued for the dead daemon is sent to the new one.
                self._sock.close(linger=0)
                self._sock = self._new_socket()
                try:
                    session.daemon = self.run(requests.hello(backoff.hello_timeout()))
                    break
                except SidecarError as exc:
                    time.sleep(session.retry_pause(backoff, exc))
            session.forget_workers()
            try:
                for reg in session.registrations:
                    self.run(requests.register(reg, remember=False))
            except SidecarError:
                session.lost = True  # try again on the next call
                raise
            session.reconnected()

    def keep_alive(self, lease_s: float) -> None:
        """After a registration: renew its lease from a background thread."""
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
        session = self._session
        sock = self._new_socket()
        try:
            while not self._hb_stop.wait(interval):
                forgotten = False
                # Drain replies; an unknown_worker means the daemon forgot us (restart).
                while sock.poll(0, zmq.POLLIN):
                    reply, _ = self._decode(sock.recv_multipart())
                    if isinstance(reply, Error):
                        log.warning("heartbeat refused: %s %s", reply.code, reply.message)
                        forgotten |= reply.code in ("unknown_worker", "unknown_engine")
                gone = forgotten or session.lost or session.daemon_gone()
                if gone and session.registrations:
                    self._reconnect_from_heartbeat(interval)
                    continue
                with self._lock:
                    req = self._requests.heartbeat_request(list(session.workers))
                sock.send(self._encode(req))
        finally:
            sock.close(linger=0)

    def _reconnect_from_heartbeat(self, interval: float) -> None:
        # The engine may be idle: re-register now rather than on its next call. The lock is
        # only waited for briefly, so a long call of the engine's just delays this.
        if not self._lock.acquire(timeout=interval):
            return
        try:
            self._session.lost = True
            self.reconnect(timeout=interval)
        except SidecarError as exc:
            log.info("daemon not back yet: %s", exc)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the heartbeat, close the fd channel and the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        self._session.close_fd_channel()
        self._sock.close(linger=0)
