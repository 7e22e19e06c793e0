"""The fd channel's wire format and the worker's end of it.

ZeroMQ cannot carry fds, so shared-memory fds travel on a Unix stream socket (SCM_RIGHTS) while
the registration that describes them travels over ZMQ; both carry the same random token. The
daemon's end, with its limits, is `kvsidecar.memory.fd_channel.FdChannelServer`.

Framing, one message per ``sendmsg`` (its fds ride with its first byte)::

    b"KVFD" | token length (u8) | fd count (u8) | token
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Collection, Sequence

import msgspec

from kvsidecar.memory.base import HandleError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_FDS",
    "FdChannelClient",
    "FdSource",
    "PeerCred",
    "close_all",
    "materialize",
    "new_token",
    "peer_cred",
    "recv_fds",
    "send_fds",
]

MAGIC = b"KVFD"
"""First bytes of every fd-channel message."""
HEADER = struct.Struct("!4sBB")
"""Magic, token length, fd count."""
MAX_FDS = 253
"""Most fds one message can carry (the kernel's SCM_MAX_FD)."""


def new_token() -> bytes:
    """Return a fresh random token that ties an fd message to its ZMQ registration."""
    return os.urandom(16)


class PeerCred(msgspec.Struct, frozen=True):
    """Credentials of the process at the other end, as the kernel saw them at connect time."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """Return the credentials of the peer of ``sock`` (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def _frame(token: bytes, nfds: int) -> bytes:
    if not 0 < len(token) <= 255:
        raise HandleError("bad_request", "a token is 1 to 255 bytes")
    if nfds > MAX_FDS:
        raise HandleError("bad_request", f"at most {MAX_FDS} fds per message, not {nfds}")
    return HEADER.pack(MAGIC, len(token), nfds) + token


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
        magic, token_len, nfds = HEADER.unpack(_recv_exact(sock, HEADER.size, fds))
        if magic != MAGIC or token_len == 0:
            raise HandleError("protocol", "not an fd-channel message")
        token = _recv_exact(sock, token_len, fds)
        if len(fds) != nfds:
            raise HandleError("protocol", f"header announced {nfds} fds, {len(fds)} arrived")
    except BaseException:
        close_all(fds)
        raise
    return token, fds


def close_all(fds: Collection[int]) -> None:
    """Close every fd of ``fds``, ignoring ones already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
        close_all(owned)
        raise
    return fds, owned


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
                close_all(owned)
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
