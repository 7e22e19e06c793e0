"""The fd channel's daemon end: worker connections, their fds, and the limits that keep it safe.

ZeroMQ cannot carry fds, so shared-memory fds travel on this Unix stream socket (SCM_RIGHTS; the
wire format and the worker's end are in `kvsidecar.memory.fd_client`) while the registration
that describes them travels over ZMQ. Both carry the same random token, which is how the daemon
matches them. A worker keeps its connection open for its whole life: the daemon reads its end
(EOF) as "that worker process is gone", the kernel's own word, sooner and surer than a lease.

Each connection, and each fd received but not yet claimed, is one of the daemon's descriptors;
`kvsidecar.memory.fd_limits` says how many each peer may hold and who gives way at a total limit.
Messages are read one at a time (a header, then its token), so the fds that arrive with a
message's first byte belong to it alone: when the kernel could not pass them all (``MSG_CTRUNC``,
the daemon being short of descriptors), only that message fails, with a typed ``busy`` error for
its registration, and the connection, maybe a live worker's, stays. When ``accept`` fails for
lack of descriptors the listener pauses (back-off 50 ms to 1 s, a log line a minute).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.memory.base import HandleError
from kvsidecar.memory.fd_client import (
    HEADER,
    MAGIC,
    MAX_FDS,
    PeerCred,
    close_all,
    peer_cred,
)
from kvsidecar.memory.fd_limits import FdLimits, FdStats, Ledger, PeerKey, open_fd_count

__all__ = ["FdChannelServer", "FdConnection"]

log = logging.getLogger(__name__)

_TURN = 16
"""Messages read from one connection, and connections accepted, per loop turn."""
_FAILED_MEMORY = 1024
"""Tokens whose fds were refused or lost, remembered so that their registration fails at once."""
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class FdConnection:
    """One worker connection as the daemon sees it: who is there and what it sent."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, cred: PeerCred) -> None:
        self.id = next(self._ids)
        """Process-unique number of this connection."""
        self.cred = cred
        """The peer's pid, uid and gid (SO_PEERCRED); ``key`` is its (uid, pid)."""
        self.key: PeerKey = (cred.uid, cred.pid)
        self.tokens: set[bytes] = set()
        """Tokens of this connection claimed by a registration."""
        self.closed = False
        """True once the connection ended (peer exit, peer close, protocol error, server close)."""
        self.sock = sock
        self.buf = bytearray()
        """The message being read (header, then token)."""
        self.fds: list[int] = []
        """Fds that came with the message being read."""
        self.truncated = False
        """The kernel dropped fds of the message being read (MSG_CTRUNC)."""
        self.pending = 0
        """Deliveries of this connection waiting to be claimed."""
        self.last_active = time.monotonic()

    @property
    def bound(self) -> bool:
        """Whether a registration claimed fds of this connection (a worker's life line)."""
        return bool(self.tokens)

    def __repr__(self) -> str:
        return f"<FdConnection #{self.id} {self.cred} closed={self.closed}>"


OnClose = Callable[[FdConnection], None]


@dataclass(eq=False, slots=True)
class _Delivery:
    conn: FdConnection
    fds: list[int]
    deadline: float

    @property
    def weight(self) -> int:
        return max(1, len(self.fds))  # a message without fds still takes memory: it counts


class FdChannelServer:
    """The daemon's end: accepts worker connections on a Unix socket path and collects their fds.

    Deliveries wait until claimed with `take` (the ZMQ registration may come before or after its
    fds), at most ``limits.unclaimed_s``. ``on_close(conn)`` runs on the event loop when a
    connection ends, at once on the peer's exit, SIGKILL included: that is the daemon's signal to
    release the worker's mappings. Unclaimed fds of a closed connection are closed.

    Only peers whose uid is in ``allowed_uids`` (default: this process's effective uid) are kept;
    the socket file gets ``mode`` (default owner-only).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        on_close: OnClose | None = None,
        allowed_uids: Collection[int] | None = None,
        mode: int = 0o600,
        limits: FdLimits | None = None,
    ) -> None:
        self.path = Path(path)
        self._on_close = on_close
        self._allowed = frozenset(allowed_uids) if allowed_uids is not None else {os.geteuid()}
        self._mode = mode
        self.limits = limits or FdLimits()
        self.ledger = Ledger(self.limits, budget=0)
        self.stats = FdStats()
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, FdConnection] = {}
        self._pending: dict[bytes, _Delivery] = {}
        self._waiters: dict[bytes, asyncio.Future[tuple[FdConnection, list[int]]]] = {}
        self._failed: collections.OrderedDict[bytes, tuple[str, float]] = collections.OrderedDict()
        self._base_fds = 0
        self._backoff = 0.0
        self._sweeper: asyncio.Task[None] | None = None
        self._logged: dict[str, float] = {}

    @property
    def connections(self) -> list[FdConnection]:
        """The open connections."""
        return list(self._conns.values())

    async def start(self) -> None:
        """Bind and listen; a stale socket file at ``path`` (from a dead daemon) is replaced."""
        if self._listener is not None:
            return
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(os.fspath(self.path))
            os.chmod(self.path, self._mode)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise SystemExit(
                f"kvsidecar: cannot bind the fd channel {self.path}: {exc.strerror}"
            ) from None
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._base_fds = open_fd_count()
        self.ledger.refresh_budget(self._base_fds)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="kvsidecar-fd-sweep")

    async def take(self, token: bytes, timeout: float) -> tuple[FdConnection, list[int]]:
        """Wait up to ``timeout`` s for the fds sent under ``token``; the caller then owns them.

        Raises `TimeoutError` if they did not come in time, `HandleError` with code ``"busy"``
        if they were refused or lost for lack of room (retry), ``"closed"`` if the server closed.
        """
        delivery = self._pending.pop(token, None)
        if delivery is not None:
            self._unpend(delivery)
            self._claimed(delivery.conn, token)
            return delivery.conn, delivery.fds
        failed = self._failed.get(token)
        if failed is not None:
            raise HandleError("busy", failed[0])
        if token in self._waiters:
            raise HandleError("bad_request", "someone already waits for this token")
        fut: asyncio.Future[tuple[FdConnection, list[int]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiters[token] = fut
        try:
            await asyncio.wait({fut}, timeout=timeout)
        finally:
            if self._waiters.get(token) is fut:
                del self._waiters[token]
        # Checked after the wait: a delivery can only land from a loop callback, never in between.
        if fut.done():
            return fut.result()
        fut.cancel()
        raise TimeoutError(f"no fds arrived for the token within {timeout} s")

    async def close(self) -> None:
        """Stop listening, drop every connection (running ``on_close``), close unclaimed fds."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._listener is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for conn in list(self._conns.values()):
            self._drop(conn, "server closed")
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(HandleError("closed", "the fd channel server closed"))
        self._waiters.clear()

    async def __aenter__(self) -> FdChannelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        self.ledger.refresh_budget(self._base_fds)  # an operator may change the limit meanwhile
        for _ in range(_TURN):  # the rest wait in the backlog for the next turn
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._pause_accept(exc)
                else:
                    self._warn("accept", "fd channel: accept failed: %s", exc)
                return
            self._backoff = 0.0
            self._admit(sock)

    def _pause_accept(self, exc: OSError) -> None:
        """Stop accepting for a while: the listener stays readable, so retrying now would spin."""
        assert self._listener is not None and self._loop is not None
        self.stats.accept_errors += 1
        self._backoff = min(1.0, max(0.05, self._backoff * 2))
        self._loop.remove_reader(self._listener.fileno())
        self._loop.call_later(self._backoff, self._resume_accept)
        self._warn(
            "out_of_fds",
            "fd channel: cannot accept (%s); %d descriptors held for %d connections; "
            "pausing %.2f s (%d such pauses so far)",
            exc.strerror,
            self.ledger.held,
            len(self._conns),
            self._backoff,
            self.stats.accept_errors,
        )

    def _resume_accept(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)
            self._accept()

    def _admit(self, sock: socket.socket) -> None:
        assert self._loop is not None
        cred = peer_cred(sock)
        if cred.uid not in self._allowed:
            refusal = f"uid {cred.uid} not allowed"
        else:
            refusal = self.ledger.peer_may_connect((cred.uid, cred.pid))
        if not refusal and self.ledger.connections_full() and not self._evict_connection():
            refusal = f"{self.ledger.total_connections} connections, {self.ledger.held} fds held"
        if refusal:
            self.stats.refused_connections += 1
            self._warn(
                "refused", "fd channel: refused pid %d (uid %d): %s", cred.pid, cred.uid, refusal
            )
            sock.close()
            return
        sock.setblocking(False)
        conn = FdConnection(sock, cred)
        self._conns[conn.id] = conn
        self.ledger.add_connection(conn.key)
        self._loop.add_reader(sock.fileno(), self._readable, conn)

    def _evict_connection(self) -> bool:
        """Make room by closing the biggest holder's oldest connection that registered nothing."""
        count = self.ledger.connections
        victims = [c for c in self._conns.values() if not c.bound]
        if not victims:
            return False
        victim = max(victims, key=lambda c: (count.get(c.key, 0), -c.id))
        self.stats.evicted += 1
        self._drop(victim, "evicted: connection limit reached")
        return True

    def _drop(self, conn: FdConnection, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        log.debug("fd channel: connection #%d (pid %d) ended: %s", conn.id, conn.cred.pid, why)
        if self._loop is not None:
            self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()
        del self._conns[conn.id]
        self.ledger.add_connection(conn.key, -1)
        close_all(conn.fds)
        conn.fds.clear()
        for token in [t for t, d in self._pending.items() if d.conn is conn]:
            delivery = self._pending.pop(token)
            self._unpend(delivery)
            close_all(delivery.fds)
        if self._on_close is not None:
            try:
                self._on_close(conn)
            except Exception:
                log.exception("fd channel: on_close callback failed")

    def _readable(self, conn: FdConnection) -> None:
        for _ in range(_TURN):  # level-triggered: what is left is read next turn
            if conn.closed:
                return
            try:
                data, fds, flags, _ = socket.recv_fds(
                    conn.sock, _missing(conn.buf), MAX_FDS, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._drop(conn, f"receive failed: {e}")
                return
            conn.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                conn.truncated = True
            if not data:
                self._drop(conn, "peer closed")
                return
            conn.buf += data
            try:
                self._parse(conn)
            except HandleError as e:
                self._drop(conn, str(e))
                return

    def _parse(self, conn: FdConnection) -> None:
        if len(conn.buf) < HEADER.size:
            return
        magic, token_len, nfds = HEADER.unpack_from(conn.buf)
        if magic != MAGIC or token_len == 0:
            raise HandleError("protocol", "not an fd-channel message")
        if len(conn.buf) < HEADER.size + token_len:
            return
        token = bytes(conn.buf[HEADER.size :])
        fds, truncated = conn.fds, conn.truncated
        conn.buf, conn.fds, conn.truncated = bytearray(), [], False
        conn.last_active = time.monotonic()
        if truncated:
            # The daemon was short of descriptors when the message came: not the sender's fault,
            # so only this message fails; the connection (maybe a live worker's) stays.
            close_all(fds)
            self.stats.truncated += 1
            self._refuse(conn, token, "its fds were lost: the daemon is short of descriptors")
            return
        if len(fds) != nfds:
            close_all(fds)
            raise HandleError("protocol", f"header announced {nfds} fds, {len(fds)} arrived")
        self._deliver(conn, token, fds)

    def _deliver(self, conn: FdConnection, token: bytes, fds: list[int]) -> None:
        if token in self._pending or token in self._failed or token in conn.tokens:
            self._warn(
                "duplicate", "fd channel: duplicate token from pid %d ignored", conn.cred.pid
            )
            close_all(fds)
            return
        waiter = self._waiters.pop(token, None)
        if waiter is not None and not waiter.done():
            self._claimed(conn, token)
            waiter.set_result((conn, fds))
            return
        delivery = _Delivery(conn, fds, time.monotonic() + self.limits.unclaimed_s)
        why = self._room_for(conn.key, delivery.weight)
        if why:
            close_all(fds)
            self._refuse(conn, token, why)
            return
        self._pending[token] = delivery
        conn.pending += 1
        self.ledger.add_unclaimed(conn.key, delivery.weight)

    def _room_for(self, key: PeerKey, weight: int) -> str:
        """Make room for ``weight`` more unclaimed fds of ``key``; why not, or "" when there is."""
        ledger = self.ledger
        ledger.refresh_budget(self._base_fds)
        if refusal := ledger.peer_may_hold(key, weight):
            return refusal
        while ledger.unclaimed_full(weight):
            # The biggest holder gives way, as long as it holds more than this peer would.
            top = ledger.biggest(ledger.unclaimed, (d.conn.key for d in self._pending.values()))
            if top is None or ledger.unclaimed[top] <= ledger.unclaimed.get(key, 0) + weight:
                return f"{ledger.total_unclaimed} unclaimed fds and {ledger.held} in all held"
            token = next(t for t, d in self._pending.items() if d.conn.key == top)
            evicted = self._pending.pop(token)
            self._unpend(evicted)
            close_all(evicted.fds)
            self.stats.evicted += 1
            self._remember_failed(token, "evicted: another process needed the room")
        return ""

    def _refuse(self, conn: FdConnection, token: bytes, why: str) -> None:
        """Fail one message's registration with ``busy``; the connection stays."""
        self.stats.refused_deliveries += 1
        self._warn("delivery", "fd channel: message of pid %d refused: %s", conn.cred.pid, why)
        waiter = self._waiters.pop(token, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(HandleError("busy", why))
        else:
            self._remember_failed(token, why)

    def _remember_failed(self, token: bytes, why: str) -> None:
        self._failed[token] = (why, time.monotonic() + self.limits.unclaimed_s)
        while len(self._failed) > _FAILED_MEMORY:
            self._failed.popitem(last=False)

    def _claimed(self, conn: FdConnection, token: bytes) -> None:
        conn.tokens.add(token)
        conn.last_active = time.monotonic()

    def _unpend(self, delivery: _Delivery) -> None:
        delivery.conn.pending -= 1
        self.ledger.add_unclaimed(delivery.conn.key, -delivery.weight)

    async def _sweep_loop(self) -> None:
        period = min(1.0, self.limits.unclaimed_s / 4, self.limits.idle_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Close what expired by ``now``: unclaimed fds, idle connections, failed tokens."""
        for token, delivery in list(self._pending.items()):
            if delivery.deadline > now:
                break  # in arrival order, all with the same lifetime
            del self._pending[token]
            self._unpend(delivery)
            close_all(delivery.fds)
            delivery.conn.last_active = now
            self.stats.expired_deliveries += 1
            self._remember_failed(token, "its fds expired unclaimed")
        while self._failed and next(iter(self._failed.values()))[1] <= now:
            self._failed.popitem(last=False)
        idle = now - self.limits.idle_s
        for conn in list(self._conns.values()):
            if not conn.bound and not conn.pending and conn.last_active < idle:
                self.stats.idle_closed += 1
                self._drop(conn, "idle: registered nothing")

    def _warn(self, kind: str, text: str, *args: object) -> None:
        # A misbehaving peer must not flood the log: one line a minute per kind (counts in stats).
        now = time.monotonic()
        if now - self._logged.get(kind, -1e9) >= 60.0:
            self._logged[kind] = now
            log.warning(text, *args)


def _missing(buf: bytearray) -> int:
    """Bytes still to read of the message in ``buf``: never past its end (see the module)."""
    if len(buf) < HEADER.size:
        return HEADER.size - len(buf)
    return HEADER.size + buf[4] - len(buf)
