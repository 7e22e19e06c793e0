"""Request builders of the prefix cache and of per-worker completion events (connectors).

The commands `cache_lookup`, `cache_store`, `cache_load` and `take_worker_events`, built like
those of `kvsidecar.client.requests._Requests` and held beside it by both clients.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.client.calls import _Call, _events, _reply
from kvsidecar.client.codec import Ids, _as_id_array, _dtype_of
from kvsidecar.client.common import _Session
from kvsidecar.wire.cache import (
    CacheHits,
    CacheLoad,
    CacheLoaded,
    CacheLookup,
    CacheStore,
    CacheStored,
    TakeWorkerEvents,
)
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.pulls import PeerEvents
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.types import BufferSetRef, WorkerRef


def _key_frame(keys: Sequence[bytes]) -> tuple[int, bytes]:
    """Return the keys' common size and the keys packed into one frame (all of one size)."""
    size = len(keys[0]) if keys else 32
    if any(len(k) != size for k in keys):
        raise SidecarError("invalid_message", "block keys must all have the same length")
    return size, b"".join(keys)


class _CacheRequests:
    """Builders of the prefix-cache commands and of ``take_worker_events``, on a `_Session`."""

    def __init__(self, session: _Session) -> None:
        self._session = session
        self._next_id = session.codec.next_id

    def cache_lookup(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        tp_size: int,
        pin_s: float,
        timeout: float | None,
        *,
        loads: int = 1,
        disk_wait_s: float = 0.0,
    ) -> _Call[CacheHits, CacheHits]:
        """Build the count (and with ``pin_s`` > 0 the pin) of the leading keys held.

        ``disk_wait_s``: how long the daemon may hold the answer while it brings hit blocks up
        from its disk tier (`CacheLookup.disk_wait_s`).
        """
        size, frame = _key_frame(keys)
        req = CacheLookup(
            id=self._next_id(),
            fingerprint=fingerprint,
            tp_size=tp_size,
            key_size=size,
            pin_s=pin_s,
            loads=loads,
            disk_wait_s=disk_wait_s,
        )
        return _Call(req, CacheHits, _reply, (frame,), timeout)

    def cache_store(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        worker: WorkerRef | None,
        not_after: float,
        capacity_bytes: int = 0,
        timeout: float | None,
    ) -> _Call[CacheStored, CacheStored]:
        """Build a store of blocks under keys, ordered after the caller's stream on a GPU."""
        session = self._session
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        source = BufferSetRef(worker or session.worker)
        req = CacheStore(
            id=self._next_id(),
            source=session.stamp(source),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            not_after=not_after,
            capacity_bytes=capacity_bytes,
            events=session.ready(source),
        )
        return _Call(req, CacheStored, _reply, (frame, ids), timeout)

    def cache_load(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        worker: WorkerRef | None,
        pin_id: int,
        timeout: float | None,
        not_after: float = 0.0,
    ) -> _Call[CacheLoaded, CacheLoaded]:
        """Build a load of the keys' blocks, ordered after the caller's stream on a GPU."""
        session = self._session
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        target = BufferSetRef(worker or session.worker)
        req = CacheLoad(
            id=self._next_id(),
            target=session.stamp(target),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            pin_id=pin_id,
            not_after=not_after,
            events=session.ready(target),
        )
        return _Call(req, CacheLoaded, _reply, (frame, ids), timeout)

    def take_worker_events(
        self, worker: WorkerRef | None, timeout: float | None
    ) -> _Call[PeerEvents, list[PeerCompletion]]:
        """Build the take of a worker's completion events (default: the client's worker)."""
        ref = worker or self._session.worker
        epoch = self._session.epochs.get(ref, 0)
        req = TakeWorkerEvents(id=self._next_id(), worker=ref, epoch=epoch)
        return _Call(req, PeerEvents, _events, timeout=timeout)
