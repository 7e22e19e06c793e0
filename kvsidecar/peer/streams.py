"""`DataStream`: one data connection to a remote daemon, sent and received on its own thread.

The ZMQ plane's reads (`kvsidecar.peer.zmq_plane`) travel on a link's data streams rather than
on its control socket. Each stream is a DEALER socket with its own TCP connection, owned by one
thread that sends the `ReadBlocks` requests handed to it and receives each `ReadData` reply's
frames straight into their destinations (``recv_into``: ZeroMQ copies its message into our block
memory with the GIL released; no Python bytes in between), or copies a packed reply's one frame
out to them. So the copies of a pull run on these
threads, never on the event loop, and several streams copy at once, each over its own connection
served by its own ZeroMQ I/O thread on both daemons.

A stream keeps at most ``window`` chunks sent and unanswered; the rest wait in its queue, and the
thread sends the next one as soon as a reply has landed, without a round trip through the loop
(which would leave the connection idle whenever the loop is busy). The window bounds what the
remote daemon answers at once and so the memory ZeroMQ holds here for replies not yet copied.

What the loop keeps: chunks are submitted and settled on it (each chunk's future is resolved
with ``call_soon_threadsafe``), and replies are matched to chunks by id, so a late reply to a
chunk that was given up is drained, never written. A chunk can be given up (`DataStream.cancel`)
until its reply starts landing; after that its caller waits for the copy to end (it is bounded:
a multipart message is received whole before its first frame is readable, so the copy never
waits for the network). A dropped connection (socket monitor) fails every chunk in flight on
the stream at once, and the stream then refuses new ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvsidecar.peer.messages import PeerError, PeerReply, ReadBlocks, ReadData
from kvsidecar.wire import zmqio
from kvsidecar.wire.curve import KeyPair, secure_client_socket

log = logging.getLogger("kvsidecar.peer")

Dest = npt.NDArray[np.uint8]
"""A writable, contiguous byte array that one data frame is received into."""

_QUEUED, _SENT, _RECEIVING, _DONE, _CANCELLED = range(5)
_monitor_ids = itertools.count()


class PeerGone(Exception):
    """The remote daemon cannot be reached, went away, or did not answer in time."""


class PeerRefused(Exception):
    """The remote daemon answered with a `PeerError`."""

    def __init__(self, error: PeerError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class Chunk:
    """One read request on a stream: its frames, where its reply's data frames land, its future.

    The future is resolved on the loop with the `ReadData` reply, or fails with `PeerGone` or
    `PeerRefused`; a cancelled chunk's future is never resolved.
    """

    __slots__ = ("dests", "frames", "future", "id", "state")

    def __init__(
        self, msg: ReadBlocks, frames: list[Any], dests: Sequence[Dest], fut: asyncio.Future[Any]
    ) -> None:
        self.id = msg.id
        self.frames = frames
        self.dests = dests
        self.future = fut
        self.state = _QUEUED


class DataStream:
    """A DEALER socket to ``endpoint`` and the thread that owns it; `close` it when done."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        *,
        window: int = 8,
        curve: tuple[bytes, KeyPair] | None = None,
        name: str = "",
        max_frame: int = -1,
    ) -> None:
        """Connect to ``endpoint`` and start the thread.

        ``max_frame``: largest frame accepted (a producer that sends a larger one is disconnected
        by libzmq; -1: no bound).
        """
        self.endpoint = endpoint
        self.in_flight = 0
        """Chunks submitted and not yet settled (counted on the loop: picks the least busy)."""
        self.broken = False
        """The connection dropped: chunks in flight failed, new ones are refused."""
        self._window = max(1, window)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._queue: collections.deque[Chunk] = collections.deque()
        self._wake_pending = False
        """The eventfd was written and the thread has not drained the queue since (under the
        lock): a read's chunks are submitted in a burst, and one wake-up serves them all."""
        self._closing = False
        self._sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # An honest producer has at most ``window`` replies on their way: a remote that sends
        # more than asked for is throttled by TCP rather than queued here.
        self._sock.setsockopt(zmq.RCVHWM, 2 * self._window + 16)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        # Fail fast on a dead peer rather than waiting for TCP to notice a silent one.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if curve is not None:  # a CURVE client of the remote daemon
            secure_client_socket(self._sock, server_public=curve[0], keys=curve[1])
        addr = f"inproc://kvsidecar-stream-monitor-{os.getpid()}-{next(_monitor_ids)}"
        self._sock.monitor(addr, zmq.EVENT_DISCONNECTED)
        self._monitor: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)
        self._monitor.connect(addr)
        self._sock.connect(endpoint)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._decoder = msgspec.msgpack.Decoder(PeerReply)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(
            target=self._run, name=f"kvsidecar-stream{name}", daemon=True
        )
        self._thread.start()

    def submit(self, msg: ReadBlocks, frames: list[Any], dests: Sequence[Dest]) -> Chunk:
        """Hand a read to the stream's thread; its future settles on this loop."""
        chunk = Chunk(msg, [self._encoder.encode(msg), *frames], dests, self._loop.create_future())
        if self.broken or self._closing:
            chunk.state = _DONE
            chunk.future.set_exception(PeerGone(f"connection to {self.endpoint} lost"))
            return chunk
        with self._lock:
            self._queue.append(chunk)
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:  # each write costs this loop a wake-up of the thread: one per drain of the queue
            os.eventfd_write(self._wake, 1)
        return chunk

    def cancel(self, chunk: Chunk) -> bool:
        """Give a chunk up; False when its reply is landing already (await its future then)."""
        with self._lock:
            if chunk.state in (_QUEUED, _SENT):
                chunk.state = _CANCELLED
                return True
            return chunk.state == _CANCELLED

    def close(self) -> None:
        """Stop the thread (chunks in flight fail with `PeerGone`), close the sockets."""
        if self._closing:
            return
        self._closing = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # stuck in a copy: leave the sockets to the process exit
            log.warning("data stream to %s did not stop", self.endpoint)
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        os.close(self._wake)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        sent: dict[int, Chunk] = {}
        try:
            while not self._closing:
                ready = dict(poller.poll(1000))
                if self._wake in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                self._send_queued(sent)
                if self._monitor in ready and self._disconnected():
                    self._fail(sent, PeerGone(f"connection to {self.endpoint} lost"))
                if self._sock in ready:
                    self._receive(sent)
                    self._send_queued(sent)  # refill the window at once
                for key in [k for k, c in sent.items() if c.state == _CANCELLED]:
                    del sent[key]
        except Exception as exc:  # a bug: fail what is in flight rather than hang it
            log.exception("data stream to %s failed", self.endpoint)
            self._fail(sent, PeerGone(f"data stream to {self.endpoint} failed: {exc}"))
            self.broken = True
            return
        self._fail(sent, PeerGone(f"link to {self.endpoint} closed"))

    def _send_queued(self, sent: dict[int, Chunk]) -> None:
        """Send queued chunks while the window has room (all of them fail if the link broke)."""
        live: list[Chunk] = []
        with self._lock:
            # Cleared in the same locked section that drains: a chunk queued after it writes the
            # eventfd again, one queued before it is taken (or left queued for a reply's refill).
            self._wake_pending = False
            room = len(self._queue) if self.broken else self._window - len(sent)
            while self._queue and len(live) < room:
                chunk = self._queue.popleft()
                if chunk.state == _QUEUED:  # a cancelled one takes no room
                    chunk.state = _DONE if self.broken else _SENT
                    live.append(chunk)
        if self.broken:
            # Submitted before the loop saw the drop: ZeroMQ would hold them for a reconnection
            # (to whatever then listens there); they fail now instead.
            for chunk in live:
                self._settle(chunk, PeerGone(f"connection to {self.endpoint} lost"))
            return
        for chunk in live:
            sent[chunk.id] = chunk
            # HWM 0: never full. Zero-copy above zmqio's threshold (the range frames are small).
            zmqio.send_frames(self._sock, chunk.frames)
            chunk.frames = []

    def _disconnected(self) -> bool:
        lost = False
        while zmqio.readable(self._monitor):
            event = parse_monitor_message(self._monitor.recv_multipart())
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
        if lost:
            self.broken = True
            # Never used again: no reconnecting to a dead peer until the stream is closed.
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disconnect(self.endpoint)
        return lost

    def _receive(self, sent: dict[int, Chunk]) -> None:
        sock = self._sock
        while True:
            try:
                header = sock.recv(zmqio.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = self._decoder.decode(header.buffer)
            except msgspec.DecodeError as exc:
                log.warning("unreadable reply from %s: %s", self.endpoint, exc)
                self._drain(header.more)
                continue
            chunk = sent.pop(reply.id, None)
            with self._lock:
                live = chunk is not None and chunk.state == _SENT
                if live:
                    assert chunk is not None
                    chunk.state = _RECEIVING
            if chunk is None or not live:  # a reply to a chunk that was given up
                self._drain(header.more)
                continue
            outcome: Any = reply
            if isinstance(reply, ReadData):
                land = self._unpack if reply.packed else self._land
                outcome = land(chunk.dests, header.more)
                outcome = reply if outcome is None else outcome
            else:
                self._drain(header.more)
                if isinstance(reply, PeerError):
                    outcome = PeerRefused(reply)
            with self._lock:
                chunk.state = _DONE
            self._settle(chunk, outcome)

    def _land(self, dests: Sequence[Dest], more: bool) -> PeerGone | None:
        """Receive a reply's data frames into ``dests``; a `PeerGone` if they do not fit."""
        sock = self._sock
        for i, dest in enumerate(dests):
            if not more:
                return PeerGone(f"{self.endpoint} sent {i} data frames, {len(dests)} expected")
            got = sock.recv_into(dest.data, flags=zmqio.NOBLOCK)
            more = bool(sock.get(zmq.RCVMORE))
            if got != dest.nbytes:
                self._drain(more)
                return PeerGone(f"{self.endpoint} sent a frame of {got} bytes for {dest.nbytes}")
        if more:
            self._drain(more)
            return PeerGone(f"{self.endpoint} sent more data frames than requested")
        return None

    def _unpack(self, dests: Sequence[Dest], more: bool) -> PeerGone | None:
        """Copy a packed reply's one frame into ``dests`` in order; a `PeerGone` if it does not fit.

        numpy copies without the GIL, as ``recv_into`` does.
        """
        if not more:
            return PeerGone(f"{self.endpoint} sent a packed reply without its frame")
        frame = self._sock.recv(zmqio.NOBLOCK, copy=False)
        if frame.more:
            self._drain(True)
            return PeerGone(f"{self.endpoint} sent more than one packed frame")
        data = np.frombuffer(frame.buffer, dtype=np.uint8)
        want = sum(d.nbytes for d in dests)
        if data.nbytes != want:
            return PeerGone(
                f"{self.endpoint} sent a packed frame of {data.nbytes} bytes for {want}"
            )
        off = 0
        for dest in dests:
            np.copyto(dest, data[off : off + dest.nbytes])
            off += dest.nbytes
        return None

    def _drain(self, more: bool) -> None:
        while more:
            more = self._sock.recv(zmqio.NOBLOCK, copy=False).more

    def _fail(self, sent: dict[int, Chunk], exc: PeerGone) -> None:
        with self._lock:
            failed = [c for c in (*sent.values(), *self._queue) if c.state in (_QUEUED, _SENT)]
            for chunk in failed:
                chunk.state = _DONE
            self._queue.clear()
        sent.clear()
        for chunk in failed:
            self._settle(chunk, exc)

    def _settle(self, chunk: Chunk, outcome: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (exit): nobody waits
            self._loop.call_soon_threadsafe(_resolve, chunk.future, outcome)


def _resolve(fut: asyncio.Future[Any], outcome: Any) -> None:
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
