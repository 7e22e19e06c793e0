"""No worker can crash the daemon with memory it can pull away.

A worker that registers memory it can still shrink (an unsealed memfd, a file on disk or on
tmpfs) and then truncates it would make the daemon's next copy touch pages that no longer exist:
SIGBUS, and every engine goes with the daemon. The attacker here is a plain process: it sends its
fd with a raw SCM_RIGHTS message and registers with a raw ZeroMQ request, then shrinks the file
and asks for a copy. The daemon must refuse every fd that can shrink (or is not memory at all) at
registration, with a typed error, and keep serving; a memfd sealed against shrinking is the
control case that must still work.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from collections.abc import Callable, Iterator

import pytest

from kvsidecar.wire.protocol import Error, Move, Moved, Registered, Status, StatusReply
from kvsidecar.wire.types import BufferSetRef, WorkerRef
from tests.support.daemons import DaemonProcess, StartDaemon
from tests.support.raw import Raw, ids, kv_descriptor, register_fd, sealed_memfd

pytestmark = pytest.mark.timeout(120)

_, NBYTES = kv_descriptor()


def _memfd(flags: int, seals: int) -> int:
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | flags)
    os.ftruncate(fd, NBYTES)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _huge_memfd() -> int:
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    os.ftruncate(fd, 2 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _file(directory: str) -> int:
    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    os.ftruncate(fd, NBYTES)
    return fd


def _socket_fd() -> int:
    a, b = socket.socketpair()
    b.close()
    return a.detach()


def _pipe_fd() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


SHRINKABLE: dict[str, Callable[[], int]] = {
    "memfd_unsealed": lambda: _memfd(os.MFD_ALLOW_SEALING, 0),
    "memfd_no_sealing_allowed": lambda: _memfd(0, 0),
    "memfd_sealed_against_grow_only": lambda: _memfd(os.MFD_ALLOW_SEALING, fcntl.F_SEAL_GROW),
    "memfd_sealed_against_sealing_only": lambda: _memfd(os.MFD_ALLOW_SEALING, fcntl.F_SEAL_SEAL),
    "file_on_disk": lambda: _file(os.path.dirname(os.path.abspath(__file__))),
    "file_on_tmpfs": lambda: _file("/dev/shm"),
}
FAULTING: dict[str, Callable[[], int]] = {
    # Sealed against shrinking, but each first touch needs a free huge page (there are none).
    "memfd_huge_pages_sealed": _huge_memfd,
}
NOT_MEMORY: dict[str, Callable[[], int]] = {
    "pipe": _pipe_fd,
    "socket": _socket_fd,
    "dev_zero": lambda: os.open("/dev/zero", os.O_RDWR),
    "directory": lambda: os.open("/", os.O_RDONLY | os.O_DIRECTORY),
}


@pytest.fixture
def daemon(daemon_factory: StartDaemon) -> DaemonProcess:
    # One per test: on unfixed code the first truncation kills it (SIGBUS, exit -7).
    return daemon_factory(host_pool_bytes=8 << 20)


def _alive(d: DaemonProcess) -> None:
    assert d.proc.poll() is None, f"daemon died ({d.proc.returncode}):\n{d.log()[-3000:]}"
    with Raw(d.config.endpoint) as raw:
        assert isinstance(raw.call(Status(id=1), timeout=10), StatusReply)


def _offload(raw: Raw, engine: str) -> object:
    src = BufferSetRef(WorkerRef(engine))
    dst = BufferSetRef(WorkerRef(engine), medium="host")
    try:
        return raw.call(Move(id=raw.next_id(), src=src, dst=dst), ids(0, 1, 2, 3), ids(0, 1, 2, 3))
    except TimeoutError:
        return None  # no reply: `_alive` tells why


@contextlib.contextmanager
def _owned(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", sorted(SHRINKABLE))
def test_shrinkable_memory_is_refused_and_truncating_it_crashes_nothing(
    daemon: DaemonProcess, kind: str
) -> None:
    with _owned(SHRINKABLE[kind]()) as fd, Raw(daemon.config.endpoint) as raw:
        reply, conn = register_fd(raw, daemon.config.fd_socket, kind, fd, host_blocks=4)
        with conn:
            # Whatever the daemon said, pull the memory away and ask for a copy of it.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            moved = _offload(raw, kind)
            _alive(daemon)
            assert isinstance(reply, Error), f"{kind} was registered: {reply}"
            assert reply.code == "handle_error" and "shrink" in reply.message, reply
            assert isinstance(moved, Error) and moved.code == "unknown_engine", moved


@pytest.mark.parametrize("kind", sorted(FAULTING))
def test_memory_whose_pages_can_fail_to_appear_is_refused(daemon: DaemonProcess, kind: str) -> None:
    with _owned(FAULTING[kind]()) as fd, Raw(daemon.config.endpoint) as raw:
        reply, conn = register_fd(raw, daemon.config.fd_socket, kind, fd, host_blocks=4)
        with conn:
            moved = _offload(raw, kind)
            _alive(daemon)
            # (held before the fix too: with no huge page free, the mapping itself fails)
            assert isinstance(reply, Error) and reply.code == "handle_error", reply
            assert isinstance(moved, Error) and moved.code == "unknown_engine", moved


@pytest.mark.parametrize("kind", sorted(NOT_MEMORY))
def test_fds_that_are_not_memory_are_refused(daemon: DaemonProcess, kind: str) -> None:
    with _owned(NOT_MEMORY[kind]()) as fd, Raw(daemon.config.endpoint) as raw:
        reply, conn = register_fd(raw, daemon.config.fd_socket, kind, fd)
        conn.close()
        assert isinstance(reply, Error) and reply.code == "handle_error", reply
        _alive(daemon)


def test_memfd_sealed_against_shrinking_is_served(daemon: DaemonProcess) -> None:
    """The control case: the memory an honest worker sends cannot be pulled away."""
    with _owned(sealed_memfd(NBYTES, fill=7)) as fd, Raw(daemon.config.endpoint) as raw:
        reply, conn = register_fd(raw, daemon.config.fd_socket, "sealed", fd, host_blocks=4)
        with conn:
            assert isinstance(reply, Registered), reply
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            assert isinstance(_offload(raw, "sealed"), Moved)
            _alive(daemon)
