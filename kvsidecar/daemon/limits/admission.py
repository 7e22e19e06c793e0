"""Admission of copy jobs: a bounded number queued or running, per worker and in total.

Without a bound, a client that sends moves faster than the copy threads run them grows the
daemon's memory (each queued move holds its id arrays and a task) until something breaks. With
one, the excess is refused at once with the typed ``busy`` error and nothing is queued: the
client backs off and retries, and everyone else keeps being served.

A job counts against every worker whose memory it touches (a move from A to B takes one slot of
A and one of B), so one hot destination cannot take the whole daemon's capacity; and against the
user of each of those workers' engines, who may hold an equal share of the total per allowed
uid, all its engines and processes together: a user cannot multiply its share by registering
more workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import WorkerRef


@dataclass(frozen=True)
class Ticket:
    """An admitted job's slots; give it back with `Admission.release` exactly once."""

    workers: tuple[WorkerRef, ...]
    users: tuple[str, ...] = ()


class Admission:
    """Counts of admitted jobs per worker and in total, with their limits."""

    def __init__(self, max_per_worker: int, max_total: int, users: int = 1) -> None:
        self.max_per_worker = max_per_worker
        self.max_total = max_total
        self.max_per_user = max(1, max_total // max(1, users))
        """A user's share of ``max_total`` (``users``: how many share it, the allowed uids)."""
        self.total = 0
        self.refused = 0
        """Jobs refused with ``busy`` since start."""
        self._per_worker: dict[WorkerRef, int] = {}
        self._per_user: dict[str, int] = {}

    def admit(self, workers: Iterable[WorkerRef], users: Iterable[str] = ()) -> Ticket:
        """Take a slot per worker, per user and in total, or raise ``busy`` (none taken).

        ``users``: the owners of the workers' engines.
        """
        refs = tuple(dict.fromkeys(workers))
        owners = tuple(dict.fromkeys(users))
        if self.total >= self.max_total:
            self.refused += 1
            raise SidecarError(
                "busy", f"{self.total} moves in flight on the daemon (limit {self.max_total})"
            )
        for ref in refs:
            if self._per_worker.get(ref, 0) >= self.max_per_worker:
                self.refused += 1
                raise SidecarError(
                    "busy",
                    f"{self.max_per_worker} moves in flight on {ref.label()} (the per-worker "
                    "limit); retry after some complete",
                )
        for user in owners:
            if self._per_user.get(user, 0) >= self.max_per_user:
                self.refused += 1
                raise SidecarError(
                    "busy",
                    f"{self.max_per_user} moves in flight on the engines of {user} (its share of "
                    f"max_moves_total {self.max_total}); retry after some complete",
                )
        self.total += 1
        for ref in refs:
            self._per_worker[ref] = self._per_worker.get(ref, 0) + 1
        for user in owners:
            self._per_user[user] = self._per_user.get(user, 0) + 1
        return Ticket(refs, owners)

    def release(self, ticket: Ticket) -> None:
        """Give the slots of a finished (or failed) job back."""
        self.total -= 1
        for ref in ticket.workers:
            _less(self._per_worker, ref)
        for user in ticket.users:
            _less(self._per_user, user)

    def in_flight(self, ref: WorkerRef) -> int:
        """Admitted jobs touching ``ref``."""
        return self._per_worker.get(ref, 0)


def _less(table: dict[Any, int], key: Any) -> None:
    left = table.get(key, 0) - 1
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)
