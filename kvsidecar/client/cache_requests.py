"""Request builders of the prefix cache and of per-worker completion events (connectors).

A mixin of the clients' shared request builder (`kvsidecar.client.requests._Requests`): the
commands `cache_lookup`, `cache_store`, `cache_load` and `take_worker_events`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.client.calls import _Call, _events, _reply
from kvsidecar.client.codec import Ids, _as_id_array, _dtype_of
from kvsidecar.client.common import _Base
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


class _CacheRequests(_Base):
    """Builders of the prefix-cache commands and of ``take_worker_events``."""

    def _cache_lookup(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        tp_size: int,
        pin_s: float,
        timeout: float | None,
        *,
        loads: int = 1,
    ) -> _Call[CacheHits, CacheHits]:
        size, frame = _key_frame(keys)
        req = CacheLookup(
            id=self._codec.next_id(),
            fingerprint=fingerprint,
            tp_size=tp_size,
            key_size=size,
            pin_s=pin_s,
            loads=loads,
        )
        return _Call(req, CacheHits, _reply, (frame,), timeout)

    def _cache_store(
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
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        source = BufferSetRef(worker or self.worker)
        req = CacheStore(
            id=self._codec.next_id(),
            source=self._stamp(source),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            not_after=not_after,
            capacity_bytes=capacity_bytes,
            events=self._ready(source),
        )
        return _Call(req, CacheStored, _reply, (frame, ids), timeout)

    def _cache_load(
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
        size, frame = _key_frame(keys)
        ids = _as_id_array(block_ids)
        target = BufferSetRef(worker or self.worker)
        req = CacheLoad(
            id=self._codec.next_id(),
            target=self._stamp(target),
            fingerprint=fingerprint,
            key_size=size,
            ids_dtype=_dtype_of(ids),
            pin_id=pin_id,
            not_after=not_after,
            events=self._ready(target),
        )
        return _Call(req, CacheLoaded, _reply, (frame, ids), timeout)

    def _take_worker_events(
        self, worker: WorkerRef | None, timeout: float | None
    ) -> _Call[PeerEvents, list[PeerCompletion]]:
        ref = worker or self.worker
        req = TakeWorkerEvents(id=self._codec.next_id(), worker=ref, epoch=self.epochs.get(ref, 0))
        return _Call(req, PeerEvents, _events, timeout=timeout)
