"""The prefix cache's disk tier: real daemon processes, real files, real file systems.

Blocks are checked byte for byte against what the storing engine held. A daemon is restarted
(SIGTERM, SIGKILL during stores) on the same ``cache_dir``; the files are damaged where they lie
(a flipped byte, a truncated slab), the file system is a size-limited tmpfs that fills up or is
remounted read-only: each damaged block is a miss, never another block, and the daemon serves
on. The format and the index's restore are checked against models written here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.daemon.cache.disk_format import (
    HEADER_BYTES,
    index_entries,
    pack_header,
    space_id,
    unpack_header,
)
from kvsidecar.daemon.cache.index import CacheIndex
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.node.config import Config, ConfigError
from kvsidecar.wire.protocol import StatusReply
from tests.support import ROOT
from tests.support.daemons import DaemonProcess, daemon_process, make_config, open_to_every_uid
from tests.support.disk import (
    can_mount,
    flip_byte,
    record_offset,
    remount_read_only,
    slot_bytes_of,
    slot_of,
    space_files,
    tmpfs,
)
from tests.support.prometheus import scrape

pytestmark = pytest.mark.timeout(180)

BLOCKS, N, H, C = 32, 4, 2, 8
BLOCK_BYTES = 2 * (2 * N * H * C * 4)  # two kv_first float32 layers: 1 KiB
FP = "model-disk"
OWNER = f"uid:{os.geteuid()}"
needs_mount = pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


class Engine:
    """An engine worker in this process: KV caches of random bits, registered with a daemon."""

    def __init__(self, endpoint: str, name: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.caches = allocate_kv_caches(2, (2, BLOCKS, N, H, C), torch.float32)
        for t in self.caches:
            t.copy_(torch.randn(t.shape, generator=gen))
        self.client = SidecarClient(endpoint, name=name)
        self.client.register_kv_caches(
            {f"layer{i}": t for i, t in enumerate(self.caches)}, engine_id=name
        )

    def block(self, b: int) -> list[torch.Tensor]:
        return [t[:, b].clone() for t in self.caches]

    def store(self, keys: list[bytes], ids: list[int], fp: str = FP) -> Any:
        return self.client.submit_cache_store(fp, keys, ids).result()

    def load(self, keys: list[bytes], ids: list[int], fp: str = FP, pin_id: int = 0) -> Any:
        return self.client.submit_cache_load(fp, keys, ids, pin_id=pin_id).result()

    def close(self) -> None:
        self.client.close()


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def disk_config(cache_dir: str | Path, **overrides: Any) -> Config:
    values: dict[str, Any] = {
        "host_pool_bytes": 16 << 20,
        "cache_bytes": 1 << 20,
        "cache_dir": str(cache_dir),
        "cache_disk_bytes": 4 << 20,
        "cache_disk_admit": "all",
        "drain_timeout_s": 5.0,
    }
    values.update(overrides)
    return make_config(**values)


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-disk-", dir="/tmp")) / "cache"
    try:
        yield path
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


@contextlib.contextmanager
def engine_on(daemon: DaemonProcess, name: str = "eng", seed: int = 1) -> Iterator[Engine]:
    eng = Engine(daemon.config.endpoint, name, seed)
    try:
        yield eng
    finally:
        eng.close()


def status(daemon: DaemonProcess) -> StatusReply:
    with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
        return c.status()


def metrics(daemon: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return scrape(status(daemon).metrics_port)


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    return metrics(daemon).get((name, tuple(sorted(labels.items()))), 0.0)


def disk_blocks(daemon: DaemonProcess, fp: str = FP) -> int:
    return sum(n.disk_blocks for n in status(daemon).cache_namespaces if n.fingerprint == fp)


def eventually(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def kill(daemon: DaemonProcess) -> None:
    daemon.proc.kill()
    daemon.proc.wait(10)
    daemon.stop()


# ------------------------------------------------------------------ persistence


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_restarted_daemon_serves_the_blocks_its_predecessor_wrote(
    cache_dir: Path, sig: signal.Signals
) -> None:
    keys = [key(i) for i in range(8)]
    with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
        assert a.store(keys, list(range(8))).stored == 8
        assert eventually(lambda: disk_blocks(first), lambda n: n == 8) == 8
        want = [a.block(i) for i in range(8)]
        if sig == signal.SIGKILL:
            kill(first)
    # Files of the daemon's own: 0600 in a 0700 directory.
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    files = space_files(cache_dir, OWNER, FP)
    for path in files.values():
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    with daemon_process(disk_config(cache_dir)) as second, engine_on(second, "fresh", 9) as b:
        (tier,) = status(second).cache_tiers
        assert tier.up and tier.blocks == 8 and tier.medium == "STORAGE"
        found = b.client.cache_lookup(FP, [*keys, key(99)], pin_s=10, disk_wait_s=5)
        assert (found.hits, found.disk_hits) == (8, 8) and found.pin_id
        loaded = b.load(keys, list(range(16, 24)), pin_id=found.pin_id)
        assert loaded.loaded == 8 and not loaded.missing_block_ids
        assert all(same(b.block(16 + i), want[i]) for i in range(8))
        assert metric(second, "kvsidecar_cache_tier_hit_blocks_total", medium="STORAGE") == 8
        assert (
            metric(second, "kvsidecar_cache_tier_io_blocks_total", medium="STORAGE", op="read") == 8
        )
        # In memory now: the next lookup hits there.
        again = b.client.cache_lookup(FP, keys)
        assert (again.hits, again.disk_hits) == (8, 0)


def test_sigterm_right_after_stores_writes_them_before_the_daemon_exits(cache_dir: Path) -> None:
    """The stores were answered (in memory); the writes through are still running, or not
    started (the namespace's files being made): the drain waits for them."""
    keys = [key(i) for i in range(BLOCKS)]
    with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
        assert a.store(keys, list(range(BLOCKS))).stored == BLOCKS
        want = [a.block(i) for i in range(BLOCKS)]
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(30) == 0
    with daemon_process(disk_config(cache_dir)) as second, engine_on(second, "b", 2) as b:
        assert b.client.cache_lookup(FP, keys).hits == BLOCKS
        assert b.load(keys, list(range(BLOCKS))).loaded == BLOCKS
        assert all(same(b.block(i), want[i]) for i in range(BLOCKS))


def test_a_daemon_killed_during_stores_leaves_no_wrong_block(cache_dir: Path) -> None:
    """SIGKILL while stores are being written through: the next daemon serves the blocks whose
    writes ended, each the block stored under its key, and misses the rest."""
    first = DaemonProcess(disk_config(cache_dir, cache_disk_bytes=8 << 20))
    stored: dict[bytes, int] = {}
    try:
        first.wait_ready()
        a = Engine(first.config.endpoint, "a", 3)
        want = {b: a.block(b) for b in range(BLOCKS)}
        early = [key(i) for i in range(8)]
        a.store(early, list(range(8)))
        stored.update((k, i) for i, k in enumerate(early))
        eventually(lambda: disk_blocks(first), lambda n: n == 8)
        stop = threading.Event()

        def keep_storing() -> None:
            n = 1000
            while not stop.is_set():
                keys = [key(n + j) for j in range(16)]
                ids = [(n + j) % BLOCKS for j in range(16)]
                try:
                    a.store(keys, ids)
                except SidecarError:
                    return
                stored.update(zip(keys, ids, strict=True))
                n += 16

        writer = threading.Thread(target=keep_storing, daemon=True)
        writer.start()
        eventually(lambda: disk_blocks(first), lambda n: n >= 64)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        stop.set()
        writer.join(30)
        a.client.close()
    finally:
        first.stop()
        shutil.rmtree(first.config.runtime_dir, ignore_errors=True)
    config = disk_config(cache_dir, cache_disk_bytes=8 << 20)
    with daemon_process(config) as second, engine_on(second, "b", 4) as b:
        keys = list(stored)
        served = 0
        for i in range(0, len(keys), 16):
            part = keys[i : i + 16]
            ids = list(range(len(part)))
            loaded = b.load(part, ids)
            missing = set(loaded.missing_block_ids)
            for k, dst in zip(part, ids, strict=True):
                if dst not in missing:
                    assert same(b.block(dst), want[stored[k]]), k.hex()
                    served += 1
        assert served >= 64  # every block written before the kill, at least
        assert b.client.cache_lookup(FP, [key(i) for i in range(8)]).hits == 8


# ------------------------------------------------------------------ the write policy


def test_reuse_writes_a_block_at_its_second_use_and_spares_the_device_the_others(
    cache_dir: Path,
) -> None:
    """Under ``reuse`` a stored block reaches the disk once loaded or stored again; blocks
    evicted from memory before that never do."""
    config = disk_config(cache_dir, cache_disk_admit="reuse", cache_bytes=24 * BLOCK_BYTES + 8192)
    with daemon_process(config) as d, engine_on(d) as a:
        writes = "kvsidecar_cache_tier_io_blocks_total"
        a.store([key(i) for i in range(8)], list(range(8)))
        time.sleep(0.5)
        assert disk_blocks(d) == 0 and metric(d, writes, medium="STORAGE", op="write") == 0
        assert a.load([key(0), key(1), key(2)], [20, 21, 22]).loaded == 3  # a second use
        assert eventually(lambda: disk_blocks(d), lambda n: n == 3) == 3
        a.store([key(3), key(4)], [3, 4])  # computed again elsewhere: a second use too
        assert eventually(lambda: disk_blocks(d), lambda n: n == 5) == 5
        # Evict everything from memory: the blocks used once are gone, the others on disk.
        for r in range(8):  # 16 blocks a round into 24 slots (a write in flight pins its own)
            a.store([key(100 + 16 * r + j) for j in range(16)], list(range(16)))
            if all(a.client.cache_lookup(FP, [key(i)]).disk_hits for i in range(5)):
                break
        assert a.client.cache_lookup(FP, [key(5)]).hits == 0
        found = a.client.cache_lookup(FP, [key(i) for i in range(5)], pin_s=5, disk_wait_s=5)
        assert (found.hits, found.disk_hits) == (5, 5)
        assert metric(d, writes, medium="STORAGE", op="write") == 5
        loaded = a.load([key(i) for i in range(5)], [24, 25, 26, 27, 28], pin_id=found.pin_id)
        assert loaded.loaded == 5
        assert all(same(a.block(24 + i), a.block(i)) for i in range(5))


# ------------------------------------------------------------------ damaged files


def test_a_flipped_byte_is_a_miss_and_the_block_leaves_the_tier(cache_dir: Path) -> None:
    keys = [key(i) for i in range(4)]
    with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
        a.store(keys, [0, 1, 2, 3])
        eventually(lambda: disk_blocks(first), lambda n: n == 4)
        want = [a.block(i) for i in range(4)]
    files = space_files(cache_dir, OWNER, FP)
    slab, size = files["slab"].read_bytes(), slot_bytes_of(files)
    for k in keys:  # each record carries XXH3-64 of the bytes after its header, as on the disk
        at = slot_of(files, OWNER, FP, k) * size
        header = unpack_header(slab[at : at + HEADER_BYTES])
        assert header is not None and header.key == k
        body = slab[at + HEADER_BYTES : at + HEADER_BYTES + header.length]
        assert header.digest == xxhash.xxh3_64_intdigest(body)
    flip_byte(files["slab"], record_offset(files, slot_of(files, OWNER, FP, key(2)), payload=77))
    with daemon_process(disk_config(cache_dir)) as second, engine_on(second, "b", 2) as b:
        assert status(second).cache_tiers[0].blocks == 4  # the index does not know yet
        found = b.client.cache_lookup(FP, keys, pin_s=10, disk_wait_s=5)
        assert (found.hits, found.disk_hits) == (2, 2)  # read, checked: the third is damaged
        loaded = b.load(keys, [10, 11, 12, 13], pin_id=found.pin_id)
        assert loaded.loaded == 3 and loaded.missing_block_ids == [12]
        for dst, src in ((10, 0), (11, 1), (13, 3)):
            assert same(b.block(dst), want[src])
        assert (
            metric(second, "kvsidecar_cache_tier_errors_total", medium="STORAGE", kind="corrupt")
            == 1
        )
        assert status(second).cache_tiers[0].blocks == 3 and status(second).cache_tiers[0].up
        # Computed and stored again, it is whole again.
        b.store([key(2)], [12])
        assert b.client.cache_lookup(FP, keys).hits == 4


def test_a_header_naming_another_key_is_a_miss(cache_dir: Path) -> None:
    """A slot whose record is another block's (its index entry names the old key: a daemon
    killed between the two writes) is never served under the index's key."""
    with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
        a.store([key(1), key(2)], [1, 2])
        eventually(lambda: disk_blocks(first), lambda n: n == 2)
    files = space_files(cache_dir, OWNER, FP)
    one, two = slot_of(files, OWNER, FP, key(1)), slot_of(files, OWNER, FP, key(2))
    size = slot_bytes_of(files)
    with open(files["slab"], "r+b") as fh:  # slot 1 now holds key 2's record, whole
        fh.seek(two * size)
        record = fh.read(size)
        fh.seek(one * size)
        fh.write(record)
    with daemon_process(disk_config(cache_dir)) as second, engine_on(second, "b", 2) as b:
        loaded = b.load([key(1), key(2)], [5, 6])
        assert loaded.loaded == 1 and loaded.missing_block_ids == [5]


def test_a_file_truncated_under_the_daemon_is_a_miss_and_the_daemon_serves_on(
    cache_dir: Path,
) -> None:
    keys = [key(i) for i in range(8)]
    with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
        a.store(keys, list(range(8)))
        eventually(lambda: disk_blocks(first), lambda n: n == 8)
        want = [a.block(i) for i in range(8)]
    files = space_files(cache_dir, OWNER, FP)
    slots = {k: slot_of(files, OWNER, FP, k) for k in keys}
    with daemon_process(disk_config(cache_dir)) as second, engine_on(second, "b", 2) as b:
        os.truncate(files["slab"], 3 * slot_bytes_of(files))  # under the running daemon
        loaded = b.load(keys, list(range(8, 16)))
        kept = [i for i, k in enumerate(keys) if slots[k] < 3]
        assert loaded.loaded == len(kept) == 3
        assert sorted(loaded.missing_block_ids) == [8 + i for i in range(8) if i not in kept]
        for i in kept:
            assert same(b.block(8 + i), want[i])
        cut = metric(
            second, "kvsidecar_cache_tier_errors_total", medium="STORAGE", kind="truncated"
        )
        assert cut == 5
        # It serves on: new blocks are written (the file grows again) and come back whole.
        b.store([key(50), key(51)], [20, 21])
        eventually(lambda: disk_blocks(second), lambda n: n == 5)
        assert status(second).cache_tiers[0].up
    with daemon_process(disk_config(cache_dir)) as third, engine_on(third, "c", 3) as c:
        assert c.load([key(50), key(51)], [0, 1]).loaded == 2
        assert same(c.block(0), want_block(seed=2, block=20))


def want_block(seed: int, block: int) -> list[torch.Tensor]:
    """Block ``block`` of an `Engine` made with ``seed`` (its caches are a function of it)."""
    gen = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(2, (2, BLOCKS, N, H, C), torch.float32)
    for t in caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    return [t[:, block].clone() for t in caches]


# ------------------------------------------------------------------ file systems


@needs_mount
def test_a_read_only_file_system_turns_the_tier_off_and_memory_serves() -> None:
    with tmpfs("4m") as mount:
        cache_dir = mount / "cache"
        with daemon_process(disk_config(cache_dir)) as first, engine_on(first) as a:
            a.store([key(1)], [1])
            eventually(lambda: disk_blocks(first), lambda n: n == 1)
        remount_read_only(mount)
        with daemon_process(disk_config(cache_dir)) as d, engine_on(d, "b", 2) as b:
            (tier,) = status(d).cache_tiers
            assert not tier.up and "Read-only file system" in tier.reason, tier
            assert metric(d, "kvsidecar_cache_tier_up", medium="STORAGE") == 0
            port = status(d).metrics_port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                assert resp.status == 200
            assert b.client.cache_lookup(FP, [key(1)]).hits == 0
            b.store([key(2)], [2])  # the memory tier serves
            assert b.load([key(2)], [9]).loaded == 1 and same(b.block(9), b.block(2))
            assert "disk tier" in d.log() and "off" in d.log()


def test_a_cache_dir_that_is_a_link_or_anothers_is_refused(cache_dir: Path) -> None:
    target = cache_dir.parent / "elsewhere"
    target.mkdir()
    cache_dir.symlink_to(target)
    with daemon_process(disk_config(cache_dir)) as d, engine_on(d) as a:
        (tier,) = status(d).cache_tiers
        assert not tier.up and "symbolic link" in tier.reason
        a.store([key(1)], [1])
        assert a.load([key(1)], [2]).loaded == 1
    assert list(target.iterdir()) == []  # nothing was made through the link


@needs_mount
def test_a_full_file_system_gives_namespaces_the_room_it_has_and_memory_serves() -> None:
    """A 1 MiB tmpfs under a 16 MiB ``cache_disk_bytes``: the first namespace gets the slots the
    file system holds; once a file fills it, the next namespace gets none; blocks over the disk's
    room are evicted from it; every block served is the one stored, and memory serves all."""
    with tmpfs("1m") as mount:
        config = disk_config(mount / "cache", cache_disk_bytes=16 << 20, cache_bytes=2 << 20)
        with daemon_process(config) as d, engine_on(d) as a:
            a.store([key(i) for i in range(16)], list(range(16)))
            space = eventually(
                lambda: next(n for n in status(d).cache_namespaces if n.fingerprint == FP),
                lambda n: n.disk_blocks == 16,
            )
            assert 16 <= space.disk_capacity_blocks < 256  # what 1 MiB holds, not 16 MiB
            assert "file system full" in d.log()
            cap = space.disk_capacity_blocks
            for r in range(4):  # more blocks than the disk holds: evicted there, LRU first
                keys = [key(1000 + 16 * r + j) for j in range(16)]
                a.store(keys, list(range(16)))
            eventually(lambda: disk_blocks(d), lambda n: n == min(cap, 80))
            assert metric(d, "kvsidecar_cache_tier_evictions_total", medium="STORAGE") == max(
                0, 80 - cap
            )
            (mount / "filler").write_bytes(b"")
            with open(mount / "filler", "wb", buffering=0) as fh:
                for size in (65536, 4096, 512, 1):  # to the last byte the file system has
                    with contextlib.suppress(OSError):
                        while True:
                            fh.write(b"\0" * size)
            # Another model's namespace: no room on disk; memory serves it.
            a.store([key(7)], [7], fp="another-model")
            assert a.load([key(7)], [30], fp="another-model").loaded == 1
            assert same(a.block(30), a.block(7))
            assert status(d).cache_tiers[0].up
            assert not any(
                n.disk_capacity_blocks
                for n in status(d).cache_namespaces
                if n.fingerprint == "another-model"
            )
        free = os.statvfs(mount)
        assert free.f_bavail * free.f_frsize < 64 << 10


# ------------------------------------------------------------------ eviction across tiers


def test_eviction_across_tiers_under_a_workload_larger_than_both(cache_dir: Path) -> None:
    """A workload of 512 distinct blocks over 32 in memory and 64 on disk, half of them used
    again: hits come from both tiers, every block served is right, and nothing is left behind
    (files, descriptors, pool memory) once the run ends."""
    config = disk_config(
        cache_dir,
        cache_disk_admit="reuse",
        cache_bytes=32 * BLOCK_BYTES + 8192,
        cache_disk_bytes=64 * (4096 + HEADER_BYTES) + 4095,
    )
    with daemon_process(config) as d, engine_on(d) as a:
        a.store([key(0)], [0])  # the namespaces exist from here on
        a.load([key(0)], [1])
        eventually(lambda: disk_blocks(d), lambda n: n == 1)
        fds_before = files_open(d.proc.pid, cache_dir)
        assert len(fds_before) == 4  # the directory, its lock, the space's slab and index
        pool_before = status(d).host_pool_used_bytes
        rng = torch.Generator().manual_seed(5)
        asked = hits = from_disk = 0
        for r in range(32):
            keys = [key(10_000 + 16 * r + j) for j in range(16)]
            a.store(keys, list(range(16)))
            # Use again some blocks of the last rounds (those that were used once are on disk
            # only if they were reused already).
            back = int(torch.randint(0, r + 1, (1,), generator=rng))
            old = [key(10_000 + 16 * back + j) for j in range(8)]
            found = a.client.cache_lookup(FP, old, pin_s=5, disk_wait_s=5)
            asked += len(old)
            hits += found.hits
            from_disk += found.disk_hits
            if found.hits:
                got = a.load(
                    old[: found.hits], list(range(16, 16 + found.hits)), pin_id=found.pin_id
                )
                assert got.loaded == found.hits
                for j in range(found.hits):
                    assert same(a.block(16 + j), a.block(j)), (r, j)
        print(f"hit rate {hits / asked:.2f} ({from_disk} of {hits} hits from disk)")
        assert hits and from_disk and hits < asked
        (tier,) = status(d).cache_tiers
        assert tier.blocks <= 64
        files = sorted(p.name for p in cache_dir.iterdir())
        assert len(files) == 4 and "lock" in files  # one space: slab, index, meta
        assert files_open(d.proc.pid, cache_dir) == fds_before
        assert status(d).host_pool_used_bytes == pool_before


def files_open(pid: int, under: Path) -> list[str]:
    """What the process has open in ``under`` (its descriptors' targets, sorted)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(str(under)):
                targets.append(target)
    return sorted(targets)


# ------------------------------------------------------------------ isolation

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_users_engine_finds_none_of_my_blocks_on_disk(cache_dir: Path) -> None:
    mine = key(1)
    config = disk_config(cache_dir, allowed_uids=f"{os.geteuid()},{NOBODY}")
    with daemon_process(config) as first, engine_on(first) as a:
        a.store([mine], [1])
        eventually(lambda: disk_blocks(first), lambda n: n == 1)
    config = disk_config(cache_dir, allowed_uids=f"{os.geteuid()},{NOBODY}")
    with daemon_process(config) as d:
        open_to_every_uid(config)
        spec = {
            "uid": NOBODY,
            "endpoint": config.endpoint,
            "engine": "theirs",
            "fingerprint": FP,
            "keys": [mine.hex()],
            "store_keys": [key(2).hex()],
            "pull_from": "nobody",
            "request": "r",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "tests.procs.cache_user", json.dumps(spec)],
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr + d.log()
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["hits"] == 0 and out["stored"] == 1
        with engine_on(d) as a:
            assert a.client.cache_lookup(FP, [mine]).hits == 1
            assert a.client.cache_lookup(FP, [key(2)]).hits == 0
        # Their block went to a space of their own (their files), not into mine.
        theirs = space_files(cache_dir, f"uid:{NOBODY}", FP)
        eventually(theirs["meta"].exists, bool)
        assert eventually(lambda: disk_blocks(d), lambda n: n == 2) == 2
        with pytest.raises(KeyError):
            slot_of(space_files(cache_dir, OWNER, FP), OWNER, FP, key(2))


# ------------------------------------------------------------------ hostile lookups


@pytest.mark.parametrize("wait", [-1.0, math.nan, math.inf, 31.0])
def test_a_lookup_asking_an_impossible_wait_is_refused(cache_dir: Path, wait: float) -> None:
    with daemon_process(disk_config(cache_dir)) as d, engine_on(d) as a:
        a.store([key(1)], [1])
        with pytest.raises(SidecarError) as err:
            a.client.cache_lookup(FP, [key(1)], pin_s=1, disk_wait_s=wait)
        assert err.value.code == "invalid_message"
        assert a.client.cache_lookup(FP, [key(1)]).hits == 1


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "values,message",
    [
        ({"cache_dir": "/tmp/x"}, "cache_disk_bytes is 0"),
        ({"cache_disk_bytes": 1 << 20}, "cache_dir is empty"),
        ({"cache_dir": "relative", "cache_disk_bytes": 1}, "absolute"),
        ({"cache_dir": "/tmp/x", "cache_disk_bytes": 1, "cache_disk_admit": "x"}, "reuse or all"),
        ({"cache_dir": "/tmp/x", "cache_disk_bytes": 1, "cache_disk_threads": 0}, "from 1 to 64"),
        ({"cache_dir": "/tmp/x", "cache_disk_bytes": 1, "cache_bytes": 0}, "in memory"),
    ],
)
def test_disk_settings_are_refused_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config(runtime_dir="/tmp/kvs-cfg", **values)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------ the format and the index


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=1, max_size=64),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**63),
    st.integers(0, HEADER_BYTES * 8 - 1),
)
def test_a_header_round_trips_and_any_flipped_bit_spoils_it(
    k: bytes, digest: int, seq: int, bit: int
) -> None:
    space = space_id("uid:1", "fp", 0)
    raw = pack_header(space, k, 1024, digest, seq)
    header = unpack_header(raw)
    assert header is not None and (header.key, header.digest, header.seq) == (k, digest, seq)
    bad = bytearray(raw)
    bad[bit // 8] ^= 1 << (bit % 8)
    spoiled = unpack_header(bytes(bad))
    assert spoiled is None or spoiled != header


def test_index_entries_name_only_whole_headers_of_their_space() -> None:
    mine, other = space_id("uid:1", "fp", 0), space_id("uid:2", "fp", 0)
    rows = [
        pack_header(mine, b"a" * 32, 8, 1, 5),
        b"\0" * HEADER_BYTES,
        pack_header(other, b"b" * 32, 8, 1, 6),
        pack_header(mine, b"c" * 32, 8, 1, 7)[:-1] + b"\0",  # its own CRC spoiled
        pack_header(mine, b"d" * 32, 8, xxhash.xxh3_64_intdigest(b"x"), 2),
        _version_1(pack_header(mine, b"e" * 32, 8, 1, 8)),  # the CRC32 format: not read
    ]
    found = [(slot, h.key[:1]) for slot, h in index_entries(b"".join(rows), mine)]
    assert found == [(0, b"a"), (4, b"d")]


def _version_1(raw: bytes) -> bytes:
    """``raw`` as the first format's writer stamped it: version 1, its own CRC32 made again."""
    body = raw[:4] + (1).to_bytes(2, "little") + raw[6 : HEADER_BYTES - 4]
    return body + zlib.crc32(body).to_bytes(4, "little")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=30))
def test_a_restored_index_holds_the_last_entry_of_each_key_and_slot(
    entries: list[tuple[int, int]],
) -> None:
    pairs = [(key(k), s) for k, s in entries]
    index = CacheIndex.restored(6, pairs)
    model: dict[bytes, int] = {}
    for k, s in pairs:
        model = {mk: ms for mk, ms in model.items() if ms != s and mk != k}
        model[k] = s
    assert {k for k in map(key, range(10)) if index.lookup([k])} == set(model)
    assert index.ready == len(model) == index.used
    # Every other slot is free: as many new keys fit, evicting nothing.
    res = index.reserve([key(100 + i) for i in range(6 - len(model))])
    assert res.evicted == 0 and res.dropped == 0
    assert index.discard([next(iter(model))] if model else []) == (1 if model else 0)
