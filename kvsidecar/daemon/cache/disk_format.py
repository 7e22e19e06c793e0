"""The disk tier's format: a namespace's three files, and the record that carries each block.

A namespace ("space") on disk is three files in ``cache_dir``, named by its `space_id` (a digest
of owner, fingerprint and TP rank: a file name says nothing of whose it is):

- ``<id>.meta``: `SpaceMeta`, JSON: the namespace's key, layers and geometry. Written once, when
  the space is made (a temporary file renamed over it), so it is whole or absent.
- ``<id>.slab``: ``capacity`` slots of `slot_bytes` each (a multiple of 4 KiB, for ``O_DIRECT``),
  allocated whole when the space is made. Slot ``s`` holds one block as a record: a
  `HEADER_BYTES` header (magic, format version, the space's id, the block's key, the payload's
  length and CRC32, a sequence number, the header's own CRC32), then the block's bytes (each
  piece of it, layer by layer, in the namespace's layer order), then zeros.
- ``<id>.index``: the header of every slot's record again, `HEADER_BYTES` each, written after the
  slot's record. A restarted daemon reads this file only (``capacity`` x 128 bytes, not the
  slab), so rebuilding the index costs what the index holds, not what the blocks weigh.

The record in the slab is what counts: a read checks its header (the space, the key, the
length) and the payload's CRC32 before a byte is handed up, so a slot whose index entry and
record disagree (a daemon killed between the two writes, a torn write, a flipped byte, a
truncated file) is a miss, never another block. Pure code, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib
from collections.abc import Iterator

import msgspec
import numpy as np

from kvsidecar.wire.types import BufferDescriptor

MAGIC = b"KVSB"
FORMAT_VERSION = 1
ALIGN = 4096
"""Slots and I/O are multiples of this (``O_DIRECT`` wants the device's logical block size)."""
KEY_FIELD = 64
"""Longest key a header holds (`kvsidecar.daemon.cache.prefix.MAX_KEY_SIZE`)."""

_HEADER = struct.Struct("<4sHHII16s64sQ20sI")
"""magic, version, key length, payload length, payload CRC32, space id, key, sequence,
reserved, CRC32 of the 124 bytes before it."""
HEADER_BYTES = _HEADER.size
_CHECKED = HEADER_BYTES - 4

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u2"),
        ("key_len", "<u2"),
        ("length", "<u4"),
        ("crc", "<u4"),
        ("space", "V16"),
        ("key", "V64"),
        ("seq", "<u8"),
        ("reserved", "V20"),
        ("header_crc", "<u4"),
    ]
)
"""The header as a numpy record, to read a whole index file at once."""
assert HEADER_DTYPE.itemsize == HEADER_BYTES


def space_id(owner: str, fingerprint: str, tp_rank: int) -> bytes:
    """Return the 16-byte identity of a namespace on disk (file names, record headers)."""
    text = f"kvsidecar-space\0{owner}\0{fingerprint}\0{tp_rank}".encode()
    return hashlib.sha256(text).digest()[:16]


def slot_bytes(block_bytes: int) -> int:
    """Bytes of one slot: a record (header and block) rounded up to `ALIGN`."""
    return -(-(HEADER_BYTES + block_bytes) // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Header:
    """A record's header, checked."""

    space: bytes
    key: bytes
    length: int
    crc: int
    seq: int


def pack_header(space: bytes, key: bytes, length: int, crc: int, seq: int) -> bytes:
    """Encode a record's header (its own CRC32 last)."""
    if len(key) > KEY_FIELD:
        raise ValueError(f"a key of {len(key)} bytes does not fit a header ({KEY_FIELD})")
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), length, crc, space, key, seq, b"", 0)
    return body[:_CHECKED] + struct.pack("<I", zlib.crc32(body[:_CHECKED]))


def unpack_header(raw: bytes | memoryview) -> Header | None:
    """Decode a header; None when it is not one (zeros, another format, a damaged header)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, key_len, length, crc, space, key, seq, _, check = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION or key_len > KEY_FIELD:
        return None
    if zlib.crc32(raw[:_CHECKED]) != check:
        return None
    return Header(space, key[:key_len], length, crc, seq)


class SpaceMeta(msgspec.Struct, frozen=True):
    """The ``.meta`` file of a space: what it is and how its slab is laid out."""

    version: int
    owner: str
    fingerprint: str
    tp_rank: int
    layers: dict[str, BufferDescriptor]
    block_bytes: int
    slot_bytes: int
    capacity: int


META_ENCODER = msgspec.json.Encoder()
META_DECODER = msgspec.json.Decoder(SpaceMeta)


def index_entries(raw: bytes, space: bytes) -> Iterator[tuple[int, Header]]:
    """Yield the slots of an index file whose header is whole and names ``space``.

    Vectorised over the magic and version, so that the loop runs over written slots only.
    """
    count = len(raw) // HEADER_BYTES
    table = np.frombuffer(raw, dtype=HEADER_DTYPE, count=count)
    written = np.flatnonzero(
        (table["magic"] == MAGIC) & (table["version"] == FORMAT_VERSION)
    ).tolist()
    view = memoryview(raw)
    for slot in written:
        header = unpack_header(view[slot * HEADER_BYTES : (slot + 1) * HEADER_BYTES])
        if header is not None and header.space == space:
            yield slot, header
