"""What the daemon's services share while it serves, as uvicorn's ``ServerState`` is shared.

`DaemonState` is made once by `kvsidecar.daemon.server.Daemon` and handed to every service that
needs it; `MoveTotals` are the daemon-wide counts of moves that ``status`` reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable
from dataclasses import dataclass
from typing import Any

from kvsidecar.wire.protocol import Reply


class DaemonState:
    """The serving state: draining, tasks, copy jobs in flight and replies still to send."""

    def __init__(self) -> None:
        self.draining = False
        """True from the start of shutdown: every new request but ``status`` is refused."""
        self.tasks: set[asyncio.Task[Any]] = set()
        """Requests answered by a coroutine (register, pulls) and releases; cancelled at exit."""
        self.jobs: dict[asyncio.Future[Any], frozenset[Hashable]] = {}
        """Copy jobs in flight and the workers they touch (failed when one of them is released)."""
        self.replies: set[asyncio.Future[Reply]] = set()
        """Replies of copy jobs not yet sent (shutdown sends them before closing the socket)."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task that shutdown cancels (and awaits)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def hold_reply(self, reply: asyncio.Future[Reply]) -> None:
        """Keep ``reply`` until it is done, so that shutdown can wait for it to be sent."""
        if not reply.done():
            self.replies.add(reply)
            reply.add_done_callback(self.replies.discard)


@dataclass
class MoveTotals:
    """Daemon-wide counts of moves (the ``status`` reply's), kept on the event loop."""

    moves: int = 0
    moves_failed: int = 0
    bytes_moved: int = 0
    integrity_failures: int = 0
    """Moves whose end-to-end checksum found corrupted destination blocks."""
    short_moves: int = 0
    """Plain short moves copied on the loop without a job (`kvsidecar.daemon.moves`)."""
