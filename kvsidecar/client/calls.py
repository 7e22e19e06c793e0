"""A command ready to send, and how its reply becomes the caller's result.

`kvsidecar.client.requests` builds `_Call` s, one per command, for both clients; the transports
(`sync_transport`, `aio_transport`) send them and hand the checked reply to ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

from kvsidecar.client.codec import R, T
from kvsidecar.wire.protocol import Reply, Request
from kvsidecar.wire.pulls import PeerEvents
from kvsidecar.wire.reports import PeerCompletion


@dataclass(frozen=True, slots=True)
class _Call(Generic[R, T]):
    """One command ready to send: ``finish`` turns the checked reply into the method's result."""

    req: Request
    expected: type[R]
    finish: Callable[[R, list[memoryview]], T]
    data: Sequence[Any] = ()
    timeout: float | None = None


def _reply(reply: R, frames: list[memoryview]) -> R:
    return reply


def _nothing(reply: Reply, frames: list[memoryview]) -> None:
    return None


def _events(reply: PeerEvents, frames: list[memoryview]) -> list[PeerCompletion]:
    return reply.events
