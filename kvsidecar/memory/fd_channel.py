"""The fd channel: a Unix stream socket that carries file descriptors from workers to the daemon.

ZeroMQ cannot carry fds, so shared-memory fds travel here (SCM_RIGHTS) while the registration that
describes them travels over ZMQ. Both carry the same random token, which is how the daemon matches
them. A worker keeps its channel connection open for its whole life: the daemon reads the
connection's end (EOF) as "that worker process is gone", the kernel's own word, sooner and surer
than a lease.

Framing, one message per ``sendmsg`` (its fds ride with its first byte)::

    b"KVFD" | token length (u8) | fd count (u8) | token
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import resource
import socket
import stat
import struct
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import msgspec

from kvsidecar.memory.base import HandleError

__all__ = [
    "MAX_FDS",
    "FdChannelClient",
    "FdChannelServer",
    "FdConnection",
    "FdSource",
    "PeerCred",
    "materialize",
    "new_token",
    "raise_fd_limit",
    "recv_fds",
    "send_fds",
]

log = logging.getLogger(__name__)

_MAGIC = b"KVFD"
_HEADER = struct.Struct("!4sBB")
MAX_FDS = 253
"""Most fds one message can carry (the kernel's SCM_MAX_FD)."""
_MAX_PENDING = 1024
"""Unclaimed deliveries kept per connection before it is treated as misbehaving."""


FdSource = int | Callable[[], int]
"""An fd to send: a borrowed fd (an shm storage's: the sender never closes it), or a call that
exports a new one (a CUDA VMM chunk's: owned, closed once sent)."""


def materialize(batch: Sequence[FdSource]) -> tuple[list[int], list[int]]:
    """Turn `FdSource` s into fds: ``(every fd in order, the new ones to close once sent)``.

    If an export fails, the fds made so far are closed before the error goes on.
    """
    fds: list[int] = []
    owned: list[int] = []
    try:
        for source in batch:
            if isinstance(source, int):
                fds.append(source)
            else:
                fd = source()
                owned.append(fd)
                fds.append(fd)
    except BaseException:
        _close_all(owned)
        raise
    return fds, owned


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open fds to its hard limit; returns the new limit.

    A registration may carry thousands of fds (one per CUDA VMM chunk) that the daemon holds
    until it maps them; the usual soft limit of 1024 would refuse them (``EMFILE``).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def new_token() -> bytes:
    """Return a fresh random token that ties an fd message to its ZMQ registration."""
    return os.urandom(16)


class PeerCred(msgspec.Struct, frozen=True):
    """Credentials of the process at the other end, as the kernel saw them at connect time."""

    pid: int
    uid: int
    gid: int


def _peer_cred(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def _frame(token: bytes, nfds: int) -> bytes:
    if not 0 < len(token) <= 255:
        raise HandleError("bad_request", "a token is 1 to 255 bytes")
    if nfds > MAX_FDS:
        raise HandleError("bad_request", f"at most {MAX_FDS} fds per message, not {nfds}")
    return _HEADER.pack(_MAGIC, len(token), nfds) + token


def send_fds(sock: socket.socket, token: bytes, fds: Sequence[int]) -> None:
    """Send one message: ``token`` and ``fds`` (which stay open here; the peer gets copies)."""
    frame = _frame(token, len(fds))
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
        # The fds went with the first chunk; the rest is plain bytes.
        sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    """Read exactly ``n`` bytes, collecting any fds that come with them into ``fds``."""
    buf = b""
    while len(buf) < n:
        data, got, flags, _ = socket.recv_fds(sock, n - len(buf), MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise HandleError("protocol", "fds were truncated by the kernel")
        if not data:
            raise EOFError("fd channel closed")
        buf += data
    return buf


def recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Receive one message from a blocking socket: its token and the fds (now owned by the caller).

    Raises `EOFError` when the peer closed the connection, `HandleError` (code ``"protocol"``)
    on a malformed message (any fds received with it are closed).
    """
    fds: list[int] = []
    try:
        magic, token_len, nfds = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
        if magic != _MAGIC or token_len == 0:
            raise HandleError("protocol", "not an fd-channel message")
        token = _recv_exact(sock, token_len, fds)
        if len(fds) != nfds:
            raise HandleError("protocol", f"header announced {nfds} fds, {len(fds)} arrived")
    except BaseException:
        _close_all(fds)
        raise
    return token, fds


def _close_all(fds: Collection[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class FdChannelClient:
    """The worker's end: a blocking connection kept open for the worker's whole life.

    Closing it (or the process dying) tells the daemon to release everything the worker
    registered through it.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 5.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(os.fspath(path))
            # Blocking from here on: a timeout socket would make peer_closed() poll first.
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise

    def send(self, token: bytes, fds: Sequence[int]) -> None:
        """Send ``fds`` under ``token`` (the same token goes into the ZMQ registration)."""
        send_fds(self._sock, token, fds)

    def send_all(self, sources: Sequence[FdSource]) -> list[bytes]:
        """Send any number of fds, `MAX_FDS` per message; returns the tokens, in order.

        Each batch's exported fds are made just before it goes and closed right after, so a
        worker holds at most `MAX_FDS` of them whatever the total (see `FdSource`). No fds at
        all still sends one message: it ties the registration to this connection, whose end
        tells the daemon the worker is gone.
        """
        tokens = []
        for start in range(0, max(len(sources), 1), MAX_FDS):
            fds, owned = materialize(sources[start : start + MAX_FDS])
            try:
                token = new_token()
                self.send(token, fds)
            finally:
                _close_all(owned)
            tokens.append(token)
        return tokens

    def peer_closed(self) -> bool:
        """Return True if the daemon closed its end (it never writes, so readable means EOF)."""
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return not data

    def fileno(self) -> int:
        """Return the socket's fd, for a poller that wants to learn of the daemon's exit."""
        return self._sock.fileno()

    def close(self) -> None:
        """Close the connection; idempotent."""
        self._sock.close()

    def __enter__(self) -> FdChannelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FdConnection:
    """One worker connection as the daemon sees it: who is there and what it sent."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, cred: PeerCred) -> None:
        self.id = next(self._ids)
        """Process-unique number of this connection."""
        self.cred = cred
        """The peer's pid, uid and gid (SO_PEERCRED)."""
        self.tokens: set[bytes] = set()
        """Tokens received on this connection (claimed or not)."""
        self.closed = False
        """True once the connection ended (peer exit, peer close, protocol error, server close)."""
        self.sock = sock
        self.buf = bytearray()
        self.fds: list[int] = []

    def __repr__(self) -> str:
        c = self.cred
        return f"<FdConnection #{self.id} pid={c.pid} uid={c.uid} closed={self.closed}>"


OnClose = Callable[[FdConnection], None]


class FdChannelServer:
    """The daemon's end: accepts worker connections on a Unix socket path and collects their fds.

    Deliveries wait until claimed with `take` (the ZMQ registration may come before or after its
    fds). ``on_close(conn)`` runs on the event loop when a connection ends, at once on the peer's
    exit, SIGKILL included: that is the daemon's signal to release the worker's mappings. Unclaimed
    fds of a closed connection are closed.

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
    ) -> None:
        self.path = Path(path)
        self._on_close = on_close
        self._allowed = frozenset(allowed_uids) if allowed_uids is not None else {os.geteuid()}
        self._mode = mode
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, FdConnection] = {}
        self._pending: dict[bytes, tuple[FdConnection, list[int]]] = {}
        self._waiters: dict[bytes, asyncio.Future[tuple[FdConnection, list[int]]]] = {}

    @property
    def connections(self) -> list[FdConnection]:
        """The open connections."""
        return list(self._conns.values())

    async def start(self) -> None:
        """Bind and listen; a stale socket file at ``path`` (from a dead daemon) is replaced."""
        if self._listener is not None:
            return
        raise_fd_limit()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(os.fspath(self.path))
            os.chmod(self.path, self._mode)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)

    async def take(self, token: bytes, timeout: float) -> tuple[FdConnection, list[int]]:
        """Wait up to ``timeout`` s for the fds sent under ``token``; the caller then owns them.

        Raises `TimeoutError` if they did not come in time, `HandleError` (``"closed"``) if the
        server closed meanwhile.
        """
        if token in self._pending:
            return self._pending.pop(token)
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
        assert self._listener is not None and self._loop is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("fd channel: accept failed: %s", e)
                return
            cred = _peer_cred(sock)
            if cred.uid not in self._allowed:
                log.warning("fd channel: refused pid %d (uid %d)", cred.pid, cred.uid)
                sock.close()
                continue
            sock.setblocking(False)
            conn = FdConnection(sock, cred)
            self._conns[conn.id] = conn
            self._loop.add_reader(sock.fileno(), self._readable, conn)

    def _readable(self, conn: FdConnection) -> None:
        while not conn.closed:
            try:
                data, fds, flags, _ = socket.recv_fds(
                    conn.sock, 4096, MAX_FDS, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._drop(conn, f"receive failed: {e}")
                return
            conn.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                self._drop(conn, "fds truncated")
                return
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
        while len(conn.buf) >= _HEADER.size:
            magic, token_len, nfds = _HEADER.unpack_from(conn.buf)
            if magic != _MAGIC or token_len == 0:
                raise HandleError("protocol", "not an fd-channel message")
            end = _HEADER.size + token_len
            if len(conn.buf) < end:
                return
            # A message's fds arrive with its first byte, so they are all here by now.
            if len(conn.fds) < nfds:
                raise HandleError("protocol", f"header announced {nfds} fds, fewer arrived")
            token = bytes(conn.buf[_HEADER.size : end])
            del conn.buf[:end]
            fds, conn.fds = conn.fds[:nfds], conn.fds[nfds:]
            self._deliver(conn, token, fds)

    def _deliver(self, conn: FdConnection, token: bytes, fds: list[int]) -> None:
        if token in self._pending or token in conn.tokens:
            log.warning("fd channel: duplicate token from pid %d ignored", conn.cred.pid)
            _close_all(fds)
            return
        conn.tokens.add(token)
        waiter = self._waiters.pop(token, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((conn, fds))
            return
        if sum(1 for c, _ in self._pending.values() if c is conn) >= _MAX_PENDING:
            _close_all(fds)
            raise HandleError("protocol", "too many unclaimed deliveries")
        self._pending[token] = (conn, fds)

    def _drop(self, conn: FdConnection, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        log.debug("fd channel: connection #%d (pid %d) ended: %s", conn.id, conn.cred.pid, why)
        if self._loop is not None:
            self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()
        del self._conns[conn.id]
        _close_all(conn.fds)
        conn.fds.clear()
        for token in [t for t, (c, _) in self._pending.items() if c is conn]:
            _close_all(self._pending.pop(token)[1])
        if self._on_close is not None:
            try:
                self._on_close(conn)
            except Exception:
                log.exception("fd channel: on_close callback failed")
