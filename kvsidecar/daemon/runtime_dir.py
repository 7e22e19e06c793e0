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


def private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check that an existing one is ours and private.

    Never through a symbolic link: the default ``/tmp/kvsidecar-<uid>`` lives in a directory
    where anyone may plant one, and following it would make the daemon re-mode (and bind its
    sockets in) whatever it points to. The checks run on a descriptor opened with
    ``O_NOFOLLOW``, so what is checked is what is re-moded.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
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
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def lock_runtime_dir(runtime_dir: str) -> int:
    """Hold ``<runtime_dir>/daemon.lock`` for the daemon's life; refuse if another daemon does.

    The kernel drops the lock when its holder dies (SIGKILL included), so a stale lock file
    never blocks a restart; while the lock is held, nothing here touches the sockets.
    """
    path = os.path.join(runtime_dir, "daemon.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"kvsidecar: a daemon already serves {runtime_dir}") from None
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
