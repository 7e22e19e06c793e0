"""A bound on the bytes of large replies that wait for their readers, all connections together.

ZeroMQ's high-water mark bounds each connection's queue in messages (1000), not in bytes: a
client that asks for large replies (the status of a big node, a million host block ids, an
error that names a long engine id) and never reads them could make the daemon hold a thousand
of them per connection, on as many connections as it opens. Large replies go out zero-copy, so
libzmq holds each one's buffer until the bytes reached the kernel (or the message was dropped);
a `zmq.MessageTracker` says when that happened. `ReplyBudget` counts the bytes of the large
replies still held and refuses new ones past ``max_reply_bytes``: the control socket then answers
``busy`` instead, and refuses requests whose replies may be large while no room is left.
Small replies (under `kvsidecar.wire.zmqio.COPY_BELOW`) are copied into libzmq's own messages
and not counted: the high-water mark bounds them to a few MiB per connection.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import zmq


class ReplyBudget:
    """Bytes of large replies queued and not yet handed to the kernel; thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """The bound (``max_reply_bytes``)."""
        self.refused_total = 0
        """Replies and requests refused for want of room."""
        self._lock = threading.Lock()
        self._held: list[tuple[Sequence[zmq.MessageTracker], int]] = []
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of large replies taken and not yet known to be sent or dropped."""
        with self._lock:
            self._prune()
            return self._bytes

    def has_room(self) -> bool:
        """Whether anything is left (asked before a request whose reply may be large)."""
        with self._lock:
            self._prune()
            if self._bytes < self.limit:
                return True
            self.refused_total += 1
            return False

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` of a reply about to be queued; False (nothing taken) past the bound."""
        with self._lock:
            self._prune()
            if self._bytes + nbytes > self.limit:
                self.refused_total += 1
                return False
            self._bytes += nbytes
            return True

    def track(self, trackers: Sequence[zmq.MessageTracker], nbytes: int) -> None:
        """Watch a queued reply's frames: its ``nbytes`` count until libzmq let go of them all."""
        with self._lock:
            self._held.append((trackers, nbytes))

    def give_back(self, nbytes: int) -> None:
        """Return what `take` counted for a reply that was not queued after all."""
        with self._lock:
            self._bytes -= nbytes

    def _prune(self) -> None:
        if not self._held:
            return
        keep = []
        for trackers, nbytes in self._held:
            if all(t.done for t in trackers):
                self._bytes -= nbytes
            else:
                keep.append((trackers, nbytes))
        self._held = keep
