"""The disk tier's files as a test sees them, and file systems to put them on.

- `space_files`: a namespace's slab, index and meta files in a ``cache_dir``;
- `slot_of`: the slot a block's key holds, read from the index file as the daemon writes it;
- `flip_byte`, `record_offset`: damage one block's record where it lies in the slab;
- `tmpfs`: a size-limited tmpfs mounted for the test (root only), unmounted after it;
- `remount_read_only`: that mount made read-only (no file of it may be open for writing).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvsidecar.daemon.cache.disk_format import (
    HEADER_BYTES,
    META_DECODER,
    index_entries,
    space_id,
)


def space_files(
    cache_dir: str | Path, owner: str, fingerprint: str, rank: int = 0
) -> dict[str, Path]:
    """The files of namespace ``(owner, fingerprint, rank)``: ``slab``, ``index``, ``meta``."""
    stem = space_id(owner, fingerprint, rank).hex()
    return {kind: Path(cache_dir) / f"{stem}.{kind}" for kind in ("slab", "index", "meta")}


def slot_bytes_of(files: dict[str, Path]) -> int:
    """The slot size its meta file names."""
    return META_DECODER.decode(files["meta"].read_bytes()).slot_bytes


def slot_of(files: dict[str, Path], owner: str, fingerprint: str, key: bytes, rank: int = 0) -> int:
    """The slot the index file says ``key`` is in (KeyError: none)."""
    raw = files["index"].read_bytes()
    for slot, header in index_entries(raw, space_id(owner, fingerprint, rank)):
        if header.key == key:
            return slot
    raise KeyError(key.hex())


def record_offset(files: dict[str, Path], slot: int, *, payload: int = 0) -> int:
    """The byte of the slab at ``payload`` bytes into slot ``slot``'s block (past its header)."""
    return slot * slot_bytes_of(files) + HEADER_BYTES + payload


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of one byte of a file, in place."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([old[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root, with the capability)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory(prefix="kvs-mnt-", dir="/tmp") as probe:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe],
            check=False,
            capture_output=True,
        )
        if done.returncode != 0:
            return False
        subprocess.run(["umount", probe], check=True)
    return True


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``"1m"``) on a fresh directory; unmounted and removed after."""
    mount = Path(tempfile.mkdtemp(prefix="kvs-tmpfs-", dir="/tmp"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        with contextlib.suppress(OSError):
            mount.rmdir()


def remount_read_only(mount: Path) -> None:
    """Make a mount read-only (fails while a file of it is open for writing)."""
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
