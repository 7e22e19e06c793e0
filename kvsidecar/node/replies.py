"""A bound on the bytes of large replies that wait for their readers, all connections together.

ZeroMQ's high-water mark bounds each connection's queue in messages (1000), not in bytes: a
client that asks for large replies (the status of a big node, a million host block ids, an
error that names a long engine id) and never reads them could make the daemon hold a thousand
of them per connection, on as many connections as it opens. Large replies go out zero-copy, so
libzmq holds each one's buffer until the bytes reached the kernel (or the message was dropped);
a `zmq.MessageTracker` says when that happened. `ReplyBudget` counts the bytes of the large
replies still held and refuses new ones past ``max_reply_bytes``: the control socket then answers
``busy`` instead, and refuses requests whose replies may be large while no room is left. Each
user (transport user: ``uid:<n>``, ``curve:<key>``) may hold an equal share of the bound per
allowed uid, all its connections together, so that one user's unread replies never leave
another none.
Small replies (under `kvsidecar.wire.zmqio.COPY_BELOW`) are copied into libzmq's own messages
and not counted: the high-water mark bounds them to a few MiB per connection.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import zmq


class ReplyBudget:
    """Bytes of large replies queued and not yet handed to the kernel; thread-safe."""

    def __init__(self, limit: int, users: int = 1) -> None:
        self.limit = limit
        """The bound (``max_reply_bytes``)."""
        self.user_limit = max(1, limit // max(1, users))
        """One user's share of it (``users``: how many share it, the allowed uids)."""
        self.refused_total = 0
        """Replies and requests refused for want of room."""
        self._lock = threading.Lock()
        self._held: list[tuple[Sequence[zmq.MessageTracker], int, str]] = []
        self._bytes = 0
        self._by_user: dict[str, int] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of large replies taken and not yet known to be sent or dropped."""
        with self._lock:
            self._prune()
            return self._bytes

    def held_by(self, user: str) -> int:
        """Bytes of ``user``'s large replies still held."""
        with self._lock:
            self._prune()
            return self._by_user.get(user, 0)

    def has_room(self, user: str = "") -> bool:
        """Whether anything is left for ``user`` (asked before a request of a large reply)."""
        with self._lock:
            self._prune()
            if self._bytes < self.limit and self._by_user.get(user, 0) < self.user_limit:
                return True
            self.refused_total += 1
            return False

    def take(self, nbytes: int, user: str = "") -> bool:
        """Count ``nbytes`` of ``user``'s reply about to be queued.

        False (nothing taken) past the bound, or past the user's share of it.
        """
        with self._lock:
            self._prune()
            mine = self._by_user.get(user, 0)
            if self._bytes + nbytes > self.limit or mine + nbytes > self.user_limit:
                self.refused_total += 1
                return False
            self._bytes += nbytes
            self._by_user[user] = mine + nbytes
            return True

    def track(self, trackers: Sequence[zmq.MessageTracker], nbytes: int, user: str = "") -> None:
        """Watch a queued reply's frames: its ``nbytes`` count until libzmq let go of them all."""
        with self._lock:
            self._held.append((trackers, nbytes, user))

    def give_back(self, nbytes: int, user: str = "") -> None:
        """Return what `take` counted for a reply that was not queued after all."""
        with self._lock:
            self._release(nbytes, user)

    def _release(self, nbytes: int, user: str) -> None:
        self._bytes -= nbytes
        left = self._by_user.get(user, 0) - nbytes
        if left > 0:
            self._by_user[user] = left
        else:
            self._by_user.pop(user, None)

    def _prune(self) -> None:
        if not self._held:
            return
        keep = []
        for trackers, nbytes, user in self._held:
            if all(t.done for t in trackers):
                self._release(nbytes, user)
            else:
                keep.append((trackers, nbytes, user))
        self._held = keep
