"""Wire error codes and the one exception type that carries them, on both sides of the socket."""

from __future__ import annotations

import typing
from collections.abc import Hashable, Sequence
from typing import Literal

ErrorCode = Literal[
    "bad_frame",
    "unknown_message",
    "invalid_message",
    "version_mismatch",
    "too_large",
    "unknown_engine",
    "unknown_worker",
    "unknown_layer",
    "already_registered",
    "incompatible_engine",
    "handle_error",
    "out_of_range",
    "duplicate_destination",
    "length_mismatch",
    "incompatible_buffers",
    "pool_exhausted",
    "not_allocated",
    "busy",
    "shutting_down",
    "timeout",
    "internal",
    # peer (node-to-node transfer)
    "incompatible_peer",
    "peer_unavailable",
    # completion aggregation (`Report`, `Collect`)
    "stale_epoch",
    "step_collected",
    # access rights and liveness of workers and connections
    "forbidden",
    "worker_lost",
    "connection_lost",
]
"""The closed set of error codes a daemon replies with; docs/protocol.md explains each."""

ERROR_CODES: frozenset[str] = frozenset(typing.get_args(ErrorCode))
"""`ErrorCode` as a set, for checks at run time."""


class SidecarError(Exception):
    """A command failed with a typed ``code`` (one of `kvsidecar.wire.errors.ErrorCode`).

    The daemon raises it while validating a command and turns it into an ``Error`` reply; the
    client raises it when such a reply arrives (or on a local timeout, code ``timeout``).
    """

    def __init__(self, code: ErrorCode, message: str, *, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.request_id = request_id


def require_distinct(values: Sequence[Hashable], *, empty: str, repeated: str) -> None:
    """Refuse (``invalid_message``) an empty list of names, or one that names a thing twice."""
    if not values:
        raise SidecarError("invalid_message", empty)
    if len(set(values)) != len(values):
        raise SidecarError("invalid_message", repeated)
