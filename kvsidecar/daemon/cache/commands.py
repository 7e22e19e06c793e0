"""The prefix cache's commands: ``cache_lookup``, ``cache_store``, ``cache_load``.

A lookup is answered inline (bookkeeping only). A store or a load is checked, its slots decided
and its copy run as an ordinary move job (`kvsidecar.daemon.runner.JobRunner`: admission, hazard
ordering, release of departed workers); it is answered from the event loop once the index knows
the outcome (the runner's ``finish``), never from the copy thread, so that a lookup read after a
store's reply sees the stored blocks. The namespaces themselves are
`kvsidecar.daemon.cache.prefix`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from kvsidecar.daemon.cache.prefix import Namespace, PrefixCache, slot_ids, split_keys, worker_of
from kvsidecar.daemon.cache.tiering import TieredCache
from kvsidecar.daemon.moves import Moves
from kvsidecar.daemon.runner import Answer, JobRunner, reply_of
from kvsidecar.node.config import Config
from kvsidecar.node.copy_events import cuda_devices, event_device
from kvsidecar.node.jobs import Job, move_job
from kvsidecar.node.registry import Registry, Worker
from kvsidecar.wire.cache import (
    CacheHits,
    CacheLoad,
    CacheLoaded,
    CacheLookup,
    CacheNamespaceInfo,
    CacheStore,
    CacheStored,
    CacheTierInfo,
)
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Error, Moved, Reply

log = logging.getLogger("kvsidecar.daemon")


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


def _ranks(ns: Namespace, worker: Worker) -> int:
    """How many ranks share the cache's room with ``ns`` (an MLA namespace serves them all)."""
    replicated = bool(ns.layers) and all(d.arrangement == "mla" for d in ns.layers.values())
    return 1 if replicated else worker.tp_size


def _failed(outcome: asyncio.Future[Reply]) -> bool:
    return outcome.cancelled() or outcome.exception() is not None


def _nbytes(outcome: asyncio.Future[Reply]) -> int:
    reply = outcome.result()
    return reply.nbytes if isinstance(reply, Moved) else 0


class CacheCommands:
    """Handlers of the prefix-cache commands (see the module doc)."""

    def __init__(
        self,
        config: Config,
        cache: PrefixCache,
        registry: Registry,
        runner: JobRunner,
        moves: Moves,
        *,
        tiers: TieredCache | None = None,
    ) -> None:
        self._max_ids = config.max_ids_per_command
        self._cache = cache
        self._tiers = tiers
        """The tier below the host pool (the disk tier), if configured."""
        self._registry = registry
        self._runner = runner
        self._ids = moves.ids

    def namespaces(self, owner: str | None = None) -> list[CacheNamespaceInfo]:
        """Describe the cache's namespaces (``owner``'s, or all) as ``status`` reports them."""
        infos = [
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
            for ns in self._cache.namespaces.values()
            if owner is None or ns.key[0] == owner
        ]
        return infos if self._tiers is None else self._tiers.describe(infos, owner)

    def tiers(self) -> list[CacheTierInfo]:
        """Describe the tiers below the host pool as ``status`` reports them."""
        return [] if self._tiers is None else self._tiers.tiers()

    def _keys_and_ids(
        self, data: list[memoryview], key_size: int, ids_dtype: Any
    ) -> tuple[list[bytes], IdArray]:
        keys = split_keys(data[0], key_size, self._max_ids)
        ids = self._ids(data[1], ids_dtype, "block")
        if len(keys) != ids.size:
            raise SidecarError("length_mismatch", f"{len(keys)} keys for {ids.size} block ids")
        return keys, ids

    def lookup(
        self, req: CacheLookup, data: list[memoryview], owner: str
    ) -> tuple[Reply, tuple[Any, ...]] | asyncio.Future[Reply]:
        """Count the leading keys held in every namespace the lookup names; pin them if asked."""
        cache = self._cache
        keys = split_keys(data[0], req.key_size, self._max_ids)
        cache.sweep_pins(time.monotonic())
        if self._tiers is not None:
            found = self._tiers.lookup(req, keys, owner)
            return (found, ()) if isinstance(found, CacheHits) else found
        spaces = cache.lookup_spaces(owner, req.fingerprint, req.tp_size, req.loads)
        hits = 0 if spaces is None else min(ns.index.lookup(keys) for ns in spaces)
        pin_id = 0
        cache.metrics.lookup(hits, len(keys) - hits)
        for ns in spaces or ():
            ns.hit_blocks += hits
        if req.pin_s > 0 and spaces is not None and hits:
            pin_id = cache.pin([(ns, keys[:hits]) for ns in spaces], req.pin_s, req.loads)
            if pin_id:
                cache.metrics.pin(hits)
        return CacheHits(id=req.id, hits=hits, pin_id=pin_id), ()

    def store(
        self, req: CacheStore, data: list[memoryview], answer: Answer, owner: str
    ) -> asyncio.Future[Reply] | tuple[Reply, tuple[Any, ...]]:
        """Copy a worker's blocks into free (or evicted) slots of its namespace."""
        cache = self._cache
        keys, ids = self._keys_and_ids(data, req.key_size, req.ids_dtype)
        worker = worker_of(self._registry, req.source.worker, req.source.epoch, req.source.medium)
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
        tp_size = _ranks(ns, worker)
        if self._tiers is not None and res.present:  # computed again: a second use
            again = set(res.positions)
            self._tiers.used(ns, [k for i, k in enumerate(keys) if i not in again], tp_size)
        if not stored:
            reply = CacheStored(
                id=req.id, stored=0, present=res.present, dropped=res.dropped, evicted=0, nbytes=0
            )
            return reply, ()
        try:
            job = move_job(
                self._registry,
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
                if self._tiers is not None:
                    self._tiers.stored(ns, stored, tp_size)
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

        return self._runner.run(_timed(job, finished), req.id, answer, track=track, finish=make)

    def load(
        self, req: CacheLoad, data: list[memoryview], answer: Answer, owner: str
    ) -> asyncio.Future[Reply] | tuple[Reply, tuple[Any, ...]]:
        """Copy the held blocks of the named keys into a worker's blocks; name the missing.

        Blocks that are only on the disk tier are brought up first (the load waits for them,
        until its ``not_after``).
        """
        keys, ids = self._keys_and_ids(data, req.key_size, req.ids_dtype)
        worker = worker_of(self._registry, req.target.worker, req.target.epoch, req.target.medium)
        event_device(cuda_devices(worker.device), req.events)  # even when nothing is copied
        tiers = self._tiers
        if tiers is not None:
            key, _ = self._cache.key_of(owner, req.fingerprint, worker)
            if tiers.below(key):
                ns = self._cache.namespace_for(owner, req.fingerprint, worker, create=True)
                assert ns is not None
                wait = tiers.before_load(ns, keys, req.not_after)
                if wait is not None:
                    return self._load_later(
                        wait, req=req, keys=keys, ids=ids.copy(), answer=answer, owner=owner
                    )
        return self._load(req, keys, ids, answer, owner)

    def _load_later(
        self,
        wait: asyncio.Future[None],
        *,
        req: CacheLoad,
        keys: list[bytes],
        ids: IdArray,
        answer: Answer,
        owner: str,
    ) -> asyncio.Future[Reply]:
        """Run the load once ``wait`` ends; the outcome of its job (or its reply) in one future."""
        outcome: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

        def go(_: asyncio.Future[None]) -> None:
            try:
                ran = self._load(req, keys, ids, answer, owner)
            except Exception as exc:  # answered as a job's failure is (a worker gone meanwhile)
                if isinstance(exc, SidecarError):
                    error = Error(id=req.id, code=exc.code, message=exc.message)
                else:
                    log.exception("cache_load %d failed", req.id)
                    error = Error(id=req.id, code="internal", message=f"{type(exc).__name__}")
                answer.send(error)
                outcome.set_result(error)
                return
            if isinstance(ran, tuple):
                answer.send(ran[0])
                outcome.set_result(ran[0])
                return
            ran.add_done_callback(lambda job: outcome.set_result(reply_of(job, req.id)))

        wait.add_done_callback(go)
        return outcome

    def _load(
        self, req: CacheLoad, keys: list[bytes], ids: IdArray, answer: Answer, owner: str
    ) -> asyncio.Future[Reply] | tuple[Reply, tuple[Any, ...]]:
        cache = self._cache
        worker = worker_of(self._registry, req.target.worker, req.target.epoch, req.target.medium)
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
            self._registry, ns.buffers, worker.device, slot_ids(held), ids[found], events=req.events
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
                if self._tiers is not None:  # a second use
                    self._tiers.used(space, [keys[i] for i in found], _ranks(space, worker))

        def make(moved: Moved) -> Reply:
            return CacheLoaded(
                id=req.id,
                loaded=len(held),
                nbytes=moved.nbytes,
                seconds=moved.seconds,
                missing_block_ids=missing,
            )

        return self._runner.run(job, req.id, answer, track=track, finish=make)
