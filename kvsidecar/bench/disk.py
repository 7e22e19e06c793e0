"""``bench disk``: the prefix cache's disk tier against ``fio`` on the same file system.

The tier (`kvsidecar.daemon.cache.disk.DiskTier`, as the daemon runs it: its I/O threads, its
checksums, its records) writes and reads runs of 1, 16 and 256 MiB of blocks (``--quick``: 1 and
16) (a block: one
block of every layer, ``--layers`` x ``--block-shape`` x ``--dtype``, gathered from and scattered
into per-layer host arrays, as from the daemon's namespaces), beside ``fio`` doing the same
sequential bytes in the same directory, in the same round: as many jobs as the tier has threads
(``cache_disk_threads``), each I/O as large as the tier's (its chunk of slots, or the run).

- **O_DIRECT** (the tier's default): the tier against ``fio --direct=1``; the goal is 0.8 of
  fio's rate from 16 MiB up.
- **page cache** (buffered I/O, ``cache_disk_direct = false``), apart: writes (into the page
  cache, no sync) against ``fio --direct=0``; reads after the file's pages were dropped
  (``posix_fadvise(DONTNEED)``) against ``fio --direct=0 --invalidate=1``, and reads from the
  page cache against ``fio --invalidate=0`` right after its own write: the only figures the
  page cache may flatter, and labelled so.

With ``--rebuild N``, also how long a daemon takes at start to find a tier of N blocks (10 GiB
over 100k blocks for ``--rebuild 100000``): the blocks are written once, then the tier is opened
``--repeat`` times with its index files dropped from the page cache, against reading those files
alone. ``fio`` comes from Debian (``scripts/install-system-tools``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.bench.common import BenchUnavailable, Figure, Options, Progress, note
from kvsidecar.daemon.cache.disk import DiskSpace, DiskTier
from kvsidecar.daemon.cache.disk_files import chunk_slots, drop_cached
from kvsidecar.daemon.cache.tier import HostBlocks, SpaceShape
from kvsidecar.node.config import Config
from kvsidecar.wire.types import BufferDescriptor

RUNS_MIB = (1, 16, 256)
THREADS = int(os.environ.get("KVSIDECAR_CACHE_DISK_THREADS", "2"))
"""The tier's I/O threads (``cache_disk_threads``, its default unless the variable says)."""
GROUP = "disk tier"
REBUILD_BYTES = 10 << 30
"""What ``--rebuild`` writes in all (its blocks share it)."""


def run(opts: Options) -> list[Figure]:
    """Measure the tier against fio in ``opts.dir`` (a temporary directory when empty)."""
    fio = shutil.which("fio")
    if fio is None:
        raise BenchUnavailable("fio is not installed (scripts/install-system-tools installs it)")
    block = opts.layers * opts.block_bytes
    runs = [mib for mib in RUNS_MIB[: 2 if opts.quick else 3] if (mib << 20) >= block]
    note(
        f"disk: runs of {', '.join(f'{m} MiB' for m in runs)}, blocks of {block >> 10} KiB "
        f"({opts.layers} layers), {THREADS} threads, {opts.repeat} rounds, in "
        f"{opts.dir or 'a temporary directory'}"
    )
    figures: list[Figure] = []
    with _directory(opts.dir) as where:
        progress = Progress(opts.repeat * len(runs) * 2, "disk", enabled=opts.progress)
        for direct in (True, False):
            figures += asyncio.run(
                _measure(where, opts, runs, direct=direct, fio=fio, progress=progress)
            )
        progress.close()
        if opts.rebuild:
            figures.append(asyncio.run(_rebuild(where, opts, opts.rebuild)))
    return figures


@contextlib.contextmanager
def _directory(given: str) -> Iterator[Path]:
    if given:
        path = Path(given) / f"kvsidecar-bench-disk-{os.getpid()}"
        path.mkdir(parents=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="kvsidecar-bench-disk-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _shape(opts: Options) -> SpaceShape:
    row = opts.block_bytes
    desc = BufferDescriptor("blocks_first", "NHD", "uint8", 1, 1, 1, row)
    return SpaceShape(tuple((f"layer{i}", desc) for i in range(opts.layers)), row * opts.layers)


def _config(where: Path, nbytes: int, direct: bool) -> Config:
    """Return a tier's config: one per mode (one must not find the other's blocks)."""
    return Config(
        runtime_dir="/tmp/kvsidecar-bench-disk",  # never made: the tier has no sockets
        cache_dir=str(where / ("direct" if direct else "buffered")),
        cache_disk_bytes=nbytes,
        cache_disk_direct=direct,
        cache_disk_threads=THREADS,
    )


async def _measure(
    where: Path, opts: Options, runs: list[int], *, direct: bool, fio: str, progress: Progress
) -> list[Figure]:
    """Run rounds of (tier write, fio write, tier read, fio read) per run size."""
    block = opts.layers * opts.block_bytes
    most = max(runs) * (1 << 20) // block
    tier = DiskTier(_config(where, 3 * most * (block + 8192) + (64 << 20), direct))
    await tier.start()
    if not tier.up:
        raise BenchUnavailable(f"the disk tier did not start in {where}: {tier.reason}")
    try:
        space = tier.space(("bench", "disk", 0), _shape(opts))
        assert space is not None
        rng = np.random.default_rng(0)
        host = [
            rng.integers(0, 255, (most, opts.block_bytes), np.uint8) for _ in range(opts.layers)
        ]
        await _round(space, host, 0, 1, write=True)  # its files made, the threads started
        mode = "O_DIRECT" if direct else "page cache"
        slot = space.geo.slot_bytes
        io = chunk_slots(slot) * slot  # the bytes of one of the tier's I/O calls
        figures: list[Figure] = []
        first = 1
        for mib in runs:
            n = (mib << 20) // block
            nbytes = n * block
            samples: dict[str, list[float]] = {}

            def add(
                name: str,
                seconds: float,
                nbytes: int = nbytes,
                samples: dict[str, list[float]] = samples,
            ) -> None:
                samples.setdefault(name, []).append(nbytes / seconds / 1e9)

            for _ in range(opts.repeat):
                add("write", await _round(space, host, first, n, write=True))
                add("fio write", _fio(fio, where, "write", nbytes, io, direct=direct))
                if direct:
                    add("read", await _round(space, host, first, n, write=False))
                    add("fio read", _fio(fio, where, "read", nbytes, io, direct=True))
                else:
                    assert space.files is not None
                    drop_cached(space.files)
                    add("read, pages dropped", await _round(space, host, first, n, write=False))
                    add("fio read, invalidated", _fio(fio, where, "read", nbytes, io, direct=False))
                    add(
                        "read, from the page cache",
                        await _round(space, host, first, n, write=False),
                    )
                    cached = _fio(fio, where, "read", nbytes, io, direct=False, invalidate=False)
                    add("fio read, from the page cache", cached)
                first += n  # fresh keys each round: every write writes
                progress.step()
            figures += _figures(samples, mib, mode, direct)
        return figures
    finally:
        await tier.drain(30)
        tier.close()


def _fio(
    fio: str,
    where: Path,
    rw: str,
    nbytes: int,
    io: int,
    *,
    direct: bool,
    invalidate: bool = True,
) -> float:
    """Return the seconds ``fio`` takes to ``rw`` ``nbytes`` sequentially in ``where``.

    As the tier does: `THREADS` jobs, I/O of ``io`` bytes (the tier's chunk of slots; or the
    run's share).
    """
    per = max(4096, nbytes // THREADS)
    size = max(4096, per - per % 4096)
    bs = min(io, size)  # slots are whole pages: so is io
    size -= size % bs
    cmd = [
        fio,
        "--name=kvsidecar",
        f"--directory={where}",
        "--filename_format=fio.$jobnum",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--size={size}",
        f"--numjobs={THREADS}",
        "--ioengine=psync",
        f"--direct={int(direct)}",
        f"--invalidate={int(invalidate)}",
        "--group_reporting",
        "--output-format=json",
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    rate = float(json.loads(done.stdout)["jobs"][0][rw]["bw_bytes"])
    if not rate:
        raise RuntimeError(f"fio {rw}: no rate in {done.stdout[:400]}")
    return nbytes / rate  # the time fio's rate takes for the tier's bytes


async def _round(
    space: DiskSpace, host: list[np.ndarray[Any, Any]], first: int, n: int, *, write: bool
) -> float:
    """Write (or read) blocks ``first .. first + n`` of the space; seconds it took."""
    keys = [_key(first + i) for i in range(n)]
    blocks = HostBlocks(host, list(range(n)))
    started = time.perf_counter()
    done = await (space.put(keys, blocks) if write else space.get(keys, blocks))
    seconds = time.perf_counter() - started
    if not all(done):
        what = "write" if write else "read"
        raise RuntimeError(f"{what} of {n} blocks: {done.count(False)} failed")
    return seconds


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def _figures(samples: dict[str, list[float]], mib: int, mode: str, direct: bool) -> list[Figure]:
    pairs = [("write", "fio write"), ("read", "fio read")]
    if not direct:
        pairs = [
            ("write", "fio write"),
            ("read, pages dropped", "fio read, invalidated"),
            ("read, from the page cache", "fio read, from the page cache"),
        ]
    return [
        Figure(
            f"{mode}: tier {ours}, {mib} MiB run",
            "GB/s",
            samples[ours],
            f"{theirs} ({'direct=1' if direct else 'direct=0'})",
            samples[theirs],
            group=GROUP,
        )
        for ours, theirs in pairs
    ]


async def _rebuild(where: Path, opts: Options, count: int) -> Figure:
    """Seconds a tier of ``count`` blocks (`REBUILD_BYTES` in all) takes to be found at start."""
    row = max(4096, (REBUILD_BYTES // count) // 4096 * 4096 - 4096)
    desc = BufferDescriptor("blocks_first", "NHD", "uint8", 1, 1, 1, row)
    shape = SpaceShape((("layer0", desc),), row)
    config = _config(where / "rebuild", count * (row + 8192) + (64 << 20), True)
    shutil.rmtree(config.cache_dir, ignore_errors=True)
    batch = max(1, (256 << 20) // row)
    note(f"disk: writing {count} blocks of {row >> 10} KiB for the rebuild figure")
    tier = DiskTier(config)
    await tier.start()
    space = tier.space(("bench", "rebuild", 0), shape)
    assert space is not None
    host = [np.random.default_rng(1).integers(0, 255, (batch, row), np.uint8)]
    for first in range(0, count, batch):
        n = min(batch, count - first)
        await _round(space, host, first, n, write=True)
    await tier.drain(60)
    tier.close()
    index = Path(config.cache_dir) / f"{space.name}.index"
    samples, baseline = [], []
    for _ in range(opts.repeat):
        _drop(index)
        again = DiskTier(config)
        await again.start()
        blocks = sum(s.ready_blocks for s in again.spaces())
        samples.append(again.rebuild_s)
        again.close()
        if blocks != count:
            raise RuntimeError(f"rebuild found {blocks} of {count} blocks")
        _drop(index)
        started = time.perf_counter()
        index.read_bytes()
        baseline.append(time.perf_counter() - started)
    gib = count * row / (1 << 30)
    return Figure(
        f"index rebuild at start, {count} blocks ({gib:.1f} GiB), index not cached",
        "s",
        samples,
        "reading the index file alone",
        baseline,
        higher_is_better=False,
        group=GROUP,
    )


def _drop(path: Path) -> None:
    """Drop a file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
