"""The disk tier's format: a namespace's three files, and the record that carries each block.

A namespace ("space") on disk is three files in ``cache_dir``, named by its `space_id` (a digest
of owner, fingerprint and TP rank: a file name says nothing of whose it is):

- ``<id>.meta``: `SpaceMeta`, JSON: the namespace's key, layers and geometry. Written once, when
  the space is made (a temporary file renamed over it), so it is whole or absent.
- ``<id>.slab``: ``capacity`` slots of `slot_bytes` each (a multiple of 4 KiB, for ``O_DIRECT``),
  allocated whole when the space is made. Slot ``s`` holds one block as a record: a
  `HEADER_BYTES` header (magic, format version, the space's id, the block's key, the payload's
  length and 64-bit XXH3 digest, a sequence number, the header's own CRC32), then the block's
  bytes (each
  piece of it, layer by layer, in the namespace's layer order), then zeros.
- ``<id>.index``: the header of every slot's record again, `HEADER_BYTES` each, written after the
  slot's record. A restarted daemon reads this file only (``capacity`` x 128 bytes, not the
  slab), so rebuilding the index costs what the index holds, not what the blocks weigh.

The record in the slab is what counts: a read checks its header (the space, the key, the
length) and the payload's digest (`payload_digest`) before a byte is handed up, so a slot whose
index entry and record disagree (a daemon killed between the two writes, a torn write, a
flipped byte, a truncated file) is a miss, never another block. Pure code, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib
from collections.abc import Iterator

import msgspec
import numpy as np
import xxhash

from kvsidecar.wire.types import BufferDescriptor

MAGIC = b"KVSB"
FORMAT_VERSION = 2
"""Records of another version are not read (a miss, as a damaged one): version 1 held a CRC32."""
ALIGN = 4096
"""Slots and I/O are multiples of this (``O_DIRECT`` wants the device's logical block size)."""
KEY_FIELD = 64
"""Longest key a header holds (`kvsidecar.daemon.cache.prefix.MAX_KEY_SIZE`)."""

_HEADER = struct.Struct("<4sHHIQ16s64sQ16sI")
"""magic, version, key length, payload length, payload digest, space id, key, sequence,
reserved, CRC32 of the 124 bytes before it."""
HEADER_BYTES = _HEADER.size
_CHECKED = HEADER_BYTES - 4

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u2"),
        ("key_len", "<u2"),
        ("length", "<u4"),
        ("digest", "<u8"),
        ("space", "V16"),
        ("key", "V64"),
        ("seq", "<u8"),
        ("reserved", "V16"),
        ("header_crc", "<u4"),
    ]
)
"""The header as a numpy record, to read a whole index file at once."""
assert HEADER_DTYPE.itemsize == HEADER_BYTES


def space_id(owner: str, fingerprint: str, tp_rank: int) -> bytes:
    """Return the 16-byte identity of a namespace on disk (file names, record headers)."""
    text = f"kvsidecar-space\0{owner}\0{fingerprint}\0{tp_rank}".encode()
    return hashlib.sha256(text).digest()[:16]


def payload_digest(payload: memoryview) -> int:
    """Return the checksum a record carries of its block: XXH3, 64 bits.

    It is computed over every byte written and read, so its speed bounds the tier's: XXH3 runs at
    about ten times zlib's CRC32 on one core (docs/benchmarks.md, "bench disk"), and a damaged
    block passes it by chance once in 2^64, not 2^32. It detects damage, not an attacker: the
    directory's owner is the daemon's uid (docs/reliability.md).
    """
    return xxhash.xxh3_64_intdigest(payload)


def slot_bytes(block_bytes: int) -> int:
    """Bytes of one slot: a record (header and block) rounded up to `ALIGN`."""
    return -(-(HEADER_BYTES + block_bytes) // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Header:
    """A record's header, checked."""

    space: bytes
    key: bytes
    length: int
    digest: int
    seq: int


def pack_header(space: bytes, key: bytes, length: int, digest: int, seq: int) -> bytes:
    """Encode a record's header (its own CRC32 last)."""
    if len(key) > KEY_FIELD:
        raise ValueError(f"a key of {len(key)} bytes does not fit a header ({KEY_FIELD})")
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), length, digest, space, key, seq, b"", 0)
    return body[:_CHECKED] + struct.pack("<I", zlib.crc32(body[:_CHECKED]))


def unpack_header(raw: bytes | memoryview) -> Header | None:
    """Decode a header; None when it is not one (zeros, another format, a damaged header)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, key_len, length, digest, space, key, seq, _, check = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION or key_len > KEY_FIELD:
        return None
    if zlib.crc32(raw[:_CHECKED]) != check:
        return None
    return Header(space, key[:key_len], length, digest, seq)


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
