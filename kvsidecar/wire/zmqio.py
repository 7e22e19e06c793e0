"""Non-blocking multipart send and receive on plain pyzmq sockets, for per-request hot paths.

The daemon's control socket and the asyncio client read their sockets from event-loop reader
callbacks. pyzmq's ``send_multipart`` / ``recv_multipart`` and its flag enums spend a share of a
small request's time in enum arithmetic and option look-ups (``SNDMORE | flags``,
``getsockopt(RCVMORE)``, each ``events & POLLIN``): nine enum operations per request and reply on
a 1-block move. These do the same with plain integers and each received frame's own ``more`` flag.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

log = logging.getLogger("kvsidecar.zmqio")

EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_SNDMORE = int(zmq.SNDMORE)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting; asking also re-arms the socket's edge-triggered fd."""
    events: int = sock.getsockopt(EVENTS)  # type: ignore[assignment]  # an int option
    return bool(events & POLLIN)


def recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """Receive one whole multipart message without blocking (raises `zmq.Again` if none)."""
    frame = sock.recv(NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:  # the rest of a multipart message is there once its first part is
        frame = sock.recv(NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def try_recv(sock: zmq.Socket[Any]) -> list[zmq.Frame] | None:
    """Return the next whole message, or None when none waits (or the socket is closing).

    Asking ``readable`` first is cheaper than the exception of a receive that finds nothing, and
    re-arms the edge-triggered fd the same way; a reader callback calls this until None.
    """
    try:
        if not readable(sock):
            return None
        return recv_frames(sock)
    except zmq.Again:
        return None
    except zmq.ZMQError as exc:  # closed under the reader (shutdown, reconnect)
        log.debug("socket not read: %s", exc)
        return None


COPY_BELOW = 1 << 16
"""Messages smaller than this are copied into ZMQ messages rather than sent zero-copy: for a
header or a few ids, pyzmq's zero-copy frame object (made and tracked per frame) costs more than
the copy (see docs/benchmarks.md)."""


def send_frames(
    sock: zmq.Socket[Any],
    frames: Sequence[Any],
    *,
    copy: bool | None = None,
    track: bool = False,
    block: bool = False,
) -> list[zmq.MessageTracker]:
    """Queue one multipart message without blocking (raises `zmq.Again` if the queue is full).

    ``copy``: None copies messages under `COPY_BELOW` bytes and sends larger ones zero-copy.
    A multipart message is queued whole or not at all, so only the first part can fail.
    ``track`` (zero-copy sends only): return one tracker per frame, done once libzmq let go
    of it (sent, or dropped). ``block``: wait while the queue is full instead (a blocking
    client's one call at a time).
    """
    if copy is None:
        copy = sum(memoryview(f).nbytes for f in frames) < COPY_BELOW
    track = track and not copy
    more, end = (_SNDMORE, 0) if block else (_MORE, NOBLOCK)
    last = len(frames) - 1
    trackers = []
    for i, frame in enumerate(frames):
        sent = sock.send(frame, more if i < last else end, copy=copy, track=track)
        if track and isinstance(sent, zmq.MessageTracker):
            trackers.append(sent)
    return trackers


async def serve_readable(
    sock: zmq.Socket[Any], on_readable: Callable[[], None], kick: Callable[[], None]
) -> None:
    """Call ``on_readable`` from the loop whenever ``sock``'s fd signals, until cancelled.

    The fd is edge-triggered: ``on_readable`` must read (`try_recv`) until nothing is left, or
    queue itself again. ``kick`` queues a first call, for what arrived before the reader existed.
    """
    loop = asyncio.get_running_loop()
    fd = int(sock.getsockopt(zmq.FD))
    loop.add_reader(fd, on_readable)
    kick()
    try:
        await loop.create_future()  # until cancelled
    finally:
        loop.remove_reader(fd)


def bind_or_close(sock: zmq.Socket[Any], endpoint: str, what: str) -> None:
    """Bind ``sock`` to ``endpoint``; on failure close it and raise `SystemExit` naming ``what``.

    A socket left open after a failed bind keeps its context's ``term()`` waiting forever, so a
    daemon whose port is taken would hang in its shutdown instead of exiting with the reason.
    """
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise SystemExit(f"kvsidecar: cannot bind the {what} {endpoint}: {exc}") from None
