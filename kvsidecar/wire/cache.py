"""Messages of the node's prefix cache and of engine connectors (`kvsidecar.daemon.cache.prefix`).

Part of the control protocol (`kvsidecar.wire.protocol` puts them in its two unions): a lookup
without state change, a store and a load between a worker's blocks and its namespace of the
shared cache, and the completion events a worker takes for itself. Bulk data rides in raw frames:
block keys as one frame of fixed-size keys (``key_size`` bytes each, in token order), block ids
as id frames (`kvsidecar.wire.framing`). Schema evolution as in `kvsidecar.wire.protocol`.
"""

from __future__ import annotations

import msgspec

from kvsidecar.wire.bases import ReplyBase as _Reply
from kvsidecar.wire.bases import RequestBase as _Request
from kvsidecar.wire.types import BufferSetRef, IdsDtype, MoveEvents, WorkerRef


class CacheLookup(_Request, tag="cache_lookup", frozen=True):
    """How many leading blocks of a request the node's prefix cache holds. Frame 0: the keys.

    The keys are ``key_size``-byte block keys (vLLM's block hashes) in token order, packed into
    one frame. A block counts when every TP rank ``0 .. tp_size-1`` of the sender's namespace
    ``fingerprint`` holds it ready. Changes nothing unless ``pin_s`` > 0: then the hit blocks are
    pinned on every rank (not evicted) until loaded under the returned pin, or for ``pin_s``.
    ``loads`` is how many loads under the pin release each namespace's part of it: the ranks
    that load from one namespace (an MLA engine's TP size: its ranks share rank 0's).
    """

    fingerprint: str
    tp_size: int = 1
    key_size: int = 32
    pin_s: float = 0.0
    loads: int = 1
    disk_wait_s: float = 0.0
    """With ``pin_s``: how long the daemon may hold its answer while it reads hit blocks that are
    only on its disk tier into the host pool (then the answer counts what came up). 0: answer at
    once, counting them; a load then waits for them."""


class CacheStore(_Request, tag="cache_store", frozen=True):
    """Copy blocks of a worker into its prefix-cache namespace. Frames: keys, block ids.

    Keys the namespace holds already are skipped; new ones get slots (evicting the least recently
    used unpinned blocks) and become visible to lookups once copied. ``not_after`` (seconds of the
    node's CLOCK_MONOTONIC, 0: none) is when the worker stops waiting for this store and may
    overwrite the blocks: a copy that ends later is thrown away, never published.
    """

    source: BufferSetRef
    fingerprint: str
    key_size: int = 32
    ids_dtype: IdsDtype = "int64"
    not_after: float = 0.0
    capacity_bytes: int = 0
    """Size of the namespace if this store creates it (per rank); 0: ``cache_bytes`` divided by
    the engine's TP size. Capped by what ``cache_bytes`` has left."""
    events: MoveEvents | None = None
    """For GPU memory: the caller's ``ready`` event, recorded on the stream that computes the
    blocks; the copy waits for it, so it reads what that stream wrote (`Move.events`)."""


class CacheLoad(_Request, tag="cache_load", frozen=True):
    """Copy cached blocks into a worker's blocks. Frames: keys, destination block ids.

    Keys that are not ready in the worker's namespace are not loaded; the reply lists their
    destination blocks (their contents are unchanged: the engine must recompute them).
    ``pin_id`` (from `CacheHits`) releases that lookup's pin of this rank's blocks.
    ``not_after`` (seconds of the node's CLOCK_MONOTONIC, 0: none) is when the worker stops
    waiting for this load: a copy that has not started by then never starts.
    """

    target: BufferSetRef
    fingerprint: str
    key_size: int = 32
    ids_dtype: IdsDtype = "int64"
    pin_id: int = 0
    not_after: float = 0.0
    events: MoveEvents | None = None
    """For GPU memory: the caller's ``ready`` event; the copy waits for it, so it overwrites no
    block that a kernel enqueued before the load still reads (`Move.events`)."""


class TakeWorkerEvents(_Request, tag="take_worker_events", frozen=True):
    """Take the completion events credited to one worker since its previous take.

    The first take subscribes the worker: events are queued for it from then on (a producer's
    ``finished_sending`` when its published request was read or its lease ended, and the outcome
    of pulls into the engine). Engine-wide events are credited to every worker of the engine.
    """

    worker: WorkerRef
    epoch: int = 0


class CacheHits(_Reply, tag="cache_hits", frozen=True):
    """The answer to `CacheLookup`: leading blocks held on every rank, and the pin if asked."""

    hits: int
    pin_id: int = 0
    disk_hits: int = 0
    """How many of the hits were on the disk tier only when the lookup came (brought up into
    the host pool since, or being brought up)."""


class CacheStored(_Reply, tag="cache_stored", frozen=True):
    """A `CacheStore` ended: blocks copied and published, already present, or not stored.

    ``dropped`` blocks found no slot (all pinned or being filled) or came after ``not_after``;
    ``evicted`` ready blocks gave their slots up for this store.
    """

    stored: int
    present: int
    dropped: int
    evicted: int
    nbytes: int


class CacheLoaded(_Reply, tag="cache_loaded", frozen=True):
    """A `CacheLoad` ended: blocks written, bytes, seconds, and the blocks that were missing."""

    loaded: int
    nbytes: int
    seconds: float
    missing_block_ids: list[int] = []


class CacheNamespaceInfo(msgspec.Struct, frozen=True):
    """One prefix-cache namespace as status reports it."""

    owner: str
    fingerprint: str
    tp_rank: int
    capacity_blocks: int
    ready_blocks: int
    pinned_blocks: int
    block_bytes: int
    hit_blocks: int = 0
    """Blocks lookups found here since the namespace was made (pins not counted)."""
    stored_blocks: int = 0
    loaded_blocks: int = 0
    workers: int = 0
    """Registered workers that use it now."""
    disk_capacity_blocks: int = 0
    disk_blocks: int = 0
    """Its blocks on the disk tier (all of them may be there when none is in memory)."""


class CacheTierInfo(msgspec.Struct, frozen=True):
    """One tier of the prefix cache below the host pool, as status reports it."""

    medium: str
    """``STORAGE``: the disk tier."""
    up: bool
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    spaces: int = 0
    free_bytes: int = -1
    """Bytes left on its file system (-1: unknown)."""
    reason: str = ""
    """Why it is down."""
    path: str = ""
