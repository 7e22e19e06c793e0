"""The disk tier's file work, run on its I/O threads: the directory, a space's files, and chunks.

Nothing here runs on the event loop, and nothing here changes the tier's bookkeeping: each
function does its I/O and returns what happened (`Chunk`), and the loop settles it
(`kvsidecar.daemon.cache.disk`). The format is `kvsidecar.daemon.cache.disk_format`'s.

- **The directory** is opened like the runtime directory: created mode 0700, refused if it is a
  symbolic link or another uid's, and every file in it is opened relative to that descriptor
  with ``O_NOFOLLOW`` and mode 0600, so that a link planted in it is never followed.
- **A chunk** is up to `CHUNK_BYTES` of slots. A write gathers each block from its rows in the
  host pool into an aligned staging buffer (one strided copy per piece for a run of slots that
  follow each other in both places), stamps each record's header with the payload's digest and
  writes the run with one ``pwritev``, then the headers into the index file; a read does the
  reverse and checks every record before its rows are written. ``O_DIRECT`` needs aligned
  buffers, offsets and lengths: the staging buffer is page-aligned (``mmap``) and slots are
  multiples of 4 KiB. The digest (XXH3) and the file calls release the GIL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvsidecar.daemon.cache.disk_format import (
    HEADER_BYTES,
    META_DECODER,
    META_ENCODER,
    SpaceMeta,
    pack_header,
    payload_digest,
    unpack_header,
)

CHUNK_BYTES = 2 << 20
"""Most bytes of slots one I/O call moves (a chunk; a larger write or read is several)."""

FATAL = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.EBADF, errno.EDQUOT})
"""Errors after which the tier cannot go on (a read-only or taken-away file system)."""

SUFFIXES = (".slab", ".index", ".meta")
_FILE_MODE = 0o600


class TierError(Exception):
    """The disk tier cannot be used (the message says why, for the log and ``status``)."""


def open_dir(path: str) -> int:
    """Create ``path`` (mode 0700) or check an existing one; return a descriptor of it.

    Refused (`TierError`): a symbolic link, not a directory, another uid's. A directory open
    to others is made 0700.
    """
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TierError(f"{path}: {exc.strerror} (a symbolic link, or not a directory?)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise TierError(f"{path} belongs to uid {st.st_uid}, not to this daemon's")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_dir(dir_fd: int, path: str) -> int:
    """Hold ``lock`` in the directory for the daemon's life; `TierError` if another holds it."""
    try:
        fd = os.open(
            "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE, dir_fd=dir_fd
        )
    except OSError as exc:
        raise TierError(f"{path}: cannot create its lock file ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TierError(f"{path} is used by another daemon") from None
    return fd


def check_writable(dir_fd: int, path: str) -> None:
    """`TierError` unless a file can be made, written and removed in the directory."""
    name = f".probe-{os.getpid()}"
    try:
        fd = os.open(name, _create_flags(), _FILE_MODE, dir_fd=dir_fd)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        raise TierError(f"{path} is not writable ({exc.strerror})") from None


def _create_flags() -> int:
    return os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _open(dir_fd: int, name: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open a file of the directory, with ``O_DIRECT`` when asked and the file system takes it."""
    if direct:
        try:
            return os.open(name, flags | os.O_DIRECT, _FILE_MODE, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(name, flags, _FILE_MODE, dir_fd=dir_fd), False


@dataclasses.dataclass
class SpaceFiles:
    """The open slab and index of one space, and whether the slab bypasses the page cache."""

    slab: int
    index: int
    direct: bool

    def close(self) -> None:
        """Close both (idempotent)."""
        for name in ("slab", "index"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)


def _allocate(fd: int, nbytes: int) -> None:
    if nbytes:
        os.posix_fallocate(fd, 0, nbytes)


def create_space(
    dir_fd: int, name: str, meta: SpaceMeta, *, direct: bool
) -> tuple[SpaceFiles, int]:
    """Make a space's files, allocated whole; return them and the slots they hold.

    A file system without room for ``meta.capacity`` slots gets as many as its free space
    holds (at least one, else `OSError` ``ENOSPC``). The meta file is written last: a space is
    found by a later daemon only once its files are whole.
    """
    remove_space(dir_fd, name)
    index, _ = _open(dir_fd, name + ".index", _create_flags(), False)
    slab = -1
    try:
        slab, used_direct = _open(dir_fd, name + ".slab", _create_flags(), direct)
        capacity = _allocate_slots(dir_fd, slab, index, meta)
        _write_meta(dir_fd, name, msgspec.structs.replace(meta, capacity=capacity))
    except BaseException:
        for fd in (index, slab):
            if fd >= 0:
                os.close(fd)
        remove_space(dir_fd, name)
        raise
    return SpaceFiles(slab, index, used_direct), capacity


def _allocate_slots(dir_fd: int, slab: int, index: int, meta: SpaceMeta) -> int:
    """Allocate as many of ``meta.capacity`` slots as the file system has room for."""
    capacity = meta.capacity
    while capacity >= 1:
        try:
            _allocate(index, capacity * HEADER_BYTES)
            _allocate(slab, capacity * meta.slot_bytes)
            return capacity
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            os.ftruncate(slab, 0)
            os.ftruncate(index, 0)
            vfs = os.statvfs(dir_fd)
            fits = int(vfs.f_bavail * vfs.f_frsize * 0.9) // (meta.slot_bytes + HEADER_BYTES)
            capacity = min(capacity // 2, fits)
    raise OSError(errno.ENOSPC, "no room for one slot")


def _write_meta(dir_fd: int, name: str, meta: SpaceMeta) -> None:
    tmp = f"{name}.meta.tmp"
    fd = os.open(tmp, _create_flags(), _FILE_MODE, dir_fd=dir_fd)
    try:
        os.write(fd, META_ENCODER.encode(meta))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name + ".meta", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def shrink_space(dir_fd: int, name: str, files: SpaceFiles, meta: SpaceMeta) -> None:
    """Cut a space's files down to ``meta.capacity`` slots; its meta file says so first."""
    _write_meta(dir_fd, name, meta)
    os.ftruncate(files.slab, meta.capacity * meta.slot_bytes)
    os.ftruncate(files.index, meta.capacity * HEADER_BYTES)


def open_space(dir_fd: int, name: str, *, direct: bool) -> tuple[SpaceFiles, bytes]:
    """Open a space a previous daemon left; return its files and its index file's bytes."""
    index = os.open(name + ".index", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        slab, used_direct = _open(
            dir_fd, name + ".slab", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, direct
        )
    except BaseException:
        os.close(index)
        raise
    size = os.fstat(index).st_size
    raw = os.pread(index, size, 0) if size else b""
    return SpaceFiles(slab, index, used_direct), raw


def remove_space(dir_fd: int, name: str) -> None:
    """Remove a space's files (those that exist); the meta file first."""
    for suffix in (".meta", ".meta.tmp", ".slab", ".index"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name + suffix, dir_fd=dir_fd)


def scan(dir_fd: int) -> tuple[list[tuple[str, SpaceMeta]], list[str]]:
    """Find the spaces in the directory (their meta files), and the files no space owns.

    Stray files (a space made halfway, a meta file that does not decode, anything else of
    ours) are removed; files that are not the daemon's kind are left alone.
    """
    names = os.listdir(dir_fd)
    found: list[tuple[str, SpaceMeta]] = []
    kept: set[str] = set()
    for entry in names:
        if not entry.endswith(".meta"):
            continue
        stem = entry[: -len(".meta")]
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                meta = META_DECODER.decode(os.read(fd, 1 << 22))
            finally:
                os.close(fd)
        except (OSError, ValueError):
            continue
        found.append((stem, meta))
        kept.add(stem)
    strays = []
    for entry in names:
        stem, dot, suffix = entry.rpartition(".")
        if entry.endswith(".meta.tmp"):
            stem = entry[: -len(".meta.tmp")]
        elif not dot or "." + suffix not in SUFFIXES:
            continue
        if stem not in kept:
            strays.append(entry)
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=dir_fd)
    return found, strays


# ------------------------------------------------------------------ chunks


@dataclasses.dataclass(frozen=True)
class Item:
    """One block of a chunk: its key, its slot in the space, its row in host memory."""

    key: bytes
    slot: int
    row: int
    seq: int = 0


@dataclasses.dataclass
class Chunk:
    """What one chunk's I/O did: per item whether it succeeded, and what went wrong."""

    ok: list[bool]
    nbytes: int = 0
    seconds: float = 0.0
    error: OSError | None = None
    """The last I/O error (its items failed); `FATAL` ones stop the chunk."""
    corrupt: int = 0
    """Records read whole that did not match their key, space, length or checksum."""
    short: int = 0
    """Records the file ended before (a truncated file)."""


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What a chunk needs to know of its space."""

    space: bytes
    block_bytes: int
    slot_bytes: int


_local = threading.local()


def _staging(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Return the calling thread's page-aligned staging buffer, at least ``nbytes`` long."""
    buf: np.ndarray[Any, np.dtype[np.uint8]] | None = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes:
        size = max(nbytes, CHUNK_BYTES)
        buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        _local.buf = buf
    return buf


def _runs(items: Sequence[Item]) -> list[list[Item]]:
    """Split items (sorted by slot) into runs of slots that follow each other."""
    runs: list[list[Item]] = []
    for item in items:
        if runs and runs[-1][-1].slot + 1 == item.slot:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _rows_follow(run: Sequence[Item]) -> bool:
    return all(b.row == a.row + 1 for a, b in itertools.pairwise(run))


def _write_full(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        done = os.pwritev(fd, [view], offset)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view, offset = view[done:], offset + done


def _read_full(fd: int, view: memoryview, offset: int) -> int:
    """Read until ``view`` is full or the file ends; return the bytes read."""
    total = 0
    while total < view.nbytes:
        got = os.preadv(fd, [view[total:]], offset + total)
        if got <= 0:
            break
        total += got
    return total


def write_chunk(
    files: SpaceFiles, geo: Geometry, items: Sequence[Item], pieces: Sequence[np.ndarray[Any, Any]]
) -> Chunk:
    """Write each item's block (gathered from ``pieces``) into its slot, then its index entry."""
    started = time.perf_counter()
    out = Chunk(ok=[False] * len(items))
    pos = {id(item): i for i, item in enumerate(items)}
    slot, body = geo.slot_bytes, geo.block_bytes
    for run in _runs(items):
        n = len(run)
        stage = _staging(n * slot)[: n * slot].reshape(n, slot)
        offset = HEADER_BYTES
        follow = _rows_follow(run)
        for piece in pieces:
            width = piece.shape[1]
            if follow:
                stage[:, offset : offset + width] = piece[run[0].row : run[0].row + n]
            else:
                for j, item in enumerate(run):
                    stage[j, offset : offset + width] = piece[item.row]
            offset += width
        stage[:, HEADER_BYTES + body :] = 0
        headers = []
        for j, item in enumerate(run):
            digest = payload_digest(stage[j, HEADER_BYTES : HEADER_BYTES + body].data)
            header = pack_header(geo.space, item.key, body, digest, item.seq)
            stage[j, :HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
            headers.append(header)
        try:
            _write_full(files.slab, stage.data.cast("B"), run[0].slot * slot)
            os.pwrite(files.index, b"".join(headers), run[0].slot * HEADER_BYTES)
        except OSError as exc:
            out.error = exc
            if exc.errno in FATAL:
                break
            continue
        out.nbytes += n * body
        for item in run:
            out.ok[pos[id(item)]] = True
    out.seconds = time.perf_counter() - started
    return out


def read_chunk(
    files: SpaceFiles, geo: Geometry, items: Sequence[Item], pieces: Sequence[np.ndarray[Any, Any]]
) -> Chunk:
    """Read each item's record, check it, and scatter the good ones into their rows."""
    started = time.perf_counter()
    out = Chunk(ok=[False] * len(items))
    pos = {id(item): i for i, item in enumerate(items)}
    slot, body = geo.slot_bytes, geo.block_bytes
    for run in _runs(items):
        n = len(run)
        stage = _staging(n * slot)[: n * slot].reshape(n, slot)
        try:
            got = _read_full(files.slab, stage.data.cast("B"), run[0].slot * slot)
        except OSError as exc:
            out.error = exc
            if exc.errno in FATAL:
                break
            continue
        good = []
        for j, item in enumerate(run):
            if (j + 1) * slot > got:
                out.short += 1
                continue
            header = unpack_header(stage[j, :HEADER_BYTES].data)
            payload = stage[j, HEADER_BYTES : HEADER_BYTES + body]
            if (
                header is None
                or header.space != geo.space
                or header.key != item.key
                or header.length != body
                or payload_digest(payload.data) != header.digest
            ):
                out.corrupt += 1
                continue
            good.append(j)
        _scatter(stage, run, good, pieces)
        out.nbytes += len(good) * body
        for j in good:
            out.ok[pos[id(run[j])]] = True
    out.seconds = time.perf_counter() - started
    return out


def _scatter(
    stage: np.ndarray[Any, Any],
    run: Sequence[Item],
    good: list[int],
    pieces: Sequence[np.ndarray[Any, Any]],
) -> None:
    """Copy the good records' pieces into their rows (one strided copy per piece if it can)."""
    whole = len(good) == len(run) and _rows_follow(run)
    offset = HEADER_BYTES
    for piece in pieces:
        width = piece.shape[1]
        if whole:
            piece[run[0].row : run[0].row + len(run)] = stage[:, offset : offset + width]
        else:
            for j in good:
                piece[run[j].row] = stage[j, offset : offset + width]
        offset += width


def plan_chunks(items: list[Item], slot_bytes: int) -> list[list[Item]]:
    """Sort items by slot and cut them into chunks of at most `CHUNK_BYTES` (one item at least)."""
    items = sorted(items, key=lambda it: it.slot)
    per = chunk_slots(slot_bytes)
    return [items[i : i + per] for i in range(0, len(items), per)]


def chunk_slots(slot_bytes: int) -> int:
    """Slots one chunk (one I/O call) holds: as many as `CHUNK_BYTES` takes, one at least."""
    return max(1, CHUNK_BYTES // slot_bytes)


def drop_cached(files: SpaceFiles) -> None:
    """Ask the kernel to drop the slab's pages from the page cache (benchmarks, buffered I/O)."""
    with contextlib.suppress(OSError):
        os.fsync(files.slab)
        os.posix_fadvise(files.slab, 0, 0, os.POSIX_FADV_DONTNEED)
