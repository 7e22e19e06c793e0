"""The prefix cache's disk tier (medium ``STORAGE``): namespaces of blocks in ``cache_dir``.

A `BlockTier` (`kvsidecar.daemon.cache.tier`): per namespace a `DiskSpace`, a slab file of
fixed-size slots allocated whole when the space is made, its own `CacheIndex` (keys, slots, LRU,
pins: the same index as in memory), and the format of `kvsidecar.daemon.cache.disk_format`.
This module is the event loop's side: it decides which slots a write or read uses and settles
what the I/O threads (`kvsidecar.daemon.cache.disk_files`, ``cache_disk_threads`` of them)
report; the loop never touches a file, and what it does per request is in proportion to the keys
the request names.

**Room.** ``cache_disk_bytes`` is shared as the host pool's ``cache_bytes`` is: a new space asks
for ``cache_disk_bytes`` divided by its engine's TP size, within its owner's share (an equal
share per allowed uid, `Config.user_disk_bytes`: its own idle spaces are cut first, and past
its share an owner gets no more disk, whatever is free); idle spaces (no engine uses their
namespace, nothing in flight), least recently used first, are dropped to make room, then spaces
in use that hold more than an equal share are made again, smaller and empty. A space is made
with what is left, as far as the file system has room (fewer slots, else none).

**Faults.** A block whose record does not match (key, space, length, digest) or that the file ends
before is a miss and leaves the index. A failed write leaves its blocks out. ``ENOSPC`` costs
the blocks concerned; a read-only or taken-away file system (``EROFS``, ``EACCES``...), or
`MAX_FAILURES` failed calls in a row, turn the tier off: a log line, ``kvsidecar_cache_tier_up``
0, every later lookup a miss below the pool; the pool serves on, and ``/readyz`` says ready.

**Restarts.** `DiskTier.start` finds the spaces a previous daemon left (their index files only)
before the daemon serves, and drops what no longer fits ``cache_disk_bytes``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvsidecar.daemon.cache.disk_files import (
    FATAL,
    Chunk,
    Geometry,
    Item,
    SpaceFiles,
    TierError,
    check_writable,
    create_space,
    lock_dir,
    open_dir,
    open_space,
    plan_chunks,
    read_chunk,
    remove_space,
    scan,
    shrink_space,
    write_chunk,
)
from kvsidecar.daemon.cache.disk_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    SpaceMeta,
    index_entries,
    slot_bytes,
    space_id,
)
from kvsidecar.daemon.cache.index import CacheIndex
from kvsidecar.daemon.cache.prefix import NamespaceKey
from kvsidecar.daemon.cache.tier import HostBlocks, Removed, SpaceShape
from kvsidecar.daemon.metrics.tiers import ErrorKind, TierMetrics, TierState
from kvsidecar.node.config import Config

log = logging.getLogger("kvsidecar.daemon")

MEDIUM = "STORAGE"
MAX_FAILURES = 8
"""Failed I/O calls in a row (no success between) after which the tier turns itself off."""


def _kind(exc: OSError) -> ErrorKind:
    if exc.errno == errno.ENOSPC:
        return "no_space"
    if exc.errno in FATAL:
        return "read_only"
    return "io"


class DiskSpace:
    """One namespace's blocks on disk (a `kvsidecar.daemon.cache.tier.TierSpace`)."""

    def __init__(
        self,
        tier: DiskTier,
        key: NamespaceKey,
        shape: SpaceShape,
        index: CacheIndex,
        files: SpaceFiles | None,
        *,
        next_seq: int = 1,
    ) -> None:
        self.tier = tier
        self.key = key
        self.shape = shape
        self.index = index
        self.files = files
        self.name = space_id(*key).hex()
        self.geo = Geometry(space_id(*key), shape.block_bytes, slot_bytes(shape.block_bytes))
        self.opening: asyncio.Future[None] | None = None
        """Set while its files are being made: writes wait for it."""
        self.busy = 0
        """Chunks in flight (its files are closed and removed only once none is)."""
        self.closing = False
        self.last_used = time.monotonic()
        self._seq = itertools.count(next_seq)

    def meta(self, capacity: int) -> SpaceMeta:
        """Its meta file's contents, for ``capacity`` slots."""
        return SpaceMeta(
            version=FORMAT_VERSION,
            owner=self.key[0],
            fingerprint=self.key[1],
            tp_rank=self.key[2],
            layers=dict(self.shape.layers),
            block_bytes=self.shape.block_bytes,
            slot_bytes=self.geo.slot_bytes,
            capacity=capacity,
        )

    @property
    def capacity_blocks(self) -> int:
        """Slots of its slab."""
        return self.index.capacity

    @property
    def ready_blocks(self) -> int:
        """Blocks it holds whole."""
        return self.index.ready

    @property
    def capacity_bytes(self) -> int:
        """Bytes its files take (slab and index)."""
        return self.index.capacity * (self.geo.slot_bytes + HEADER_BYTES)

    @property
    def live(self) -> bool:
        """Whether it serves (its tier is up and it is not being dropped)."""
        return self.tier.up and not self.closing

    def holds(self, key: bytes) -> bool:
        """Whether block ``key`` is held (see `kvsidecar.daemon.cache.tier.TierSpace`)."""
        return self.live and self.index.lookup((key,)) == 1

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make these blocks, used in the pool, the most recently used here too."""
        if self.live:
            self.index.slots(keys)

    def put(self, keys: Sequence[bytes], blocks: HostBlocks) -> asyncio.Future[list[bool]]:
        """Write the blocks not here yet; per key, whether it is held (or being written)."""
        done: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        opening = self.opening
        if opening is not None and not opening.done():
            opening.add_done_callback(lambda _: self._put(list(keys), blocks, done))
        else:
            self._put(list(keys), blocks, done)
        return done

    def _put(self, keys: list[bytes], blocks: HostBlocks, done: asyncio.Future[list[bool]]) -> None:
        if not self.live or self.files is None:
            done.set_result([False] * len(keys))
            return
        res = self.index.reserve(keys)
        if res.evicted:
            self.tier.removed(self.key, "evicted", res.evicted)
        # Keys that got no slot are held already (or being written), or found no room.
        verdict = [self.index.has(key) for key in keys]
        items = [
            Item(keys[i], slot, blocks.slots[i], next(self._seq))
            for i, slot in zip(res.positions, res.slots, strict=True)
        ]
        if not items:
            done.set_result(verdict)
            return
        position = {item.key: i for i, item in zip(res.positions, items, strict=True)}

        def settle(chunk: list[Item], result: Chunk) -> None:
            good = [it for it, ok in zip(chunk, result.ok, strict=True) if ok]
            bad = [it for it, ok in zip(chunk, result.ok, strict=True) if not ok]
            self.index.commit([it.key for it in good], [it.slot for it in good], ok=True)
            self.index.commit([it.key for it in bad], [it.slot for it in bad], ok=False)
            for it in bad:
                verdict[position[it.key]] = False

        self.tier.run(
            self, items, blocks, write=True, settle=settle, done=lambda: verdict, out=done
        )

    def get(self, keys: Sequence[bytes], into: HostBlocks) -> asyncio.Future[list[bool]]:
        """Read held blocks into ``into``'s rows, checked; per key, whether it was read whole."""
        done: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        verdict = [False] * len(keys)
        if not self.live or self.files is None:
            done.set_result(verdict)
            return done
        slots = self.index.slots(keys)
        items = [
            Item(key, slot, into.slots[i])
            for i, (key, slot) in enumerate(zip(keys, slots, strict=True))
            if slot is not None
        ]
        if not items:
            done.set_result(verdict)
            return done
        position = {key: i for i, key in enumerate(keys)}
        self.index.pin([it.slot for it in items])

        def settle(chunk: list[Item], result: Chunk) -> None:
            self.index.unpin([it.slot for it in chunk])
            bad = [it.key for it, ok in zip(chunk, result.ok, strict=True) if not ok]
            for it, ok in zip(chunk, result.ok, strict=True):
                verdict[position[it.key]] = ok
            if bad and not (result.error is not None and not result.corrupt and not result.short):
                # Read and found wrong (or cut short): gone. An I/O error leaves it for later.
                dropped = self.index.discard(bad)
                self.tier.removed(self.key, "corrupt", dropped)

        self.tier.run(self, items, into, write=False, settle=settle, done=lambda: verdict, out=done)
        return done


class DiskTier:
    """The disk tier (see the module doc). Used on the event loop only."""

    medium = MEDIUM

    def __init__(self, config: Config, metrics: TierMetrics | None = None) -> None:
        self.path = config.cache_dir
        self.budget = config.cache_disk_bytes
        self.user_budget = config.user_disk_bytes
        """What one owner's spaces may hold together (`Config.user_disk_bytes`)."""
        self.direct = config.cache_disk_direct
        self.metrics = metrics
        self.on_removed: Removed | None = None
        self.in_use: Callable[[NamespaceKey], bool] = lambda key: False
        """Whether an engine uses namespace ``key`` now (set by the pool's side)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.cache_disk_threads, thread_name_prefix="kvsidecar-disk"
        )
        self._spaces: dict[NamespaceKey, DiskSpace] = {}
        self._up = False
        self.reason = "not started"
        self.rebuild_s = 0.0
        """How long `start` took to find the previous daemon's spaces."""
        self._dir_fd = -1
        self._lock_fd = -1
        self._failures = 0
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._warned: set[str] = set()

    @property
    def up(self) -> bool:
        """Whether the tier serves."""
        return self._up

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open ``cache_dir`` and find the spaces a previous daemon left; off on failure."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            found = await loop.run_in_executor(self._pool, self._open)
        except (TierError, OSError) as exc:
            self._down(str(exc))
            return
        self.rebuild_s = time.perf_counter() - started
        self._up = True
        self.reason = ""
        blocks = 0
        for space in sorted(found, key=lambda s: s.last_used):
            self._spaces[space.key] = space
            blocks += space.ready_blocks
        self._fit(self.budget)
        log.info(
            "disk tier %s: %d of %d bytes in %d namespaces, %d blocks found in %.3f s (%s I/O)",
            self.path,
            self.used_bytes(),
            self.budget,
            len(self._spaces),
            blocks,
            self.rebuild_s,
            "direct" if self.direct else "buffered",
        )

    def _open(self) -> list[DiskSpace]:
        """On an I/O thread: the directory, its lock, a write check, and every space in it."""
        self._dir_fd = open_dir(self.path)
        self._lock_fd = lock_dir(self._dir_fd, self.path)
        check_writable(self._dir_fd, self.path)
        spaces, strays = scan(self._dir_fd)
        if strays:
            log.info("disk tier: removed %d files of spaces made halfway", len(strays))
        out = []
        for name, meta in spaces:
            try:
                space = self._restore(name, meta)
            except OSError as exc:
                log.warning("disk tier: space %s unreadable (%s): removed", name, exc)
                remove_space(self._dir_fd, name)
                continue
            if space is not None:
                out.append(space)
        return out

    def _restore(self, name: str, meta: SpaceMeta) -> DiskSpace | None:
        key = (meta.owner, meta.fingerprint, meta.tp_rank)
        shape = SpaceShape(tuple(meta.layers.items()), meta.block_bytes)
        if (
            meta.version != FORMAT_VERSION
            or space_id(*key).hex() != name
            or meta.slot_bytes != slot_bytes(meta.block_bytes)
            or meta.capacity < 1
        ):
            remove_space(self._dir_fd, name)
            return None
        files, raw = open_space(self._dir_fd, name, direct=self.direct)
        entries = sorted(index_entries(raw, space_id(*key)), key=lambda e: e[1].seq)
        index = CacheIndex.restored(meta.capacity, [(h.key, slot) for slot, h in entries])
        last = entries[-1][1].seq if entries else 0
        space = DiskSpace(self, key, shape, index, files, next_seq=last + 1)
        with contextlib.suppress(OSError):  # the least recently written goes first for room
            age = time.time() - os.stat(name + ".index", dir_fd=self._dir_fd).st_mtime
            space.last_used = time.monotonic() - max(age, 0.0)
        return space

    async def drain(self, timeout_s: float) -> bool:
        """Wait for the reads and writes in flight (at most ``timeout_s``).

        Also for those that what ends meanwhile starts (writes queued behind a space's files
        being made): a store answered before SIGTERM is on disk after it.
        """
        deadline = time.monotonic() + timeout_s
        while self._in_flight and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(self._in_flight), timeout=left)
            await asyncio.sleep(0)  # the done callbacks, which may submit more
        return not self._in_flight

    def close(self) -> None:
        """Close every file and the directory; stop the I/O threads (after `drain`)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for space in self._spaces.values():
            if space.files is not None and space.busy == 0:
                space.files.close()
        self._spaces.clear()
        for fd in (self._lock_fd, self._dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._dir_fd = -1
        self._up = False

    def _down(self, reason: str) -> None:
        """Turn the tier off: every lookup below the pool is a miss from now on."""
        if self._up or self.reason != reason:
            log.error(
                "disk tier %s off: %s; the prefix cache serves from memory only", self.path, reason
            )
        self._up = False
        self.reason = reason

    # ------------------------------------------------------------------ spaces

    def space(
        self, key: NamespaceKey, shape: SpaceShape | None = None, *, tp_size: int = 1
    ) -> DiskSpace | None:
        """Namespace ``key``'s space; made (or made again, for another shape) when ``shape``."""
        if not self._up:
            return None
        space = self._spaces.get(key)
        if space is not None and shape is not None and space.shape != shape:
            self._drop(space, "its namespace's layers changed")
            space = None
        if space is None and shape is not None:
            space = self._create(key, shape, tp_size)
        if space is not None:
            space.last_used = time.monotonic()
        return space

    def spaces(self) -> Iterable[DiskSpace]:
        """Every space (made, being made, or found at start)."""
        return self._spaces.values()

    def used_bytes(self) -> int:
        """Bytes the spaces' files take."""
        return sum(s.capacity_bytes for s in self._spaces.values())

    def _create(self, key: NamespaceKey, shape: SpaceShape, tp_size: int) -> DiskSpace | None:
        per = slot_bytes(shape.block_bytes) + HEADER_BYTES
        want = min(self.budget // max(tp_size, 1), self.user_budget)
        if self._spaces:  # an equal share at most: the others keep the rest
            want = min(want, self.budget // (len(self._spaces) + 1))
        owner = key[0]
        self._room_of(owner, want)
        # Past its own share an owner gets nothing, however much others have left: so it never
        # makes another owner's spaces smaller (with every owner within its share, the budget
        # holds what each may ask).
        want = min(want, self.user_budget - self._owned_bytes(owner))
        if want < per:
            self._warn(
                f"share:{owner}",
                f"{owner}'s spaces hold its share of cache_disk_bytes ({self.user_budget} bytes):"
                " no disk for its namespace",
            )
            return None
        self._room(want)
        return self._make(key, shape, min(want, self.budget - self.used_bytes()))

    def _owned_bytes(self, owner: str) -> int:
        return sum(s.capacity_bytes for s in self._spaces.values() if s.key[0] == owner)

    def _room_of(self, owner: str, want: int) -> None:
        """Cut ``owner``'s own idle spaces (least recently used first) to leave ``want`` bytes.

        Its share (`user_budget`) is what they are cut against, before anyone else's are touched.
        """
        spaces = sorted(self._spaces.values(), key=lambda s: s.last_used)
        for space in [s for s in spaces if s.key[0] == owner and self._idle(s)]:
            over = self._owned_bytes(owner) + want - self.user_budget
            if over <= 0:
                return
            self._shrink(space, space.capacity_bytes - over, "its owner's share was needed")

    def _make(self, key: NamespaceKey, shape: SpaceShape, nbytes: int) -> DiskSpace | None:
        """Make a space of ``nbytes`` (its files on an I/O thread; writes wait for them)."""
        capacity = nbytes // (slot_bytes(shape.block_bytes) + HEADER_BYTES)
        if capacity < 1:
            self._warn("no_room", f"no room for namespace {key[1][:16]} rank {key[2]}")
            return None
        space = DiskSpace(self, key, shape, CacheIndex(capacity), None)
        self._spaces[key] = space
        meta = space.meta(capacity)
        loop = asyncio.get_running_loop()
        made = asyncio.wrap_future(
            self._pool.submit(create_space, self._dir_fd, space.name, meta, direct=self.direct),
            loop=loop,
        )
        space.opening = loop.create_future()
        self._track(made)

        def opened(result: asyncio.Future[tuple[SpaceFiles, int]]) -> None:
            assert space.opening is not None
            if result.cancelled() or result.exception() is not None:
                error = None if result.cancelled() else result.exception()
                if isinstance(error, OSError):
                    self._error(error, "creating a namespace's files")
                if self._spaces.get(key) is space:
                    del self._spaces[key]
                space.closing = True
            else:
                files, allocated = result.result()
                space.files = files
                if allocated < capacity:
                    log.warning(
                        "disk tier: namespace %s rank %d got %d of %d slots (file system full)",
                        key[1][:16],
                        key[2],
                        allocated,
                        capacity,
                    )
                    space.index = CacheIndex(allocated)
                if space.closing:
                    self._remove_files(space)
                log.info(
                    "disk tier: namespace %s/%s rank %d: %d slots of %d bytes (%s)",
                    key[0],
                    key[1][:16],
                    key[2],
                    allocated,
                    space.geo.slot_bytes,
                    "direct" if files.direct else "buffered",
                )
            space.opening.set_result(None)

        made.add_done_callback(opened)
        return space

    def _idle(self, space: DiskSpace) -> bool:
        return self._still(space) and not self.in_use(space.key)

    @staticmethod
    def _still(space: DiskSpace) -> bool:
        """Whether nothing runs on or holds a slot of the space (it may be cut down)."""
        opened = space.opening is None or space.opening.done()
        return opened and not space.busy and not space.index.pinned

    def _room(self, want: int) -> None:
        """Free ``want`` bytes of the budget.

        Idle spaces give theirs first (least recently used first), then spaces in use that
        hold more than an equal share.
        """
        fair = self.budget // (len(self._spaces) + 1)
        spaces = sorted(self._spaces.values(), key=lambda s: s.last_used)
        for space in [s for s in spaces if self._idle(s)]:
            need = want - (self.budget - self.used_bytes())
            if need <= 0:
                return
            self._shrink(space, space.capacity_bytes - need, "room was needed")
        for space in sorted(spaces, key=lambda s: -s.capacity_bytes):
            need = want - (self.budget - self.used_bytes())
            if need <= 0:
                return
            if space.capacity_bytes > fair and self._still(space) and not space.closing:
                keep = max(fair, space.capacity_bytes - need)
                self._shrink(space, keep, "a new namespace needed its share")

    def _fit(self, budget: int) -> None:
        """Cut idle spaces down, least recently used first, until all take ``budget`` bytes."""
        for space in sorted(self._spaces.values(), key=lambda s: s.last_used):
            over = self.used_bytes() - budget
            if over <= 0:
                return
            if self._idle(space):
                self._shrink(space, space.capacity_bytes - over, "cache_disk_bytes is smaller")

    def _shrink(self, space: DiskSpace, nbytes: int, why: str) -> None:
        """Cut a space down to ``nbytes`` (its blocks in the slots given up go), or drop it."""
        capacity = max(nbytes, 0) // (space.geo.slot_bytes + HEADER_BYTES)
        if capacity >= space.capacity_blocks:
            return
        if capacity < 1 or space.files is None:
            self._drop(space, why)
            return
        gone = space.index.shrink(capacity)
        self.removed(space.key, "evicted", gone)
        log.info(
            "disk tier: namespace %s/%s rank %d cut to %d slots (%s, %d blocks dropped)",
            space.key[0],
            space.key[1][:16],
            space.key[2],
            capacity,
            why,
            gone,
        )
        meta = space.meta(capacity)
        space.busy += 1  # no I/O on it until its files are cut
        job = self._pool.submit(shrink_space, self._dir_fd, space.name, space.files, meta)
        cut = asyncio.wrap_future(job)
        self._track(cut)

        def done(fut: asyncio.Future[None]) -> None:
            space.busy -= 1
            if not fut.cancelled() and isinstance(fut.exception(), OSError):
                exc = fut.exception()
                assert isinstance(exc, OSError)
                self._error(exc, "cutting a namespace's files down")
            if space.closing and space.busy == 0:
                self._remove_files(space)

        cut.add_done_callback(done)

    def _drop(self, space: DiskSpace, why: str) -> None:
        """Forget a space now; its files go once nothing is in flight on them."""
        if self._spaces.get(space.key) is space:
            del self._spaces[space.key]
        if space.closing:
            return
        space.closing = True
        log.info(
            "disk tier: namespace %s/%s rank %d dropped (%s, %d blocks)",
            space.key[0],
            space.key[1][:16],
            space.key[2],
            why,
            space.ready_blocks,
        )
        self.removed(space.key, "dropped", space.ready_blocks)
        if space.busy == 0 and (space.opening is None or space.opening.done()):
            self._remove_files(space)

    def _remove_files(self, space: DiskSpace) -> None:
        files, space.files = space.files, None
        dir_fd = self._dir_fd

        def remove() -> None:
            if files is not None:
                files.close()
            remove_space(dir_fd, space.name)

        if dir_fd >= 0:
            self._track(asyncio.wrap_future(self._pool.submit(remove)))

    # ------------------------------------------------------------------ I/O

    def run(
        self,
        space: DiskSpace,
        items: list[Item],
        blocks: HostBlocks,
        *,
        write: bool,
        settle: Callable[[list[Item], Chunk], None],
        done: Callable[[], list[bool]],
        out: asyncio.Future[list[bool]],
    ) -> None:
        """Run ``items`` in chunks on the I/O threads; ``settle`` each, then answer ``out``."""
        assert space.files is not None
        files = space.files
        work = write_chunk if write else read_chunk
        chunks = plan_chunks(items, space.geo.slot_bytes)
        left = [len(chunks)]
        space.busy += len(chunks)
        op = "write" if write else "read"

        def finished(chunk: list[Item], fut: asyncio.Future[Chunk]) -> None:
            space.busy -= 1
            if fut.cancelled() or fut.exception() is not None:
                exc = None if fut.cancelled() else fut.exception()
                result = Chunk(ok=[False] * len(chunk))
                if isinstance(exc, OSError):
                    result.error = exc
                elif exc is not None:
                    log.error("disk tier: %s failed", op, exc_info=exc)
            else:
                result = fut.result()
            self._account(op, result)
            settle(chunk, result)
            if space.closing and space.busy == 0 and space.files is not None:
                self._remove_files(space)
            left[0] -= 1
            if left[0] == 0 and not out.done():
                out.set_result(done())

        loop = asyncio.get_running_loop()
        for chunk in chunks:
            fut = asyncio.wrap_future(
                self._pool.submit(work, files, space.geo, chunk, blocks.pieces), loop=loop
            )
            self._track(fut)
            fut.add_done_callback(functools.partial(finished, chunk))

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._in_flight.add(fut)
        fut.add_done_callback(self._in_flight.discard)

    def _account(self, op: str, result: Chunk) -> None:
        good = sum(result.ok)
        if self.metrics is not None and good:
            self.metrics.io(MEDIUM, op, good, result.nbytes, result.seconds)
        if result.corrupt:
            self._count("corrupt", result.corrupt)
            self._warn("corrupt", f"{result.corrupt} blocks read did not match their checksum")
        if result.short:
            self._count("truncated", result.short)
            self._warn("truncated", f"{result.short} blocks were cut off (a truncated file)")
        if result.error is not None:
            self._error(result.error, op)
        elif good:
            self._failures = 0

    def _error(self, exc: OSError, what: str) -> None:
        kind = _kind(exc)
        self._count(kind, 1)
        self._failures += 1
        self._warn(kind, f"{what}: {exc}")
        if exc.errno in FATAL:
            self._down(f"{what}: {exc.strerror}")
        elif self._failures >= MAX_FAILURES:
            self._down(f"{self._failures} failed I/O calls in a row, the last: {exc}")

    def _count(self, kind: ErrorKind, n: int) -> None:
        if self.metrics is not None:
            self.metrics.error(MEDIUM, kind, n)

    def _warn(self, kind: str, message: str) -> None:
        """Log the first fault of each kind as a warning, the others at debug level."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, "disk tier %s: %s", self.path, message)

    def removed(self, key: NamespaceKey, why: str, blocks: int) -> None:
        """Report blocks that left the tier (metrics, ``on_removed``)."""
        if not blocks:
            return
        if self.metrics is not None and why == "evicted":
            self.metrics.evicted(MEDIUM, blocks)
        if self.on_removed is not None:
            self.on_removed(key, why, blocks)

    def state(self) -> TierState:
        """Return what the gauges show."""
        free = -1
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                vfs = os.statvfs(self._dir_fd)
                free = vfs.f_bavail * vfs.f_frsize
        spaces = self._spaces.values()
        return TierState(
            medium=MEDIUM,
            up=self._up,
            capacity_bytes=self.used_bytes(),
            used_bytes=sum(s.ready_blocks * s.geo.block_bytes for s in spaces),
            blocks=sum(s.ready_blocks for s in spaces),
            spaces=len(self._spaces),
            free_bytes=free,
            reason=self.reason,
            path=self.path,
        )
