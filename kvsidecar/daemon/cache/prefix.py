"""The node's shared prefix cache: namespaces of host blocks found by content, and their pins.

An engine (through its connector, `kvsidecar.integrations.vllm`) stores the full blocks it
computed under their content keys (vLLM's block hashes), and any engine of the same model later
loads them instead of recomputing: the daemon is the node's one shared cache, so every engine
with the same model and layout, and a restarted one, finds what the others computed.

**Namespaces.** Blocks are kept per namespace ``(owner, fingerprint, tp_rank)``:

- ``owner`` is the transport user of the connection (``uid:<n>`` on ipc, ``curve:<key>`` on tcp):
  a namespace is read and written only by connections of that user, so one user can neither
  read nor poison another's cache, whatever fingerprint it claims;
- ``fingerprint`` is the connector's digest of what must match for a block to mean the same
  thing (model, dtype, block size, layout, TP size, hash algorithm);
- ``tp_rank``: each rank holds its own heads. A lookup counts a block only when every rank
  ``0 .. tp_size-1`` holds it. MLA's latent (every layer ``mla``) is the same on every rank:
  all ranks of such an engine share rank 0's namespace, so it is stored once per node and
  loaded into every rank (a lookup names ``tp_size`` 1).

A namespace is created by its first store, with the layers (names and descriptors, block count
aside) of the storing worker; every later store and load must have the same layers
(``incompatible_buffers``), so a false fingerprint can never make a copy run out of bounds. Its
blocks live in a buffer set reserved in the host pool: an equal share of its owner's room per TP
rank, as far as there is room. **No owner takes the room another needs**: an owner's namespaces
together hold at most its share of ``cache_bytes`` (an equal share per allowed uid), and count
with its host mirrors against its host-pool quota (``host_pool_user_bytes``, by default the
pool's share per allowed uid); a new namespace of an owner at its bound first takes the room of
that owner's own idle namespaces. A namespace outlives its engines (a restarted engine finds its
blocks); it goes when its room is needed for a new one and none of its workers is registered.
When the namespaces in use leave a new one less than an equal share of ``cache_bytes``, those
holding more are made again at an equal share, empty (a new model or a cache reset on the node).

**Keys and slots** are kept by `kvsidecar.daemon.cache.index.CacheIndex`: a stored block is
visible only once its copy has finished, and least recently used blocks are evicted when a
namespace is full, never while a lookup's pin or a running load holds them.

The command handlers (`kvsidecar.daemon.cache.commands.CacheCommands`) run on the event loop;
the copies run on the copy executor as ordinary move jobs (`kvsidecar.node.jobs`), so they are
ordered against every other copy of the same blocks.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvsidecar.core import layout
from kvsidecar.daemon.cache.index import CacheIndex
from kvsidecar.daemon.metrics.cache import CacheMetrics, CacheState
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.node.config import Config
from kvsidecar.node.registry import BufferSet, Registry, Worker, check_epoch, host_buffer_set
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import BufferDescriptor, WorkerRef

log = logging.getLogger("kvsidecar.daemon")

NamespaceKey = tuple[str, str, int]
"""``(owner, fingerprint, tp_rank)``: see the module doc."""

MAX_KEY_SIZE = 64
"""Longest block key accepted (vLLM's are 32 bytes for sha256, 8 for xxhash)."""
MAX_TP_SIZE = 1024
"""Largest ``tp_size`` a lookup may name."""


def split_keys(frame: memoryview, key_size: int, max_keys: int) -> list[bytes]:
    """Cut a key frame into ``key_size``-byte keys; typed errors for bad sizes or too many."""
    if not 1 <= key_size <= MAX_KEY_SIZE:
        raise SidecarError("invalid_message", f"key_size {key_size} outside 1..{MAX_KEY_SIZE}")
    nbytes = frame.nbytes
    if nbytes % key_size:
        raise SidecarError(
            "bad_frame",
            f"key frame of {nbytes} bytes is not a whole number of {key_size}-byte keys",
        )
    count = nbytes // key_size
    if count > max_keys:
        raise SidecarError("too_large", f"{count} keys, more than the limit {max_keys}")
    raw = frame.tobytes()
    return [raw[i : i + key_size] for i in range(0, nbytes, key_size)]


@dataclasses.dataclass(eq=False)
class Namespace:
    """One namespace: its blocks in the host pool, their index, and who used it."""

    key: NamespaceKey
    buffers: BufferSet
    layers: dict[str, BufferDescriptor]
    """Each layer's descriptor with ``num_blocks`` 1: what every user's layers must match."""
    index: CacheIndex
    block_bytes: int
    workers: set[WorkerRef] = dataclasses.field(default_factory=set)
    last_used: float = 0.0
    busy: int = 0
    """Copies in flight on its blocks (it is not dropped meanwhile)."""
    hit_blocks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    """Running totals of its lookups' hits, stores and loads (``status``)."""

    @property
    def capacity_bytes(self) -> int:
        """Bytes its buffer set holds."""
        return self.buffers.nbytes


MAX_NAMESPACES_PER_OWNER = 1024
"""Cache namespaces one owner may hold: an engine holds one per TP rank and model, so an honest
owner stays far below; past it its idle ones are dropped for a new one, else it is refused."""

MAX_PINS_PER_OWNER = 4096
"""Live pins one owner may hold, all its namespaces together: a lookup past it is answered
without a pin (``pin_id`` 0; the load then finds what was not evicted meanwhile). A scheduler
pins once per request it is about to load, so an honest one stays far below."""


@dataclasses.dataclass
class _Pin:
    """A lookup's pin: per namespace, the slots it holds, until loaded or ``deadline``."""

    deadline: float
    owner: str
    parts: dict[NamespaceKey, list[int]]
    loads: dict[NamespaceKey, int]
    """Loads that still release a part before it ends (`CacheLookup.loads`)."""


def _shape_of(desc: BufferDescriptor) -> BufferDescriptor:
    """Return a layer's descriptor with its block count set aside (1), as namespaces compare."""
    return msgspec.structs.replace(desc, num_blocks=1)


class PrefixCache:
    """Every namespace of the daemon, the pins of lookups, and the cache's metrics."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        pool: HostPool | None,
        metrics: Callable[[Callable[[], CacheState]], CacheMetrics],
    ) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.namespaces: dict[NamespaceKey, Namespace] = {}
        self.current: dict[WorkerRef, NamespaceKey] = {}
        """The namespace each worker used last: a worker uses one at a time (an engine that
        resets its cache moves to a new fingerprint), so only that one is held for it."""
        self.pins: dict[int, _Pin] = {}
        self._pin_ids = itertools.count(1)
        self._deadlines: list[tuple[float, int]] = []
        """A heap of (deadline, pin id): a sweep looks only at the pins whose lease ended."""
        self._pins_of: collections.Counter[str] = collections.Counter()
        """Live pins per owner (`MAX_PINS_PER_OWNER`)."""
        self.metrics = metrics(self.state)

    def state(self) -> CacheState:
        """Return what the gauges show (`kvsidecar.daemon.metrics.cache`)."""
        spaces = self.namespaces.values()
        return CacheState(
            capacity_bytes=sum(ns.capacity_bytes for ns in spaces),
            used_bytes=sum(ns.index.ready * ns.block_bytes for ns in spaces),
            blocks=sum(ns.index.ready for ns in spaces),
            namespaces=len(self.namespaces),
            pinned_blocks=sum(ns.index.pinned for ns in spaces),
        )

    def close(self) -> None:
        """Release every namespace's memory (shutdown)."""
        for ns in self.namespaces.values():
            ns.buffers.close()
        self.namespaces.clear()
        self.current.clear()
        self.pins.clear()
        self._deadlines.clear()
        self._pins_of.clear()

    def sweep_pins(self, now: float) -> None:
        """Release the pins whose lease ended (their engine never loaded them).

        Costs the pins that ended (each pin's deadline is popped once), not the pins held.
        """
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, pin_id = heapq.heappop(deadlines)
            self.release_pin(pin_id)  # already released: nothing

    async def pin_sweep_loop(self) -> None:
        """Release ended pins every quarter of ``cache_pin_s`` (50 ms to 1 s), until cancelled.

        Lookups and stores sweep too; this bounds how long an ended pin outlives its lease when
        none come (an idle node): status, metrics and eviction see it gone within the period.
        """
        period = min(1.0, max(0.05, self.config.cache_pin_s / 4))
        while True:
            await asyncio.sleep(period)
            self.sweep_pins(time.monotonic())

    def pin(self, found: list[tuple[Namespace, list[bytes]]], pin_s: float, loads: int = 1) -> int:
        """Pin each namespace's keys until ``loads`` loads or ``pin_s`` end it; return its id.

        0: nothing pinned, the owner holds `MAX_PINS_PER_OWNER` pins already.
        """
        owner = found[0][0].key[0] if found else ""
        if self._pins_of[owner] >= MAX_PINS_PER_OWNER:
            return 0
        parts: dict[NamespaceKey, list[int]] = {}
        for ns, keys in found:
            slots = [s for s in ns.index.slots(keys) if s is not None]
            ns.index.pin(slots)
            parts[ns.key] = slots
        pin_id = next(self._pin_ids)
        deadline = time.monotonic() + min(pin_s, self.config.cache_pin_s)
        self.pins[pin_id] = _Pin(deadline, owner, parts, dict.fromkeys(parts, loads))
        heapq.heappush(self._deadlines, (deadline, pin_id))
        self._pins_of[owner] += 1
        return pin_id

    def extend_pin(self, pin_id: int, ns: Namespace, slots: list[int]) -> bool:
        """Add slots of ``ns`` that became ready (brought up from disk) to a live pin."""
        pin = self.pins.get(pin_id)
        if pin is None or not slots:
            return False
        part = pin.parts.setdefault(ns.key, [])
        pin.loads.setdefault(ns.key, 1)
        ns.index.pin(slots)
        part.extend(slots)
        return True

    def release_pin(self, pin_id: int, only: NamespaceKey | None = None) -> None:
        """Release a pin, or one load's hold on its part on ``only`` (unknown ids: nothing)."""
        pin = self.pins.get(pin_id)
        if pin is None:
            return
        if only is not None and pin.loads.get(only, 0) > 1:
            pin.loads[only] -= 1
            return
        for key in [only] if only is not None else list(pin.parts):
            slots = pin.parts.pop(key, None) if key is not None else None
            ns = self.namespaces.get(key) if key is not None else None
            if slots is not None and ns is not None:
                ns.index.unpin(slots)
        if not pin.parts:
            del self.pins[pin_id]
            self._pins_of[pin.owner] -= 1
            if not self._pins_of[pin.owner]:
                del self._pins_of[pin.owner]

    def lookup_spaces(
        self, owner: str, fingerprint: str, tp_size: int, loads: int = 1
    ) -> list[Namespace] | None:
        """Return the namespaces of every rank, or None when one of them does not exist.

        ``loads`` (`CacheLookup.loads`) is checked here too, with ``tp_size``.
        """
        for name, value in (("tp_size", tp_size), ("loads", loads)):
            if not 1 <= value <= MAX_TP_SIZE:
                raise SidecarError("invalid_message", f"{name} {value} outside 1..{MAX_TP_SIZE}")
        spaces = []
        for rank in range(tp_size):
            ns = self.namespaces.get((owner, fingerprint, rank))
            if ns is None:
                return None
            spaces.append(ns)
        return spaces

    @staticmethod
    def key_of(
        owner: str, fingerprint: str, worker: Worker
    ) -> tuple[NamespaceKey, dict[str, BufferDescriptor]]:
        """Return the key of the worker's namespace ``fingerprint``, and its layers.

        The layers as namespaces keep them; an MLA engine's ranks share rank 0's namespace.
        """
        if not fingerprint or len(fingerprint) > 256:
            raise SidecarError("invalid_message", "fingerprint must be 1..256 characters")
        layers = {n: _shape_of(lb.descriptor) for n, lb in worker.device.layers.items()}
        replicated = bool(layers) and all(d.arrangement == "mla" for d in layers.values())
        return (owner, fingerprint, 0 if replicated else worker.ref.tp_rank), layers

    def namespace_for(
        self, owner: str, fingerprint: str, worker: Worker, *, create: bool, capacity_bytes: int = 0
    ) -> Namespace | None:
        """Return the worker's namespace (made by a store if missing), checking its layers."""
        key, layers = self.key_of(owner, fingerprint, worker)
        replicated = bool(layers) and all(d.arrangement == "mla" for d in layers.values())
        # Before a namespace is made: the one this worker leaves may give it its room.
        self._move(worker.ref, key)
        ns = self.namespaces.get(key)
        if ns is None and create:
            ns = self._create(key, layers, 1 if replicated else worker.tp_size, capacity_bytes)
        if ns is None:
            return None
        if ns.layers != layers:
            raise SidecarError(
                "incompatible_buffers",
                f"{worker.ref.label()}'s layers differ from those of cache namespace "
                f"{fingerprint!r} (same fingerprint, another model or layout)",
            )
        ns.workers.add(worker.ref)
        ns.last_used = time.monotonic()
        return ns

    def ensure(
        self, key: NamespaceKey, layers: dict[str, BufferDescriptor], tp_size: int
    ) -> Namespace:
        """Return namespace ``key``, made as a store would make it when missing.

        Blocks of a tier below the pool come up into it before any engine stored into it.
        """
        ns = self.namespaces.get(key)
        if ns is None:
            ns = self._create(key, layers, tp_size, 0)
        elif ns.layers != layers:
            raise SidecarError("incompatible_buffers", "the namespace's layers differ")
        ns.last_used = time.monotonic()
        return ns

    def _move(self, ref: WorkerRef, key: NamespaceKey) -> None:
        """Note that ``ref`` uses namespace ``key`` now: the one it used before is not held."""
        before = self.current.get(ref)
        if before != key:
            old = self.namespaces.get(before) if before is not None else None
            if old is not None:
                old.workers.discard(ref)
            self.current[ref] = key

    def _create(
        self, key: NamespaceKey, layers: dict[str, BufferDescriptor], tp_size: int, asked: int
    ) -> Namespace:
        if self.pool is None or self.config.cache_bytes <= 0:
            raise SidecarError(
                "pool_exhausted", "the prefix cache is off (cache_bytes = 0 or no host pool)"
            )
        block_bytes = sum(layout.block_bytes(d) for d in layers.values())
        if asked < 0:
            raise SidecarError("invalid_message", f"capacity_bytes {asked} < 0")
        owner = key[0]
        cap = self.config.user_cache_bytes
        share = min(asked or cap // max(tp_size, 1), cap)
        share = max(share, block_bytes + 4096 * len(layers))
        self._make_room(share, owner)
        self._share_room(share)
        room, bound = self._room_for(owner)
        buffers, blocks = self._buffers(key, layers, block_bytes, min(share, room), bound)
        ns = Namespace(key, buffers, layers, CacheIndex(blocks), block_bytes)
        self.namespaces[key] = ns
        log.info("cache namespace %s/%s rank %d: %d blocks", key[0], key[1][:16], key[2], blocks)
        return ns

    def _owned(self, owner: str) -> list[Namespace]:
        return [ns for ns in self.namespaces.values() if ns.key[0] == owner]

    def _room_for(self, owner: str) -> tuple[int, str]:
        """Bytes a new namespace of ``owner`` may take now, and the bound that gives them.

        The least of: what ``cache_bytes`` has left, what the owner's share of it has left
        (its namespaces together), what its host-pool quota has left (its host mirrors and its
        namespaces together), and what the pool has free.
        """
        assert self.pool is not None
        config = self.config
        owned = sum(ns.capacity_bytes for ns in self._owned(owner))
        bounds = [
            (config.cache_bytes - self.state().capacity_bytes, "of cache_bytes"),
            (config.user_cache_bytes - owned, f"of {owner}'s share of cache_bytes"),
            (config.user_pool_bytes - self.pool.used_by(owner), f"of {owner}'s host-pool quota"),
            (self.pool.free_bytes, "free in the host pool"),
        ]
        return min(bounds)

    def _buffers(
        self,
        key: NamespaceKey,
        layers: dict[str, BufferDescriptor],
        block_bytes: int,
        budget: int,
        bound: str = "left",
    ) -> tuple[BufferSet, int]:
        """Reserve as many blocks of ``layers`` as ``budget`` bytes hold, in the host pool.

        The bytes count against the namespace's owner in the pool (its quota).
        """
        assert self.pool is not None
        # Each layer starts on a 4 KiB boundary (`host_buffer_set`): keep room for the padding.
        blocks = (budget - 4096 * len(layers)) // block_bytes
        if blocks < 1:
            raise SidecarError(
                "pool_exhausted",
                f"no room for a cache namespace: {max(budget, 0)} bytes {bound}, blocks of "
                f"{block_bytes} bytes",
            )
        descs = [(n, msgspec.structs.replace(d, num_blocks=blocks)) for n, d in layers.items()]
        name = WorkerRef(f"cache:{key[0]}:{key[1][:16]}", tp_rank=key[2])
        return host_buffer_set(self.pool, (name, "cache"), descs, owner=key[0]), blocks

    def _share_room(self, need: int) -> None:
        """Shrink the namespaces in use that hold more than an equal share, for a new one.

        Without it the first namespace of the node (which takes all of ``cache_bytes`` by
        default) would leave none to an engine of another model, or to one that reset its
        cache while the others kept the old namespace. A namespace is shrunk by making it
        again, smaller and empty: copying its blocks would hold the event loop for as long as
        a copy of the whole cache. Only idle ones (no copy running, no pin) are shrunk; the
        others keep their room until a later store asks again.
        """
        assert self.pool is not None
        total = self.config.cache_bytes
        fair = total // (len(self.namespaces) + 1)
        want = min(need, fair)
        for ns in sorted(self.namespaces.values(), key=lambda n: -n.capacity_bytes):
            if total - self.state().capacity_bytes >= want:
                return
            if ns.capacity_bytes <= fair or ns.busy or ns.index.pinned:
                continue
            dropped = ns.index.ready
            self.metrics.evicted(dropped)
            ns.buffers.close()
            try:
                ns.buffers, blocks = self._buffers(ns.key, ns.layers, ns.block_bytes, fair)
            except SidecarError:  # the smaller set did not fit where the larger one was
                del self.namespaces[ns.key]
                log.info("cache namespace %s/%s rank %d dropped for room", *ns.key)
                continue
            ns.index = CacheIndex(blocks)
            log.info(
                "cache namespace %s/%s rank %d: shrunk to %d blocks for a new namespace "
                "(%d blocks dropped)",
                ns.key[0],
                ns.key[1][:16],
                ns.key[2],
                blocks,
                dropped,
            )

    def _make_room(self, need: int, owner: str) -> None:
        """Drop idle namespaces, least recently used first, so that ``need`` bytes fit.

        First ``owner``'s own, until its share of ``cache_bytes``, its host-pool quota and its
        count of namespaces leave room for one more; then anyone's, until ``cache_bytes`` has
        ``need`` free. A namespace in use (a copy, a pin or a registered worker) is never
        dropped here.
        """
        registered = self.registry.workers
        for ref in [r for r in self.current if r not in registered]:
            space = self.namespaces.get(self.current.pop(ref))
            if space is not None:
                space.workers.discard(ref)
        idle = sorted(
            (
                ns
                for ns in self.namespaces.values()
                if ns.busy == 0 and not ns.index.pinned and not ns.workers
            ),
            key=lambda ns: ns.last_used,
        )
        for ns in [n for n in idle if n.key[0] == owner]:
            if self._owner_has_room(owner, need):
                break
            self._drop(ns)
        if len(self._owned(owner)) >= MAX_NAMESPACES_PER_OWNER:
            raise SidecarError(
                "pool_exhausted",
                f"{owner} holds {MAX_NAMESPACES_PER_OWNER} cache namespaces in use (the limit)",
            )
        for ns in idle:
            if self.config.cache_bytes - self.state().capacity_bytes >= need:
                return
            if ns.key in self.namespaces:
                self._drop(ns)

    def _owner_has_room(self, owner: str, need: int) -> bool:
        assert self.pool is not None
        owned = self._owned(owner)
        return (
            len(owned) < MAX_NAMESPACES_PER_OWNER
            and sum(n.capacity_bytes for n in owned) + need <= self.config.user_cache_bytes
            and self.pool.used_by(owner) + need <= self.config.user_pool_bytes
        )

    def _drop(self, ns: Namespace) -> None:
        del self.namespaces[ns.key]
        ns.buffers.close()
        log.info("cache namespace %s/%s rank %d dropped for room", *ns.key)


def worker_of(registry: Registry, ref: WorkerRef, epoch: int, medium: str) -> Worker:
    """Return the registered worker a cache command names (its device blocks only)."""
    if medium != "device":
        raise SidecarError("invalid_message", "cache stores and loads use a worker's device blocks")
    worker = registry.worker(ref)
    check_epoch(worker, epoch)
    return worker


def slot_ids(slots: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Slots as an id array for a move job."""
    return np.asarray(slots, dtype=np.int64)
