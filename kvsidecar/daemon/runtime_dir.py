"""The daemon's runtime directory: created private, held by one daemon, never reached by a link.

The sockets live in ``runtime_dir``. Starting a daemon must neither damage a live one (a refused
start leaves its sockets alone) nor act on another directory through a planted symbolic link.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from pathlib import Path

from kvsidecar.memory.host_pool import HostPool


def claim_runtime_dir(path: Path) -> int:
    """Create ``path`` (mode 0700) or take an existing one that is ours; hold its lock.

    Returns the descriptor of ``<path>/daemon.lock``, ``flock``-ed for the daemon's life (the
    kernel drops the lock when its holder dies, SIGKILL included, so a stale lock file never
    blocks a restart). A start refused here changes nothing: the lock is taken before the
    directory is re-moded, so a second daemon on a live one's directory leaves its mode (which
    its operator may have opened up for another allowed uid), its sockets and its files alone.

    Never through a symbolic link: the default ``/tmp/kvsidecar-<uid>`` lives in a directory
    where anyone may plant one, and following it would make the daemon re-mode (and bind its
    sockets in) whatever it points to. The checks, the lock and the re-mode all go through one
    descriptor opened with ``O_NOFOLLOW``, so what is checked is what is locked and re-moded.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    except OSError as exc:
        raise SystemExit(f"kvsidecar: cannot create runtime_dir {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a symbolic link; ENOTDIR: something else
        raise SystemExit(
            f"kvsidecar: {path} is a symbolic link or not a directory ({exc.strerror}); refusing it"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            # A directory shared with others (a Kubernetes emptyDir: root-owned, mode 0777):
            # a subdirectory of it, which the daemon creates as its own, is the way.
            raise SystemExit(
                f"kvsidecar: {path} belongs to uid {st.st_uid}, not to us; refusing it (for a "
                f"shared directory such as an emptyDir, set runtime_dir to a subdirectory, e.g. "
                f"{path}/daemon)"
            )
        lock = _lock(fd, path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        return lock
    finally:
        os.close(fd)


def _lock(dir_fd: int, path: Path) -> int:
    """Open and ``flock`` ``daemon.lock`` in the directory ``dir_fd``; refuse if it is held."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open("daemon.lock", flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise SystemExit(f"kvsidecar: cannot open {path}/daemon.lock: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"kvsidecar: a daemon already serves {path}") from None
    return fd


def refuse_if_running(*paths: str | None) -> None:
    """Fail fast when another daemon already listens on one of these Unix sockets.

    Checked before binding: libzmq replaces an existing ipc socket file at bind, which would
    take a live daemon's endpoint from it.
    """
    for path in paths:
        if path is None:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except OSError:
            continue
        finally:
            probe.close()
        raise SystemExit(f"kvsidecar: a daemon already listens on {path}")


def make_parent(path: str, setting: str) -> None:
    """Create the directory of a socket at ``path`` (``setting`` names it); one line if it fails."""
    try:
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(
            f"kvsidecar: cannot create the directory of {setting} {path}: {exc.strerror}"
        ) from None


def allocate_pool(nbytes: int) -> HostPool | None:
    """Allocate and touch the host pool of ``nbytes`` (None for 0); one line if it cannot be.

    Allocated and touched up front: a page's first touch costs more than a copy into it. A pool
    larger than the node's memory is refused before it is tried (the kernel would kill the
    daemon while it touches the pages, not refuse the allocation).
    """
    if nbytes <= 0:
        return None
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 0
    if memory and nbytes > memory:
        raise SystemExit(
            f"kvsidecar: host_pool_bytes {nbytes} is more than this node's memory ({memory} bytes)"
        )
    try:
        return HostPool(nbytes)
    except (MemoryError, RuntimeError) as exc:  # torch's allocator raises RuntimeError
        raise SystemExit(
            f"kvsidecar: cannot allocate the host pool of {nbytes} bytes: "
            f"{str(exc).splitlines()[0][:200]}"
        ) from None
