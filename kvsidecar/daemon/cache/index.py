"""The content index of one prefix-cache namespace: block key -> slot, LRU, pins. Pure.

A namespace (`kvsidecar.daemon.cache.prefix`) owns ``capacity`` slots of host memory, each holding
one KV block. This index says which key (vLLM's block hash) lives in which slot and in what state:

- **filling**: a store is copying the block in; invisible to lookups and loads, never evicted;
- **ready**: the copy finished (`CacheIndex.commit`); lookups count it, loads read it, and it is
  evictable, least recently used first, unless pinned.

Pins are counts per slot: a lookup that pins for a scheduler, and every load while its copy
runs, keep their slots from being evicted (so from being rewritten by a store) until unpinned.
Nothing here touches memory: the namespace copies, this decides.

Every operation costs in proportion to the keys or slots it names, never to the namespace's
size: a pinned key leaves the eviction order while it is pinned (and comes back, most recently
used, when its last pin goes), so an eviction takes the first key of that order, whatever a
client pinned.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    """What `CacheIndex.reserve` decided for a list of keys.

    ``positions[i]`` (an index into the keys) is written into ``slots[i]``; keys that were
    already there (filling or ready) are ``present``; ``dropped`` keys found no slot (every slot
    filling or pinned); ``evicted`` ready keys gave their slots up for this.
    """

    positions: list[int]
    slots: list[int]
    present: int
    dropped: int
    evicted: int


class CacheIndex:
    """Keys of one namespace's ``capacity`` slots (see the module doc)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache namespace needs at least one slot, not {capacity}")
        self.capacity = capacity
        self._slot: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        """Slot -> the key it holds (filling or ready): what a pin of a slot pins."""
        self._ready: set[bytes] = set()
        self._evictable: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Ready keys with no pin, least recently used first: the eviction order."""
        self._pins: dict[int, int] = {}
        # A stack: low slots are handed out first, which keeps runs of slots contiguous.
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions_total = 0

    @classmethod
    def restored(cls, capacity: int, entries: Sequence[tuple[bytes, int]]) -> CacheIndex:
        """Build an index holding ``entries`` (key, slot) ready, least recently used first.

        What a tier that kept its blocks across a restart found (`kvsidecar.daemon.cache.disk`);
        a key or slot named twice keeps its last entry.
        """
        index = cls(capacity)
        for key, slot in entries:
            if not 0 <= slot < capacity:
                continue
            old = index._key.pop(slot, None)
            if old is not None:
                index._slot.pop(old, None)
                index._ready.discard(old)
                index._evictable.pop(old, None)
            if key in index._slot:
                del index._key[index._slot[key]]
            index._slot[key] = slot
            index._key[slot] = key
            index._ready.add(key)
            index._evictable.pop(key, None)
            index._evictable[key] = None
        used = set(index._key)
        index._free = [s for s in range(capacity - 1, -1, -1) if s not in used]
        return index

    @property
    def ready(self) -> int:
        """Keys that lookups can see."""
        return len(self._ready)

    @property
    def pinned(self) -> int:
        """Slots held by at least one pin."""
        return len(self._pins)

    @property
    def used(self) -> int:
        """Slots holding a key (filling or ready)."""
        return len(self._slot)

    def has(self, key: bytes) -> bool:
        """Whether ``key`` holds a slot (filling or ready)."""
        return key in self._slot

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are ready. Changes nothing (not even the LRU order)."""
        hits = 0
        for key in keys:
            if key not in self._ready:
                break
            hits += 1
        return hits

    def slots(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's slot if it is ready, else None; ready keys become most recently used."""
        out: list[int | None] = []
        for key in keys:
            if key in self._ready:
                self._used(key)
                out.append(self._slot[key])
            else:
                out.append(None)
        return out

    def pin(self, slots: Sequence[int]) -> None:
        """Keep these slots from eviction until `unpin` (counts: pin twice, unpin twice)."""
        for s in slots:
            count = self._pins.get(s, 0)
            self._pins[s] = count + 1
            if not count and (key := self._key.get(s)) is not None:
                self._evictable.pop(key, None)

    def unpin(self, slots: Sequence[int]) -> None:
        """Release one pin of each slot (slots no longer pinned are ignored)."""
        for s in slots:
            left = self._pins.get(s, 0) - 1
            if left > 0:
                self._pins[s] = left
            elif self._pins.pop(s, None) is not None:
                key = self._key.get(s)
                if key is not None and key in self._ready:
                    self._evictable[key] = None  # used last by the pin's holder

    def _used(self, key: bytes) -> None:
        """Make a used key the most recently used of those that may be evicted."""
        if key in self._evictable:
            self._evictable.move_to_end(key)

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Give each new key a slot, marked filling (free slots first, then LRU eviction)."""
        positions: list[int] = []
        slots: list[int] = []
        present = dropped = evicted = 0
        for i, key in enumerate(keys):
            if key in self._slot:  # stored already, or being stored (also earlier in this list)
                present += 1
                self._used(key)
                continue
            if self._free:
                slot = self._free.pop()
            else:
                found = self._evict_one()
                if found is None:
                    dropped += 1
                    continue
                slot = found
                evicted += 1
            self._slot[key] = slot
            self._key[slot] = key
            positions.append(i)
            slots.append(slot)
        return Reservation(positions, slots, present, dropped, evicted)

    def _evict_one(self) -> int | None:
        """Free the least recently used ready, unpinned slot; None when there is none."""
        if not self._evictable:
            return None
        key, _ = self._evictable.popitem(last=False)
        self._ready.discard(key)
        slot = self._slot.pop(key)
        del self._key[slot]
        self.evictions_total += 1
        return slot

    def discard(self, keys: Sequence[bytes]) -> int:
        """Forget ready keys whose copy was found damaged; their slots are free. How many."""
        gone = 0
        for key in keys:
            if key not in self._ready:
                continue
            self._ready.discard(key)
            self._evictable.pop(key, None)
            slot = self._slot.pop(key)
            del self._key[slot]
            self._free.append(slot)
            gone += 1
        return gone

    def shrink(self, capacity: int) -> int:
        """Give up the slots from ``capacity`` on (none may be pinned or filling).

        Costs the slots given up (and the free list). Returns how many ready keys left.
        """
        gone = 0
        for slot in range(capacity, self.capacity):
            key = self._key.pop(slot, None)
            if key is None:
                continue
            del self._slot[key]
            if key in self._ready:
                self._ready.discard(key)
                self._evictable.pop(key, None)
                gone += 1
        self._free = [s for s in self._free if s < capacity]
        self.capacity = capacity
        return gone

    def commit(self, keys: Sequence[bytes], slots: Sequence[int], *, ok: bool) -> None:
        """End a store: its keys become ready (``ok``), or their slots free again."""
        for key, slot in zip(keys, slots, strict=True):
            if self._slot.get(key) != slot or key in self._ready:
                continue  # not this store's reservation (cannot happen; never corrupt the map)
            if ok:
                self._ready.add(key)
                if slot not in self._pins:
                    self._evictable[key] = None
            else:
                del self._slot[key]
                del self._key[slot]
                self._free.append(slot)
