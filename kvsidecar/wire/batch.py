"""`MoveBatch`: many moves in one command, and its reply `MovedBatch`.

An engine step typically moves the blocks of many requests (offloads of finished prefills,
onboards of new ones). Sent one `kvsidecar.wire.protocol.Move` each, every request pays a round
trip and a hand-off to a copy thread; a `MoveBatch` pays them once for the whole step. Its items
are moves of their own (each its source, destination, layers and engine requests), checked one
by one: an item that fails its checks gets its typed error in the reply and the others still
run. The items that pass run as one copy job, in order, so an item that reads blocks an earlier
item of the batch writes sees the new bytes.

Both structs belong to the control protocol's unions (`kvsidecar.wire.protocol.Request` and
``Reply``); they live here to keep that module readable, and carry the same ``type`` tag field
and ``id`` as every other message there.
"""

from __future__ import annotations

import msgspec

from kvsidecar.wire.types import BufferSetRef, IdsDtype


class MoveItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One move of a `MoveBatch`: a `Move` whose ids are a slice of the batch's id frames.

    Its source ids are the next ``num_src`` ids of frame 0, its destination ids the next
    ``num_dst`` of frame 1 (items in order). ``layers`` and ``request_ids`` mean what they mean
    in a `Move`.
    """

    src: BufferSetRef
    dst: BufferSetRef
    num_src: int
    num_dst: int
    layers: list[str] | None = None
    request_ids: list[str] = []


class MoveBatch(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, tag="move_batch"):
    """Many moves in one command (see the module doc).

    Frame 0: every item's source ids in turn; frame 1: every item's destination ids in turn.

    The reply is `MovedBatch` with one result per item, in order; the request as a whole fails
    (an `Error`) only for what concerns all items: bad frames, lengths that do not add up, more
    than ``max_ids_per_command`` ids, a worker released while the batch ran (``worker_lost``).
    """

    id: int
    items: list[MoveItem]
    ids_dtype: IdsDtype = "int64"
    checksum: bool | None = None
    """As in `Move`, for every item."""


class MoveResult(msgspec.Struct, frozen=True):
    """How one item of a batch ended: ``error_code`` empty when it was moved.

    The fields of a successful item are those of `Moved`; a failed one has ``error_code`` (one
    of `kvsidecar.wire.errors.ErrorCode`) and ``error`` set and nothing moved by it.
    """

    blocks: int = 0
    nbytes: int = 0
    fixed: bool = False
    verified: bool = False
    invalid_block_ids: list[int] = []
    error_code: str = ""
    error: str = ""


class MovedBatch(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, tag="moved_batch"):
    """The items of a `MoveBatch`, one `MoveResult` each, in order; ``seconds`` on the executor."""

    id: int
    results: list[MoveResult]
    seconds: float
