"""Live connections of a ZeroMQ server socket, counted per user and per process, for ZAP to limit.

libzmq accepts every connection that arrives (a descriptor each) and has no limit of its own,
and its ipc listener aborts the whole process when ``accept`` meets EMFILE (libzmq 4.3.5,
``ipc_listener.cpp:297``), so one local process opening DEALER sockets until the descriptors run
out would take the daemon down. A `ConnectionCount` follows the socket's monitor (accepted and
disconnected events, with the connection's descriptor) and keys each connection by its peer
process, (uid, pid) from ``SO_PEERCRED`` on ipc (the address on tcp), and by its user, the uid
(the address on tcp). The ZAP handler, asked about every new connection, then refuses any beyond
``max_total`` (and beyond a quarter of the descriptors the process had free at start); one whose
user holds its share of that total already (the total divided by ``users``, the uids allowed:
forking more processes gives a user nothing more); and one whose process holds ``max_per_peer``
or a quarter of the total. libzmq closes a refused connection at once. The count runs a little
behind the connections (the monitor is asynchronous), which the limits tolerate.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import zmq
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


def user_of(peer: Hashable) -> Hashable:
    """Return the user of a peer key: the uid of an ipc peer's (uid, pid); a tcp peer's address."""
    return peer[0] if isinstance(peer, tuple) else peer


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


@dataclass
class _Held:
    """One peer's open connections: waiting for their verdict, admitted, and refused.

    The monitor says which descriptor closed, not which verdict it had: a disconnect is taken
    from the refused first (they close at once), then from the waiting, then from the admitted;
    a verdict that finds none waiting corrects that guess. So the three always add up to the
    open connections, and ``admitted`` is exact once no verdict waits.
    """

    waiting: int = 0
    admitted: int = 0
    refused: int = 0


class ConnectionCount:
    """Connections of one server socket per peer and per user; `admit` decides new ones."""

    def __init__(
        self, sock: zmq.Socket[Any], *, max_total: int, max_per_peer: int, users: int = 1
    ) -> None:
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.users = max(1, users)
        """How many users share ``max_total`` (the allowed uids): each may hold its share."""
        self.total = 0
        """Open connections, whatever their verdict."""
        self.per_peer: dict[Hashable, _Held] = {}
        self.per_user: dict[Hashable, int] = {}
        """Admitted connections per user, all its processes together."""
        self.refused = 0
        """Connections refused for a limit since start."""
        self._by_fd: dict[int, Hashable] = {}
        self._sock = sock
        # A plain (not asyncio) PAIR, read to the end from a loop reader and before each ZAP
        # verdict: libzmq queues a connection's accept event before its handshake starts, so a
        # verdict finds every connection accepted until then counted.
        address = f"inproc://kvsidecar-connections-{id(self):x}"
        sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(
            zmq.PAIR
        )
        self._monitor.connect(address)
        self._base_fds = open_fd_count()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._monitor.FD, self._drain)
        self._drain()

    def admitted(self, peer: Hashable) -> int:
        """Return the connections of ``peer`` (`peer_of_address`) admitted and still open."""
        held = self.per_peer.get(peer)
        return 0 if held is None else held.admitted

    def admit(self, address: bytes) -> str:
        """Why a new connection from ``address`` must be refused; "" to let it in."""
        self._drain()  # the asking connection is counted now: its accept event came first
        # No peer may take more than a quarter of the total, nor a user more than its share, so
        # that neither one process nor one user's many processes can crowd out the rest.
        total_cap = min(self.max_total, (fd_soft_limit() - self._base_fds) // 4)
        user_cap = max(1, total_cap // self.users)
        peer_cap = min(self.max_per_peer, max(1, total_cap // 4), user_cap)
        key = peer_of_address(address)
        user = user_of(key)
        why = ""
        if self.admitted(key) >= peer_cap:
            why = f"{peer_cap} connections from this peer already"
        elif self.per_user.get(user, 0) >= user_cap:
            why = f"{user_cap} connections of this user already (its share of {total_cap})"
        elif self.total > total_cap:
            why = f"{self.total} connections open (limit {total_cap})"
        held = self.per_peer.setdefault(key, _Held())
        if held.waiting:
            held.waiting -= 1
        else:  # a disconnect was taken for a waiting one: it was an admitted one
            self._admitted(key, held, -1)
        if why:
            self.refused += 1
            held.refused += 1
        else:
            self._admitted(key, held, +1)
        return why

    def _admitted(self, key: Hashable, held: _Held, n: int) -> None:
        n = max(n, -held.admitted)
        held.admitted += n
        user = user_of(key)
        left = self.per_user.get(user, 0) + n
        if left > 0:
            self.per_user[user] = left
        else:
            self.per_user.pop(user, None)

    def _drain(self) -> None:
        """Count every event the monitor holds (to the end: its descriptor is edge-triggered)."""
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing more (EAGAIN), or closed
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            self._forget(fd)  # a disconnect, or a number reused before its disconnect was read
            if event["event"] == zmq.EVENT_ACCEPTED:
                key = _peer_of_fd(fd)
                self._by_fd[fd] = key
                self.per_peer.setdefault(key, _Held()).waiting += 1
                self.total += 1

    def _forget(self, fd: int) -> None:
        key = self._by_fd.pop(fd, _GONE)
        if key is _GONE:
            return
        self.total -= 1
        held = self.per_peer[key]
        if held.refused:
            held.refused -= 1
        elif held.waiting:
            held.waiting -= 1
        else:
            self._admitted(key, held, -1)
        if not (held.waiting or held.admitted or held.refused):
            del self.per_peer[key]

    async def close(self) -> None:
        """Stop following the monitor (before the socket closes)."""
        self._loop.remove_reader(self._monitor.FD)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)


_GONE = object()
