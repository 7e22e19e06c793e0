"""The two bases every control message derives from: a tagged struct with an ``id``.

Kept apart from `kvsidecar.wire.protocol` so that groups of messages can live in modules of
their own (`kvsidecar.wire.cache`) and still join the protocol's two unions.
"""

from __future__ import annotations

import msgspec


class RequestBase(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every request: the client-chosen request id echoed in the reply."""

    id: int


class ReplyBase(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every reply: the id of the request it answers (0 if that was unreadable)."""

    id: int
