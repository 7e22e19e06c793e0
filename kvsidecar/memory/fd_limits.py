"""Bounds of the fd channel: how many connections and unclaimed fds each peer may hold.

Every connection and every fd received but not yet claimed by a registration is a descriptor of
the daemon's own. Unbounded, one local process could take them all: the daemon then cannot accept
workers, and libzmq 4.3 aborts the whole process when its ipc listener meets ``EMFILE``. So the
fd channel (`kvsidecar.memory.fd_channel.FdChannelServer`) keeps a `Ledger` of what each peer
holds, keyed by the peer's (uid, pid) from ``SO_PEERCRED``, and asks it before taking more:

- a user (uid) may hold at most ``max_connections_per_user`` connections and
  ``max_unclaimed_fds_per_user`` unclaimed fds, all its processes together (an equal share of the
  totals per allowed uid: forking more processes gives a user nothing more), and within that
  each of its processes at most ``max_connections_per_peer`` and
  ``max_unclaimed_fds_per_peer``; beyond that its own new connection or message is refused,
  nobody else's;
- in total at most ``max_connections`` and ``max_unclaimed_fds``, and together at most half of
  the descriptors the process had free at start (``RLIMIT_NOFILE``; the control socket may use a
  quarter, `kvsidecar.daemon.limits.connections`, the rest is kept for everything else). At a total
  limit the biggest holder gives way (its oldest unclaimed message, or its oldest connection that
  never registered a worker), so a hoarder spread over many processes still cannot crowd out a
  worker that holds little;
- unclaimed fds expire after ``unclaimed_s``; a connection that has registered nothing and holds
  nothing is closed after ``idle_s`` (half-open and idle connections do not pile up).

Processes in another pid namespace show pid 0 to the daemon: they share one key per uid there.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FdLimits",
    "FdStats",
    "Ledger",
    "PeerKey",
    "fd_soft_limit",
    "open_fd_count",
    "raise_fd_limit",
]

PeerKey = tuple[int, int]
"""(uid, pid) of a connection's peer as the kernel reported it at connect time."""


@dataclass(frozen=True)
class FdLimits:
    """How much of the daemon's descriptors the fd channel's peers may hold (see the module)."""

    max_connections: int = 1024
    max_connections_per_peer: int = 256
    max_unclaimed_fds: int = 4096
    max_unclaimed_fds_per_peer: int = 1024
    max_connections_per_user: int = 1024
    max_unclaimed_fds_per_user: int = 4096
    unclaimed_s: float = 30.0
    """Unclaimed fds are closed this long after they arrived."""
    idle_s: float = 10.0
    """A connection that registered nothing and holds nothing is closed after this long."""

    def __post_init__(self) -> None:
        counts = (
            self.max_connections,
            self.max_connections_per_peer,
            self.max_unclaimed_fds,
            self.max_unclaimed_fds_per_peer,
            self.max_connections_per_user,
            self.max_unclaimed_fds_per_user,
        )
        if min(counts) < 1:
            raise ValueError("connection and fd limits must be >= 1")
        if not (self.unclaimed_s > 0 and self.idle_s > 0):
            raise ValueError("fd channel timeouts must be > 0")


@dataclass
class FdStats:
    """What the fd channel refused, expired and met, since start (for status and tests)."""

    refused_connections: int = 0
    refused_deliveries: int = 0
    expired_deliveries: int = 0
    evicted: int = 0
    truncated: int = 0
    accept_errors: int = 0
    idle_closed: int = 0


def fd_soft_limit() -> int:
    """Return the soft ``RLIMIT_NOFILE`` of this process (a very large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


def open_fd_count() -> int:
    """Return how many descriptors this process has open (64 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one; return (before, after).

    Many systems start services with a soft limit of 1024 and a hard one far above; a daemon that
    serves many workers should use what it is allowed. Left as it is if the kernel refuses.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, hard


class Ledger:
    """What each peer holds: connections and unclaimed fds, with the limits' verdicts.

    Pure bookkeeping: the server records what it opened and closed, and asks `room_for_*`
    before it takes more. ``budget`` caps connections plus unclaimed fds together (from the
    process's descriptor limit).
    """

    def __init__(self, limits: FdLimits, budget: int) -> None:
        self.limits = limits
        self.budget = budget
        self.connections: dict[PeerKey, int] = {}
        self.unclaimed: dict[PeerKey, int] = {}
        self.user_connections: dict[int, int] = {}
        self.user_unclaimed: dict[int, int] = {}
        """The same per uid, all its processes together."""
        self.total_connections = 0
        self.total_unclaimed = 0

    def refresh_budget(self, base_fds: int) -> None:
        """Set the budget: half of the descriptors the process had free (``base_fds`` in use)."""
        self.budget = (fd_soft_limit() - base_fds) // 2

    @property
    def held(self) -> int:
        """Descriptors held for peers: connections plus unclaimed fds."""
        return self.total_connections + self.total_unclaimed

    def add_connection(self, key: PeerKey, n: int = 1) -> None:
        """Count ``n`` connections of ``key`` (negative to uncount)."""
        _bump(self.connections, key, n)
        _bump(self.user_connections, key[0], n)
        self.total_connections += n

    def add_unclaimed(self, key: PeerKey, n: int) -> None:
        """Count ``n`` unclaimed fds of ``key`` (negative to uncount)."""
        _bump(self.unclaimed, key, n)
        _bump(self.user_unclaimed, key[0], n)
        self.total_unclaimed += n

    def peer_may_connect(self, key: PeerKey) -> str:
        """Why ``key`` may not connect under its process's and its user's limits; "" if it may."""
        limits = self.limits
        if self.connections.get(key, 0) >= limits.max_connections_per_peer:
            return f"{limits.max_connections_per_peer} connections of this process already"
        if self.user_connections.get(key[0], 0) >= limits.max_connections_per_user:
            return f"{limits.max_connections_per_user} connections of this user already"
        return ""

    def peer_may_hold(self, key: PeerKey, nfds: int) -> str:
        """Why ``key`` may not hold ``nfds`` more unclaimed fds; "" if it may.

        Its process's limit and its user's, all that user's processes together.
        """
        limits = self.limits
        held = self.unclaimed.get(key, 0)
        if held + nfds > limits.max_unclaimed_fds_per_peer:
            return f"this process holds {held} unclaimed fds already"
        by_user = self.user_unclaimed.get(key[0], 0)
        if by_user + nfds > limits.max_unclaimed_fds_per_user:
            return f"this user holds {by_user} unclaimed fds already"
        return ""

    def connections_full(self) -> bool:
        """Whether one more connection would pass a total limit."""
        return self.total_connections >= self.limits.max_connections or self.held + 1 > self.budget

    def unclaimed_full(self, nfds: int) -> bool:
        """Whether ``nfds`` more unclaimed fds would pass a total limit."""
        return (
            self.total_unclaimed + nfds > self.limits.max_unclaimed_fds
            or self.held + nfds > self.budget
        )

    def biggest(self, table: dict[PeerKey, int], among: Iterable[PeerKey]) -> PeerKey | None:
        """Return the peer of ``among`` holding the most in ``table`` (None if there is none)."""
        candidates = set(among)
        return max(candidates, key=lambda k: table.get(k, 0), default=None)


def _bump(table: dict[Any, int], key: Any, n: int) -> None:
    left = table.get(key, 0) + n
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)
