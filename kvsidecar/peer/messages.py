"""The peer protocol: what two daemons say to each other on the peer socket.

A daemon with a ``peer_endpoint`` binds a ZeroMQ ROUTER there; a pulling daemon connects one
DEALER per remote endpoint. Messages are `msgspec` structs in one tagged union per direction,
separate from the control protocol (`kvsidecar.wire.protocol`), framed the same way: ``[header,
*data]``. Bulk data travels in raw frames, never inside a struct:

- `ReadBlocks` carries one frame: an ``(n, 3)`` little-endian int64 array of ``(layer index,
  byte offset, byte length)`` ranges of the producer worker's registered layers.
- `ReadData` is followed by ``n`` frames, the bytes of each range in order, sent zero-copy
  from the producer's mapped buffers and received straight into the consumer's buffers; or,
  when it says ``packed``, by one frame holding the ranges' bytes back to back (a chunk of many
  small ranges, such as single blocks: see `kvsidecar.peer.zmq_plane.packable`).

Every request carries an ``id`` that its reply echoes, so several reads can be in flight on one
connection. `Notify` has no reply (a lost notification ends in the producer's lease expiry).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvsidecar.core.topology import EngineTransferInfo
from kvsidecar.wire.types import Arrangement, BufferDescriptor, MemoryOrder, PromptDigest

PEER_PROTOCOL_VERSION = 3
"""Bumped on any incompatible change of the messages below; peers of another version are
refused at the handshake."""

PeerErrorCode = Literal[
    "version_mismatch",
    "bad_message",
    "unknown_engine",
    "unknown_worker",
    "out_of_range",
    "expired",
    "unsupported",
    "shutting_down",
]
"""Why a peer refused a request."""


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two engines must agree on for one's KV blocks to mean anything to the other."""

    model_hash: str
    cache_dtype: str
    head_size: int
    total_kv_heads: int
    num_layers: int
    is_mla: bool


class PeerWorker(msgspec.Struct, frozen=True):
    """One rank of a producer engine: its layers, their layouts, and its transfer sizes.

    ``layer_addrs`` (NIXL only; empty otherwise) are the base addresses of each layer's
    registered memory in the producer's NIXL agent, in ``layers`` order.
    """

    tp_rank: int
    pp_rank: int
    dcp_rank: int
    layers: list[str]
    descriptors: list[BufferDescriptor]
    transfer: EngineTransferInfo
    layer_addrs: list[int] = []


class PeerEngine(msgspec.Struct, frozen=True):
    """One engine of a daemon as the handshake describes it."""

    engine_id: str
    compat: CompatInfo
    compat_hash: str
    tp_size: int
    pp_size: int
    dcp_size: int
    arrangement: Arrangement
    memory_order: MemoryOrder
    block_size: int
    workers: list[PeerWorker]


class _PeerRequest(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    id: int


class Claim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request a pull is about to read, as the producer must allow it (`PeerHello.claims`).

    ``block_ids`` are the producer's blocks the pull reads; ``prompt_digest`` is the digest of
    the prompt the consumer holds (`kvsidecar.wire.pulls.PullItem.prompt_digest`). The producer
    allows the read only when the request is published and within its lease, every block is one
    it published for that request, and the digest equals the one it was published with.
    """

    engine_id: str
    request_id: str
    block_ids: list[int]
    prompt_digest: PromptDigest = ""


class PeerHello(_PeerRequest, tag="peer_hello", frozen=True):
    """Handshake: versions, who asks, whether it wants NIXL metadata, what it will read."""

    protocol_version: int
    daemon_id: str
    want_nixl: bool = False
    claims: list[Claim] = []


class ReadBlocks(_PeerRequest, tag="read", frozen=True):
    """Read byte ranges of one producer worker's layers (ZMQ plane). One raw range frame."""

    engine_id: str
    tp_rank: int
    pp_rank: int
    request_id: str
    layers: list[str]
    """Layer names; the range frame's layer index points into this list."""


class Notify(_PeerRequest, tag="notify", frozen=True):
    """A consumer rank finished reading a request from one producer rank (both planes)."""

    engine_id: str
    request_id: str
    tp_rank: int
    pp_rank: int
    reader: str
    """Which consumer rank read (daemon id, engine, rank): a repeated notification counts once."""
    expected_readers: int
    """How many consumer ranks read each producer rank (``dcp_consumer_count``)."""


PeerRequest = PeerHello | ReadBlocks | Notify
"""Everything a pulling daemon sends to a producer's peer endpoint."""


class _PeerReply(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    id: int


class Verdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The producer's answer to one `Claim`: ``refused`` is why it may not be read ("": it may)."""

    request_id: str
    refused: str = ""


class PeerWelcome(_PeerReply, tag="peer_welcome", frozen=True):
    """Handshake reply: versions, engines, data planes, NIXL agent metadata, claims' verdicts.

    ``verdicts`` answer the hello's claims one for one, in their order.
    """

    protocol_version: int
    daemon_id: str
    engines: list[PeerEngine]
    planes: list[str]
    nixl_agent: str = ""
    nixl_metadata: bytes = b""
    verdicts: list[Verdict] = []


class ReadData(_PeerReply, tag="read_data", frozen=True):
    """The ranges of a `ReadBlocks`, as raw frames following this header."""

    nbytes: int
    packed: bool = False
    """One frame of ``nbytes`` follows, the ranges back to back in order, instead of one frame
    per range."""


class PeerError(_PeerReply, tag="peer_error", frozen=True):
    """The request was refused; nothing was sent."""

    code: PeerErrorCode
    message: str


PeerReply = PeerWelcome | ReadData | PeerError
"""Everything a producer's peer endpoint answers."""
