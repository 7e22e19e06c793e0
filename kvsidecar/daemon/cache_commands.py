"""The prefix cache's commands: ``cache_lookup``, ``cache_store``, ``cache_load``.

A lookup is answered inline (bookkeeping only). A store or a load is checked, its slots decided
and its copy submitted as an ordinary move job (`kvsidecar.daemon.commands.Commands._run_job`:
admission, hazard ordering, release of departed workers); it is answered from the event loop
once the index knows the outcome, never from the copy thread, so that a lookup read after a
store's reply sees the stored blocks.

A mixin of `kvsidecar.daemon.server.Daemon` (through this class, which extends
`kvsidecar.daemon.commands.Commands`); the namespaces themselves are `kvsidecar.daemon.cache`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvsidecar.daemon.cache.prefix import Namespace, PrefixCache, slot_ids, split_keys, worker_of
from kvsidecar.daemon.commands import Commands, ReplySink
from kvsidecar.node.copy_events import cuda_devices, event_device
from kvsidecar.node.jobs import Job, move_job
from kvsidecar.wire.cache import (
    CacheHits,
    CacheLoad,
    CacheLoaded,
    CacheLookup,
    CacheNamespaceInfo,
    CacheStore,
    CacheStored,
)
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Moved, Reply, Status, StatusReply


class _AfterBookkeeping:
    """A `ReplySink` that answers from the loop, with the reply ``make`` builds from `Moved`.

    An early answer (from the copy thread, or from the loop before the bookkeeping) is
    declined, so `Commands._run_job` settles the job on the loop, runs its ``track`` (the index
    update), then `deliver` s; errors go through unchanged.
    """

    def __init__(self, respond: ReplySink, make: Callable[[Moved], Reply]) -> None:
        self._respond = respond
        self._make = make

    def send(self, reply: Reply, *, from_thread: bool = False, early: bool = False) -> bool:
        """Decline early answers; after the bookkeeping, answer (see the class doc)."""
        if early or from_thread:
            return False
        self.deliver(reply)
        return True

    def claim(self) -> Reply | None:
        """Nothing was sent early: the loop always decides the reply."""
        return None

    def deliver(self, reply: Reply) -> None:
        """Send the cache reply made from ``reply`` (an `Error` as it is)."""
        self._respond.send(self._make(reply) if isinstance(reply, Moved) else reply)


def _timed(job: Job, finished: list[float]) -> Job:
    """Wrap ``job`` to note, on its copy thread, when its copy ended (``not_after``)."""

    def run() -> int:
        copied = job.run()
        finished.append(time.monotonic())
        return copied

    return dataclasses.replace(job, run=run)


def _not_after(job: Job, deadline: float) -> Job:
    """Wrap ``job`` so that its copy never starts after ``deadline`` (a load's ``not_after``).

    The worker has given up on the load by then and may have handed its blocks to another
    request: a copy starting later would overwrite them.
    """

    def run() -> int:
        if time.monotonic() > deadline:
            raise SidecarError("timeout", "the load's not_after passed before its copy started")
        return job.run()

    return dataclasses.replace(job, run=run)


def _failed(outcome: asyncio.Future[Reply]) -> bool:
    return outcome.cancelled() or outcome.exception() is not None


def _nbytes(outcome: asyncio.Future[Reply]) -> int:
    reply = outcome.result()
    return reply.nbytes if isinstance(reply, Moved) else 0


class CacheCommands(Commands):
    """Handlers of the prefix-cache commands (a `Daemon` mixin, see the module doc)."""

    # Owned and set by `Daemon`.
    cache: PrefixCache | None

    def _status(self, req: Status) -> StatusReply:
        """Answer ``status``, with the prefix cache's namespaces."""
        reply = super()._status(req)
        if self.cache is None:
            return reply
        spaces = [
            CacheNamespaceInfo(
                owner=ns.key[0],
                fingerprint=ns.key[1],
                tp_rank=ns.key[2],
                capacity_blocks=ns.index.capacity,
                ready_blocks=ns.index.ready,
                pinned_blocks=ns.index.pinned,
                block_bytes=ns.block_bytes,
                hit_blocks=ns.hit_blocks,
                stored_blocks=ns.stored_blocks,
                loaded_blocks=ns.loaded_blocks,
                workers=len(ns.workers),
            )
            for ns in self.cache.namespaces.values()
        ]
        return msgspec.structs.replace(reply, cache_namespaces=spaces)

    def _cache_service(self) -> PrefixCache:
        if self.cache is None:
            raise SidecarError("shutting_down", "the prefix cache is not running")
        return self.cache

    def _keys_and_ids(
        self, data: list[memoryview], key_size: int, ids_dtype: Any
    ) -> tuple[list[bytes], IdArray]:
        keys = split_keys(data[0], key_size, self.config.max_ids_per_command)
        ids = self._ids(data[1], ids_dtype, "block")
        if len(keys) != ids.size:
            raise SidecarError("length_mismatch", f"{len(keys)} keys for {ids.size} block ids")
        return keys, ids

    def _cache_lookup(self, req: CacheLookup, data: list[memoryview], owner: str) -> CacheHits:
        cache = self._cache_service()
        keys = split_keys(data[0], req.key_size, self.config.max_ids_per_command)
        cache.sweep_pins(time.monotonic())
        spaces = cache.lookup_spaces(owner, req.fingerprint, req.tp_size, req.loads)
        hits = 0 if spaces is None else min(ns.index.lookup(keys) for ns in spaces)
        pin_id = 0
        cache.metrics.lookup(hits, len(keys) - hits)
        for ns in spaces or ():
            ns.hit_blocks += hits
        if req.pin_s > 0 and spaces is not None and hits:
            pin_id = cache.pin([(ns, keys[:hits]) for ns in spaces], req.pin_s, req.loads)
            cache.metrics.pin(hits)
        return CacheHits(id=req.id, hits=hits, pin_id=pin_id)

    def _cache_store(
        self, req: CacheStore, data: list[memoryview], respond: ReplySink, owner: str
    ) -> asyncio.Future[Reply] | tuple[Reply, tuple[Any, ...]]:
        cache = self._cache_service()
        keys, ids = self._keys_and_ids(data, req.key_size, req.ids_dtype)
        worker = worker_of(self.registry, req.source.worker, req.source.epoch, req.source.medium)
        event_device(cuda_devices(worker.device), req.events)  # even when nothing is copied
        cache.sweep_pins(time.monotonic())
        ns = cache.namespace_for(
            owner, req.fingerprint, worker, create=True, capacity_bytes=req.capacity_bytes
        )
        assert ns is not None
        res = ns.index.reserve(keys)
        cache.metrics.evicted(res.evicted)
        cache.metrics.drop("no_room", res.dropped)
        stored = [keys[i] for i in res.positions]
        if not stored:
            reply = CacheStored(
                id=req.id, stored=0, present=res.present, dropped=res.dropped, evicted=0, nbytes=0
            )
            return reply, ()
        try:
            job = move_job(
                self.registry,
                worker.device,
                ns.buffers,
                ids[res.positions],
                slot_ids(res.slots),
                events=req.events,
            )
        except SidecarError:
            ns.index.commit(stored, res.slots, ok=False)
            raise
        finished: list[float] = []
        kept = [False]
        ns.busy += 1

        def track(outcome: asyncio.Future[Reply]) -> None:
            ns.busy -= 1
            late = bool(req.not_after) and (not finished or finished[0] > req.not_after)
            kept[0] = not _failed(outcome) and not late
            ns.index.commit(stored, res.slots, ok=kept[0])
            if kept[0]:
                ns.stored_blocks += len(stored)
                cache.metrics.transferred("store", len(stored), _nbytes(outcome))
            else:
                cache.metrics.drop("failed" if _failed(outcome) else "late", len(stored))

        def make(moved: Moved) -> Reply:
            n = len(stored) if kept[0] else 0
            return CacheStored(
                id=req.id,
                stored=n,
                present=res.present,
                dropped=res.dropped + len(stored) - n,
                evicted=res.evicted,
                nbytes=moved.nbytes if kept[0] else 0,
            )

        return self._run_job(
            _timed(job, finished),
            req.id,
            move=True,
            respond=_AfterBookkeeping(respond, make),
            track=track,
        )

    def _cache_load(
        self, req: CacheLoad, data: list[memoryview], respond: ReplySink, owner: str
    ) -> asyncio.Future[Reply] | tuple[Reply, tuple[Any, ...]]:
        cache = self._cache_service()
        keys, ids = self._keys_and_ids(data, req.key_size, req.ids_dtype)
        worker = worker_of(self.registry, req.target.worker, req.target.epoch, req.target.medium)
        event_device(cuda_devices(worker.device), req.events)  # even when nothing is copied
        ns = cache.namespace_for(owner, req.fingerprint, worker, create=False)
        slots = [None] * len(keys) if ns is None else ns.index.slots(keys)
        found = [i for i, s in enumerate(slots) if s is not None]
        held = [s for s in slots if s is not None]
        missing = [int(ids[i]) for i, s in enumerate(slots) if s is None]
        cache.metrics.load_missing(len(missing))
        if ns is None or not found:
            if req.pin_id:
                cache.release_pin(req.pin_id, None if ns is None else ns.key)
            loaded = CacheLoaded(
                id=req.id, loaded=0, nbytes=0, seconds=0.0, missing_block_ids=missing
            )
            return loaded, ()
        job = move_job(
            self.registry, ns.buffers, worker.device, slot_ids(held), ids[found], events=req.events
        )
        if req.not_after:
            job = _not_after(job, req.not_after)
        # The job's own pin from now until its copy ends; the lookup's pin is done with.
        ns.index.pin(held)
        if req.pin_id:
            cache.release_pin(req.pin_id, ns.key)
        ns.busy += 1
        space: Namespace = ns

        def track(outcome: asyncio.Future[Reply]) -> None:
            space.busy -= 1
            space.index.unpin(held)
            if not _failed(outcome):
                space.loaded_blocks += len(held)
                cache.metrics.transferred("load", len(held), _nbytes(outcome))

        def make(moved: Moved) -> Reply:
            return CacheLoaded(
                id=req.id,
                loaded=len(held),
                nbytes=moved.nbytes,
                seconds=moved.seconds,
                missing_block_ids=missing,
            )

        return self._run_job(
            job, req.id, move=True, respond=_AfterBookkeeping(respond, make), track=track
        )
