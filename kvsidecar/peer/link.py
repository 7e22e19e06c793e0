"""`PeerLink`: one pulling daemon's connection to one remote daemon's peer endpoint.

A DEALER socket with a reader task that matches replies to requests by id carries the
handshakes and notifications. The ZMQ plane's reads go over the link's data streams
(`kvsidecar.peer.streams.DataStream`, ``peer_streams`` of them, opened at the first read): each
its own connection and thread, receiving data frames straight into the destination buffers.
`PeerLink.read` spreads chunks over them; ``max_in_flight`` is split between the streams as their
windows (chunks sent and unanswered), which the streams' threads keep full themselves.

A socket monitor turns a dropped TCP connection (the producer died) into an immediate
`PeerGone` for every request in flight, instead of waiting for their timeouts; each stream
watches its own connection the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvsidecar.peer.messages import PeerError, PeerReply, PeerRequest, ReadBlocks, ReadData
from kvsidecar.peer.streams import Chunk, DataStream, Dest, PeerGone, PeerRefused
from kvsidecar.wire.curve import KeyPair, secure_client_socket

__all__ = ["Dest", "PeerGone", "PeerLink", "PeerRefused"]

log = logging.getLogger("kvsidecar.peer")

_LINK_HWM = 1024
"""Messages queued each way on a link before libzmq pushes back."""
_TURN = 16
"""Replies read before the read loop yields to the event loop (a remote that floods replies
must not hold the loop: a receive that finds a message waiting never yields by itself)."""
_SUBMIT_TURN_S = 0.005
"""Longest stretch `PeerLink.read_all` makes and submits chunks before it lets the event loop
serve others (a pull of millions of ranges makes thousands of chunks)."""


class PeerLink:
    """Connection to one remote peer endpoint, made and shared by `kvsidecar.peer.links`."""

    users = 0
    """Pulls using the link now (`kvsidecar.peer.links.PeerLinks` counts them)."""
    last_used = 0.0
    """When a pull last took or gave back the link (monotonic seconds)."""
    identity: tuple[str, bytes] | None = None
    """Who answered its handshake: daemon id and server key (None before the first)."""
    passing = False
    """It reached a daemon that another link is kept for: closed once its pulls are done."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        max_in_flight: int,
        *,
        curve: tuple[bytes, KeyPair] | None = None,
        streams: int = 1,
        max_reply_bytes: int = -1,
        max_data_frame: int = -1,
    ) -> None:
        """Connect to ``endpoint``; the data streams connect at the first read.

        ``max_reply_bytes``: largest frame accepted on the control connection (handshake
        replies); ``max_data_frame``: on a data stream (a read's data). A remote that sends a
        larger frame is disconnected by libzmq. -1: no bound.
        """
        self.endpoint = endpoint
        self.closed = False
        self._max_data_frame = max_data_frame
        self._ctx = ctx
        self._curve = curve
        # Read chunks in flight on this link (shared by every pull to this peer), split between
        # the streams: never more streams than chunks, so that every stream's window is >= 1.
        self._stream_count = max(1, min(streams, max_in_flight))
        self._max_in_flight = max_in_flight
        self._streams: list[DataStream] = []
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Bounded both ways: reads are bounded by the streams' windows, and a remote that sends
        # more than was asked for is throttled by TCP instead of growing this daemon's memory.
        self._sock.setsockopt(zmq.SNDHWM, _LINK_HWM)
        self._sock.setsockopt(zmq.RCVHWM, _LINK_HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        # Fail fast on a dead peer rather than reconnecting into a half-read reply stream.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if curve is not None:  # a CURVE client of the remote daemon
            secure_client_socket(self._sock, server_public=curve[0], keys=curve[1])
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self._sock.connect(endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerReply)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[PeerReply]] = {}
        self._connected = False
        self.lost = False
        """True once an established connection dropped: the link then refuses new requests
        (`PeerService.link` replaces it), so nothing waits on a dead peer."""
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"peer-link-{endpoint}"),
            asyncio.create_task(self._monitor_loop(), name=f"peer-monitor-{endpoint}"),
        ]

    def next_id(self) -> int:
        """Return a fresh request id for this link."""
        return next(self._ids)

    @property
    def server_key(self) -> bytes:
        """The public key the remote daemon must present (b"" on plain tcp)."""
        return b"" if self._curve is None else self._curve[0]

    @property
    def connected(self) -> bool:
        """Whether the control connection is up and no data stream has lost its connection."""
        return self._connected and not any(s.broken for s in self._streams)

    async def request(
        self, msg: PeerRequest, frames: Sequence[Any] = (), *, timeout: float
    ) -> PeerReply:
        """Send ``msg`` (+ raw ``frames``) on the control socket and wait for its reply.

        Raises `PeerGone` (timeout, disconnect, closed link) or `PeerRefused` (`PeerError`).
        """
        self._check_usable()
        fut: asyncio.Future[PeerReply] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut
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

    async def read(
        self, msg: ReadBlocks, frames: list[Any], dests: Sequence[Dest], *, timeout: float
    ) -> ReadData:
        """Send one read on the least busy data stream; its data frames land in ``dests``.

        As `read_all` with one read.
        """
        return (await self.read_all([(msg, frames, dests)], timeout=timeout))[0]

    async def read_all(
        self, reads: Iterable[tuple[ReadBlocks, list[Any], Sequence[Dest]]], *, timeout: float
    ) -> list[ReadData]:
        """Send every read (``msg``, its raw frames, where its data lands) and wait for them all.

        Each goes to the least busy data stream as it comes, so the first is on its way while
        the rest are still being made. One wait for all of them, not a task and a timer each,
        which would cost this loop more per chunk than the rest of its handling.

        Raises `PeerGone` (timeout, disconnect, closed link) or `PeerRefused` on the first read
        that fails; the others are withdrawn then. When it raises, or is cancelled, no byte of
        any reply lands after it returned.
        """
        self._check_usable()
        if not self._streams:
            n, total = self._stream_count, self._max_in_flight
            self._streams = [
                DataStream(
                    self._ctx,
                    self.endpoint,
                    window=total // n + (1 if i < total % n else 0),
                    curve=self._curve,
                    name=f"{i}",
                    max_frame=self._max_data_frame,
                )
                for i in range(n)
            ]
        sent: list[tuple[DataStream, Chunk]] = []
        try:
            turn = time.perf_counter()
            for msg, frames, dests in reads:
                stream = min(self._streams, key=lambda s: s.in_flight)
                stream.in_flight += 1
                sent.append((stream, stream.submit(msg, frames, dests)))
                if time.perf_counter() - turn > _SUBMIT_TURN_S:
                    await asyncio.sleep(0)
                    self._check_usable()
                    turn = time.perf_counter()
            futures = [chunk.future for _, chunk in sent]
            done, _ = await asyncio.wait(
                futures, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_EXCEPTION
            )
            error = next((e for f in futures if f.done() and (e := f.exception())), None)
            if error is not None:
                raise error
            if len(done) < len(futures):
                raise PeerGone(f"no reply from {self.endpoint} to a read within {timeout:.1f} s")
            replies = [f.result() for f in futures]
        except BaseException:
            await _withdraw_all(sent)
            raise
        finally:
            for stream, _ in sent:
                stream.in_flight -= 1
        for reply in replies:
            if not isinstance(reply, ReadData):
                raise PeerGone(f"unexpected {type(reply).__name__} to a read")
        return replies

    async def send(self, msg: PeerRequest) -> None:
        """Send a message that has no reply (a notification)."""
        self._check_usable()
        await self._sock.send(self._encoder.encode(msg))

    def _check_usable(self) -> None:
        if self.closed:
            raise PeerGone(f"link to {self.endpoint} is closed")
        if self.lost:
            # Requests that were still waiting for a slot when the connection dropped fail now,
            # like the ones in flight, not at their deadline (libzmq would queue them for a
            # reconnection to a peer that is most likely dead).
            raise PeerGone(f"connection to {self.endpoint} lost")

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
            self._drain()  # control replies carry no data frames
            fut = self._pending.get(reply.id)
            if fut is None or fut.done():  # a reply to a request that timed out
                continue
            fut.set_result(reply)

    def _drain(self) -> None:
        while self._sock.get(zmq.RCVMORE):
            zmq.Socket.recv(self._sock, flags=zmq.NOBLOCK, copy=False)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self.lost = True
                self.fail_all(PeerGone(f"connection to {self.endpoint} lost"))
                # A lost link is never used again (the next pull connects afresh): no
                # reconnecting to a dead peer every 100 ms until the link is closed.
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disconnect(self.endpoint)

    def fail_all(self, exc: Exception) -> None:
        """Fail every request in flight on this link with ``exc``."""
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(exc)

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
        for stream in self._streams:
            stream.close()
        self._streams = []


async def _withdraw_all(sent: list[tuple[DataStream, Chunk]]) -> None:
    """Give up every chunk not settled yet; wait until the copies of those landing are over."""
    landing = [
        chunk.future
        for stream, chunk in sent
        if not chunk.future.done() and not stream.cancel(chunk)
    ]
    if landing:
        await asyncio.wait(landing)
    for _, chunk in sent:
        if chunk.future.done() and not chunk.future.cancelled():
            chunk.future.exception()  # retrieved: the caller reports its own failure
