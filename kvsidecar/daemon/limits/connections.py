"""Live connections of a ZeroMQ server socket, counted per peer, for the ZAP handler to limit.

libzmq accepts every connection that arrives (a descriptor each) and has no limit of its own,
and its ipc listener aborts the whole process when ``accept`` meets EMFILE (libzmq 4.3.5,
``ipc_listener.cpp:297``), so one local process opening DEALER sockets until the descriptors run
out would take the daemon down. A `ConnectionCount` follows the socket's monitor (accepted and
disconnected events, with the connection's descriptor) and keys each connection by its peer:
(uid, pid) from ``SO_PEERCRED`` on ipc, the address on tcp. The ZAP handler, asked about every
new connection, then refuses any beyond ``max_total`` (and beyond a quarter of the descriptors
the process had free at start), and one whose peer holds ``max_per_peer`` already or a quarter
of that total; libzmq closes a refused connection at once. The count runs a little behind the
connections (the monitor is asynchronous), which the limits tolerate.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Hashable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvsidecar.memory.fd_limits import fd_soft_limit, open_fd_count

__all__ = ["ConnectionCount", "peer_of_address"]


def peer_of_address(address: bytes) -> Hashable:
    """Return the peer key of a ZAP address (``localhost:uid:gid:pid`` on ipc, else the IP)."""
    parts = address.split(b":")
    if len(parts) == 4 and parts[0] == b"localhost":
        with contextlib.suppress(ValueError):
            return (int(parts[1]), int(parts[3]))
    return address.decode(errors="replace")


def _peer_of_fd(fd: int) -> Hashable:
    """Return the peer key of an accepted connection (None if its descriptor is gone)."""
    try:
        sock = socket.socket(fileno=fd)  # borrowed from libzmq: detached, never closed here
    except OSError:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", raw)
            return (uid, pid)
        return str(sock.getpeername()[0])
    except OSError:
        return None
    finally:
        sock.detach()


class ConnectionCount:
    """Connections of one server socket per peer, from its monitor; `admit` decides new ones."""

    def __init__(self, sock: zmq.Socket[Any], *, max_total: int, max_per_peer: int) -> None:
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.total = 0
        self.per_peer: dict[Hashable, int] = {}
        self.refused = 0
        """Connections refused for a limit since start."""
        self._by_fd: dict[int, Hashable] = {}
        self._sock = sock
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        if not isinstance(monitor, zmq.asyncio.Socket):  # made by the socket's own context
            raise TypeError("ConnectionCount needs a socket of a zmq.asyncio.Context")
        self._monitor: zmq.asyncio.Socket = monitor
        self._base_fds = open_fd_count()
        self._task = asyncio.create_task(self._follow(), name="kvsidecar-connections")

    def admit(self, address: bytes) -> str:
        """Why a new connection from ``address`` must be refused; "" to let it in."""
        # The asking connection is usually counted already (its accept event came first). No
        # peer may take more than a quarter of the total, so that one cannot crowd out the rest.
        total_cap = min(self.max_total, (fd_soft_limit() - self._base_fds) // 4)
        peer_cap = min(self.max_per_peer, max(1, total_cap // 4))
        key = peer_of_address(address)
        why = ""
        if self.per_peer.get(key, 0) > peer_cap:
            why = f"{peer_cap} connections from this peer already"
        elif self.total > total_cap:
            why = f"{self.total} connections open (limit {total_cap})"
        if why:
            self.refused += 1
        return why

    async def _follow(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._forget(fd)  # a number reused before its disconnect was read
                key = _peer_of_fd(fd)
                self._by_fd[fd] = key
                self.per_peer[key] = self.per_peer.get(key, 0) + 1
                self.total += 1
            else:
                self._forget(fd)

    def _forget(self, fd: int) -> None:
        if fd not in self._by_fd:
            return
        key = self._by_fd.pop(fd)
        self.total -= 1
        left = self.per_peer[key] - 1
        if left:
            self.per_peer[key] = left
        else:
            del self.per_peer[key]

    async def close(self) -> None:
        """Stop following the monitor (before the socket closes)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
