"""The host pool's namespaces over the tier below them: lookups, read-ahead, write-through.

`TieredCache` joins the prefix cache in memory (`kvsidecar.daemon.cache.prefix`, medium ``CPU``)
and a `kvsidecar.daemon.cache.tier.BlockTier` below it (the disk tier, ``STORAGE``). The cache's
commands (`kvsidecar.daemon.cache.commands`) call it; everything here runs on the event loop and
costs what the request names (its keys, its TP ranks), the I/O runs on the tier's threads.

- **Lookups count blocks on either tier**: a leading key counts when every rank holds it in
  memory, or on disk, or is bringing it up. A lookup that pins starts bringing up its hit's
  blocks that are only on disk (read-ahead: slots of the namespace in the pool, filled from disk,
  checked, then ready and pinned under the lookup's pin), so that the load that follows reads
  memory. With ``disk_wait_s`` the answer waits for them (at most that long) and counts what came
  up; the connector asks in the background, so vLLM admits the request once its blocks are in
  memory. ``disk_hits`` tells the scheduler how much of the hit was on disk.
- **Loads** of blocks that are only on disk (no lookup brought them up) bring them up first, and
  wait for them until the load's ``not_after``.
- **Write policy: write-through on the second use.** A block reaches the disk once it is used a
  second time (loaded, or stored again) while in memory, and is written from its memory slot
  (pinned meanwhile) right then; a block evicted from memory before that never reaches the
  device (``cache_disk_admit = "reuse"``, the default: most blocks of a prefix cache are used
  once, and SSDs wear with writes). ``all`` writes every block as it is stored. Write-through
  rather than write-back on eviction: what is on disk is there before the daemon can be killed,
  and an eviction from memory never waits for a write.
- **One LRU across tiers**: a block used in memory is most recently used on disk too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import msgspec

from kvsidecar.daemon.cache.prefix import MAX_TP_SIZE, Namespace, NamespaceKey, PrefixCache
from kvsidecar.daemon.cache.tier import BlockTier, HostBlocks, Rows, SpaceShape, TierSpace
from kvsidecar.daemon.metrics.tiers import TierMetrics
from kvsidecar.wire.cache import CacheHits, CacheLookup, CacheNamespaceInfo, CacheTierInfo
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Reply

LOAD_WAIT_S = 30.0
"""Longest a load without ``not_after`` waits for its blocks to come up from disk."""
MAX_DISK_WAIT_S = 30.0
"""Longest a lookup may ask to wait (``disk_wait_s``)."""


def host_rows(ns: Namespace) -> list[Rows]:
    """Return the namespace's slots as `HostBlocks` pieces, in its layers' order."""
    return [v.numpy() for layer in ns.buffers.layers.values() for v in layer.block_views]


def shape_of(ns: Namespace) -> SpaceShape:
    """Return the namespace's `SpaceShape` (its layers in the order of its buffers)."""
    return SpaceShape(tuple(ns.layers.items()), ns.block_bytes)


@dataclasses.dataclass
class _Rising:
    """A block being brought up from disk into a slot of its namespace."""

    done: asyncio.Future[bool]
    pins: list[int]
    """Lookup pins that take its slot once it is ready."""


class TieredCache:
    """See the module doc."""

    def __init__(
        self, cache: PrefixCache, tier: BlockTier, *, admit_all: bool, metrics: TierMetrics
    ) -> None:
        self.cache = cache
        self.tier = tier
        self.admit_all = admit_all
        self.metrics = metrics
        self._rising: dict[tuple[NamespaceKey, bytes], _Rising] = {}
        tier.in_use = self._in_use

    def _in_use(self, key: NamespaceKey) -> bool:
        ns = self.cache.namespaces.get(key)
        return ns is not None and bool(ns.workers or ns.busy or ns.index.pinned)

    def below(self, key: NamespaceKey) -> bool:
        """Whether the tier below holds a space for namespace ``key``."""
        return self.tier.space(key) is not None

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, req: CacheLookup, keys: list[bytes], owner: str
    ) -> CacheHits | asyncio.Future[Reply]:
        """Count the leading keys held on every rank, in memory or below; pin and bring up."""
        cache = self.cache
        for name, value in (("tp_size", req.tp_size), ("loads", req.loads)):
            if not 1 <= value <= MAX_TP_SIZE:
                raise SidecarError("invalid_message", f"{name} {value} outside 1..{MAX_TP_SIZE}")
        if not (math.isfinite(req.disk_wait_s) and 0 <= req.disk_wait_s <= MAX_DISK_WAIT_S):
            raise SidecarError("invalid_message", f"disk_wait_s outside 0..{MAX_DISK_WAIT_S}")
        ranks = [(owner, req.fingerprint, r) for r in range(req.tp_size)]
        rams = [cache.namespaces.get(k) for k in ranks]
        disks = [self.tier.space(k) for k in ranks]
        hits = below = 0
        for key in keys:
            where = self._where(key, ranks, rams, disks)
            if where is None:
                break
            hits += 1
            below += where
        cache.metrics.lookup(hits, len(keys) - hits)
        self.metrics.hit("CPU", hits - below)
        self.metrics.hit(self.tier.medium, below)
        for ns in rams:
            if ns is not None:
                ns.hit_blocks += hits
        if not (req.pin_s > 0 and hits):
            return CacheHits(id=req.id, hits=hits, disk_hits=below)
        spaces = self._namespaces(ranks, rams, disks, req.tp_size)
        if spaces is None:  # no room in memory to bring them up: what memory holds
            hits = min(ns.index.lookup(keys) if ns else 0 for ns in rams)
            below = 0
            if not hits:
                return CacheHits(id=req.id, hits=0)
            spaces = [ns for ns in rams if ns is not None]
        hit = keys[:hits]
        pin_id = cache.pin([(ns, hit) for ns in spaces], req.pin_s, req.loads)
        if pin_id:
            cache.metrics.pin(hits)
        waits: list[asyncio.Future[bool]] = []
        for ns, disk in zip(spaces, disks, strict=True):
            waits += self._bring_up(ns, disk, [k for k in hit if not ns.index.lookup((k,))], pin_id)
        if not waits or req.disk_wait_s <= 0:
            return CacheHits(id=req.id, hits=hits, pin_id=pin_id, disk_hits=below)
        out: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

        def answer() -> None:
            if out.done():
                return
            up = 0
            for key in hit:
                if not all(
                    ns.index.lookup((key,)) or (ns.key, key) in self._rising for ns in spaces
                ):
                    break
                up += 1
            out.set_result(CacheHits(id=req.id, hits=up, pin_id=pin_id, disk_hits=min(below, up)))

        _when_all(waits, req.disk_wait_s, answer)
        return out

    def _where(
        self,
        key: bytes,
        ranks: list[NamespaceKey],
        rams: list[Namespace | None],
        disks: list[TierSpace | None],
    ) -> int | None:
        """0: every rank holds ``key`` in memory; 1: some only below (or rising); None: missed."""
        below = 0
        for nk, ram, disk in zip(ranks, rams, disks, strict=True):
            if ram is not None and ram.index.lookup((key,)):
                continue
            if (nk, key) in self._rising or (disk is not None and disk.holds(key)):
                below = 1
                continue
            return None
        return below

    def _namespaces(
        self,
        ranks: list[NamespaceKey],
        rams: list[Namespace | None],
        disks: list[TierSpace | None],
        tp_size: int,
    ) -> list[Namespace] | None:
        """Return each rank's namespace in memory (None: one could not be made).

        One that is missing is made from its space below.
        """
        out = []
        for nk, ram, disk in zip(ranks, rams, disks, strict=True):
            ns = ram
            if ns is None:
                if disk is None:
                    return None
                try:
                    ns = self.cache.ensure(nk, dict(disk.shape.layers), tp_size)
                except SidecarError:
                    return None
            out.append(ns)
        return out

    # ------------------------------------------------------------------ bringing blocks up

    def _bring_up(
        self, ns: Namespace, disk: TierSpace | None, keys: Sequence[bytes], pin_id: int
    ) -> list[asyncio.Future[bool]]:
        """Bring ``keys`` of ``ns`` up from ``disk`` (those not on their way); their futures.

        Those that come up join ``pin_id`` (0: none) as they become ready.
        """
        waits = []
        todo = []
        for key in keys:
            rising = self._rising.get((ns.key, key))
            if rising is not None:
                if pin_id:
                    rising.pins.append(pin_id)
                waits.append(rising.done)
            elif disk is not None and disk.holds(key):
                todo.append(key)
        if not todo or disk is None:
            return waits
        res = ns.index.reserve(todo)
        self.cache.metrics.evicted(res.evicted)
        up = [todo[i] for i in res.positions]
        if not up:
            return waits
        loop = asyncio.get_running_loop()
        risings = []
        for key in up:
            rising = _Rising(loop.create_future(), [pin_id] if pin_id else [])
            self._rising[(ns.key, key)] = rising
            risings.append(rising)
            waits.append(rising.done)
        ns.busy += 1
        read = disk.get(up, HostBlocks(host_rows(ns), res.slots))

        def settle(outcome: asyncio.Future[list[bool]]) -> None:
            ns.busy -= 1
            oks = (
                [False] * len(up)
                if outcome.cancelled() or outcome.exception()
                else outcome.result()
            )
            good = [(k, s) for k, s, ok in zip(up, res.slots, oks, strict=True) if ok]
            bad = [(k, s) for k, s, ok in zip(up, res.slots, oks, strict=True) if not ok]
            ns.index.commit([k for k, _ in good], [s for _, s in good], ok=True)
            ns.index.commit([k for k, _ in bad], [s for _, s in bad], ok=False)
            for key, slot, ok, rising in zip(up, res.slots, oks, risings, strict=True):
                del self._rising[(ns.key, key)]
                if ok:  # pinned before anything else runs: nothing can evict it in between
                    for pid in rising.pins:
                        self.cache.extend_pin(pid, ns, [slot])
                rising.done.set_result(ok)

        read.add_done_callback(settle)
        return waits

    def before_load(
        self, ns: Namespace, keys: Sequence[bytes], not_after: float
    ) -> asyncio.Future[None] | None:
        """Return what a load of ``keys`` into ``ns`` waits for first (None: nothing).

        Its blocks still on disk come up first, until ``not_after``.
        """
        disk = self.tier.space(ns.key)
        need = [k for k in keys if not ns.index.lookup((k,))]
        waits = self._bring_up(ns, disk, need, 0) if need else []
        if not waits:
            return None
        wait_s = not_after - time.monotonic() if not_after else LOAD_WAIT_S
        out: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def answer() -> None:
            if not out.done():
                out.set_result(None)

        _when_all(waits, max(wait_s, 0.0), answer)
        return out

    # ------------------------------------------------------------------ writes

    def stored(self, ns: Namespace, keys: Sequence[bytes], tp_size: int) -> None:
        """Note that a store made ``keys`` ready in ``ns`` (written through under ``all``)."""
        if self.admit_all:
            self._write(ns, keys, tp_size)

    def used(self, ns: Namespace, keys: Sequence[bytes], tp_size: int) -> None:
        """Note a second use of ``keys`` of ``ns`` (loaded, or stored again).

        They are written through now, and most recently used below too.
        """
        self._write(ns, keys, tp_size)

    def _write(self, ns: Namespace, keys: Sequence[bytes], tp_size: int) -> None:
        if not keys or not self.tier.up:
            return
        disk = self.tier.space(ns.key, shape_of(ns), tp_size=tp_size)
        if disk is None:
            return
        disk.touch(keys)
        todo = [k for k in keys if not disk.holds(k)]
        pairs = [(k, s) for k, s in zip(todo, ns.index.slots(todo), strict=True) if s is not None]
        if not pairs:
            return
        slots = [s for _, s in pairs]
        ns.index.pin(slots)  # not evicted, so not rewritten, while the disk reads it
        ns.busy += 1
        written = disk.put([k for k, _ in pairs], HostBlocks(host_rows(ns), slots))

        def release(_: asyncio.Future[list[bool]]) -> None:
            ns.index.unpin(slots)
            ns.busy -= 1

        written.add_done_callback(release)

    # ------------------------------------------------------------------ status

    def describe(
        self, spaces: list[CacheNamespaceInfo], owner: str | None
    ) -> list[CacheNamespaceInfo]:
        """Add each namespace's disk blocks to ``status``'s rows, and the spaces only on disk."""
        below = {s.key: s for s in self.tier.spaces()}
        out = []
        for info in spaces:
            space = below.pop((info.owner, info.fingerprint, info.tp_rank), None)
            out.append(info if space is None else _with_disk(info, space))
        for key, space in below.items():
            if owner is None or key[0] == owner:
                blank = CacheNamespaceInfo(
                    owner=key[0],
                    fingerprint=key[1],
                    tp_rank=key[2],
                    capacity_blocks=0,
                    ready_blocks=0,
                    pinned_blocks=0,
                    block_bytes=space.shape.block_bytes,
                )
                out.append(_with_disk(blank, space))
        return out

    def tiers(self) -> list[CacheTierInfo]:
        """Describe the tiers below the pool for ``status``."""
        s = self.tier.state()
        return [
            CacheTierInfo(
                medium=s.medium,
                up=s.up,
                capacity_bytes=s.capacity_bytes,
                used_bytes=s.used_bytes,
                blocks=s.blocks,
                spaces=s.spaces,
                free_bytes=s.free_bytes,
                reason=s.reason,
                path=s.path,
            )
        ]


def _with_disk(info: CacheNamespaceInfo, space: TierSpace) -> CacheNamespaceInfo:
    return msgspec.structs.replace(
        info, disk_capacity_blocks=space.capacity_blocks, disk_blocks=space.ready_blocks
    )


def _when_all(
    waits: list[asyncio.Future[bool]], timeout_s: float, then: Callable[[], None]
) -> None:
    """Call ``then()`` once every future of ``waits`` is done, or after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    left = [len(waits)]
    timer = loop.call_later(timeout_s, then)

    def one(_: asyncio.Future[bool]) -> None:
        left[0] -= 1
        if left[0] == 0:
            timer.cancel()
            then()

    for fut in waits:
        fut.add_done_callback(one)
