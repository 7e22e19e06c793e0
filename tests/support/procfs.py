"""What ``/proc`` and ``/dev/shm`` say about a process: memory, mappings, open fds, segments.

For leak checks: take a reading before, do the thing, compare after.
"""

from __future__ import annotations

import gc
import os


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS``; ``VmHWM``: its peak so far)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid} (a zombie?)")


_FOREIGN = ("psm_", "sem.")
"""Names Python's ``multiprocessing`` gives its segments and semaphores. Neither kvsidecar nor its
tests use it, but other programs on a shared machine do (a vLLM engine started meanwhile), and
their segments come and go on their own schedule."""


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` that kvsidecar or torch could create: a test that leaves one
    behind leaked a segment."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith(_FOREIGN)}


def memfd_mappings(pid: int, name: str = "kvsidecar") -> int:
    """How many mappings of process ``pid`` are of memfds called ``name``."""
    with open(f"/proc/{pid}/maps") as fh:
        return sum(1 for line in fh if f"memfd:{name}" in line)


def fd_count(pid: int | str = "self") -> int:
    """How many fds process ``pid`` (default: this one) has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_fds() -> set[str]:
    """This process's open fds (by target), after collecting garbage that may still hold some.

    Compared as sets: an fd that an earlier test's garbage closes meanwhile is not a leak, and a
    new fd left open is one, whatever else changed.
    """
    gc.collect()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:  # the listing's own directory fd
            continue
    return fds


def mapped_inodes() -> list[tuple[int, int, int]]:
    """(major, minor, inode) of every file-backed mapping of this process, one per mapping line."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[4] != "0":
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                found.append((major, minor, int(parts[4])))
    return found
