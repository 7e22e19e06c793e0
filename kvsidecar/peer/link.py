"""`PeerLink`: one pulling daemon's connection to one remote daemon's peer endpoint.

A DEALER socket with a reader task that matches replies to requests by id, so handshakes, reads
and notifications to one peer share one connection and several reads are in flight at once. The
bytes of a `ReadData` reply are received straight into the caller's destination buffers
(`zmq.Socket.recv_into`): each data frame lands in the local block memory it belongs to,
without an intermediate message buffer being handed to Python.

A socket monitor turns a dropped TCP connection (the producer died) into an immediate
`PeerGone` for every request in flight, instead of waiting for their timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvsidecar.peer.messages import PeerError, PeerReply, PeerRequest, ReadData
from kvsidecar.wire.curve import KeyPair, secure_client_socket  # security

log = logging.getLogger("kvsidecar.peer")

_LINK_HWM = 1024
"""Messages queued each way on a link before libzmq pushes back."""
_TURN = 16
"""Replies read before the read loop yields to the event loop (a remote that floods replies
must not hold the loop: a receive that finds a message waiting never yields by itself)."""

Dest = npt.NDArray[np.uint8]
"""A writable, contiguous byte array that one data frame is received into."""


class PeerGone(Exception):
    """The remote daemon cannot be reached, went away, or did not answer in time."""


class PeerRefused(Exception):
    """The remote daemon answered with a `PeerError`."""

    def __init__(self, error: PeerError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class _Pending:
    __slots__ = ("dests", "future")

    def __init__(self, future: asyncio.Future[PeerReply], dests: Sequence[Dest]) -> None:
        self.future = future
        self.dests = dests


class PeerLink:
    """Connection to one remote peer endpoint; create with `PeerLink.open`."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        max_in_flight: int,
        *,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.slots = asyncio.Semaphore(max_in_flight)
        """Read chunks in flight on this link (shared by every pull to this peer)."""
        self.closed = False
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Bounded both ways: requests are bounded by ``slots`` anyway, and a remote that sends
        # more than was asked for is throttled by TCP instead of growing this daemon's memory.
        self._sock.setsockopt(zmq.SNDHWM, _LINK_HWM)
        self._sock.setsockopt(zmq.RCVHWM, _LINK_HWM)
        # Fail fast on a dead peer rather than reconnecting into a half-read reply stream.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if curve is not None:  # security: CURVE client of the remote daemon
            secure_client_socket(self._sock, server_public=curve[0], keys=curve[1])
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self._sock.connect(endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerReply)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.connected = False
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"peer-link-{endpoint}"),
            asyncio.create_task(self._monitor_loop(), name=f"peer-monitor-{endpoint}"),
        ]

    def next_id(self) -> int:
        """Return a fresh request id for this link."""
        return next(self._ids)

    async def request(
        self,
        msg: PeerRequest,
        frames: Sequence[Any] = (),
        dests: Sequence[Dest] = (),
        *,
        timeout: float,
    ) -> PeerReply:
        """Send ``msg`` (+ raw ``frames``) and wait for its reply; data frames land in ``dests``.

        Raises `PeerGone` (timeout, disconnect, closed link) or `PeerRefused` (`PeerError`).
        """
        if self.closed:
            raise PeerGone(f"link to {self.endpoint} is closed")
        fut: asyncio.Future[PeerReply] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = _Pending(fut, dests)
        try:
            await self._sock.send_multipart([self._encoder.encode(msg), *frames], copy=False)
            reply = await asyncio.wait_for(fut, max(timeout, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            raise PeerGone(
                f"no reply from {self.endpoint} to {type(msg).__name__} within {timeout:.1f} s"
            ) from None
        finally:
            self._pending.pop(msg.id, None)
        if isinstance(reply, PeerError):
            raise PeerRefused(reply)
        return reply

    async def send(self, msg: PeerRequest) -> None:
        """Send a message that has no reply (a notification)."""
        if self.closed:
            raise PeerGone(f"link to {self.endpoint} is closed")
        await self._sock.send(self._encoder.encode(msg))

    async def _read_loop(self) -> None:
        sock = self._sock
        served = 0
        while True:
            served += 1
            if served >= _TURN:
                served = 0
                await asyncio.sleep(0)
            header = await sock.recv()
            try:
                reply = self._decoder.decode(header)
            except msgspec.DecodeError as exc:
                log.debug("unreadable reply from %s: %s", self.endpoint, exc)
                self._drain()
                continue
            pending = self._pending.get(reply.id)
            if pending is None or pending.future.done():
                self._drain()  # a reply to a request that timed out
                continue
            if isinstance(reply, ReadData):
                try:
                    self._receive_into(pending.dests)
                except PeerGone as exc:
                    self._drain()
                    pending.future.set_exception(exc)
                    continue
            else:
                self._drain()
            pending.future.set_result(reply)

    def _receive_into(self, dests: Sequence[Dest]) -> None:
        # A multipart message arrives whole: once the header is here, so is every data frame,
        # and these non-blocking reads never wait.
        sock = self._sock
        for i, dest in enumerate(dests):
            if not sock.get(zmq.RCVMORE):
                raise PeerGone(f"{self.endpoint} sent {i} data frames, {len(dests)} expected")
            got = zmq.Socket.recv_into(sock, dest.data, flags=zmq.NOBLOCK)
            if got != dest.nbytes:
                raise PeerGone(f"{self.endpoint} sent a frame of {got} bytes for {dest.nbytes}")
        if sock.get(zmq.RCVMORE):
            raise PeerGone(f"{self.endpoint} sent more data frames than requested")

    def _drain(self) -> None:
        while self._sock.get(zmq.RCVMORE):
            zmq.Socket.recv(self._sock, flags=zmq.NOBLOCK, copy=False)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.fail_all(PeerGone(f"connection to {self.endpoint} lost"))

    def fail_all(self, exc: Exception) -> None:
        """Fail every request in flight on this link with ``exc``."""
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(exc)

    async def close(self) -> None:
        """Fail what is in flight, stop the tasks, close the sockets. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.fail_all(PeerGone(f"link to {self.endpoint} closed"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
