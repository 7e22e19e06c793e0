"""Wire types of kvsidecar, defined once.

Every message that crosses a socket is a `msgspec.Struct` here. Schema evolution follows msgspec's
rules: new fields go at the end and carry defaults; a field's type never changes. Bulk data (block
ids, block bytes) never travels inside these structs: it rides in raw frames next to them.
"""

from __future__ import annotations

import typing
from typing import ClassVar, Literal

import msgspec

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the messages below."""

Arrangement = Literal["kv_first", "blocks_first", "split", "mla"]
"""How K and V sit in one registered tensor.

- ``kv_first``: ``(2, B, N, H, C)`` (FlashAttention)
- ``blocks_first``: ``(B, 2, N, H, C)`` (FlashInfer)
- ``split``: ``(B, N, H, C)``, one tensor for K and another for V
- ``mla``: ``(B, N, C)``, one latent vector per token
"""

MemoryOrder = Literal["NHD", "HND"]
"""Memory order inside one block: tokens-then-heads (NHD) or heads-then-tokens (HND)."""


class BufferDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one registered KV tensor holds and how its bytes are laid out.

    The logical shape is always the engine's view (block dim, then tokens, then heads); the memory
    order says whether tokens or heads vary slower inside a block. MLA buffers have no head dim:
    ``num_heads`` is 1 and ``memory_order`` is irrelevant (NHD by convention).
    """

    arrangement: Arrangement
    memory_order: MemoryOrder
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"float16"``."""
    num_blocks: int
    block_size: int
    """Tokens per block."""
    num_heads: int
    head_size: int


class TransferStats(msgspec.Struct, frozen=True):
    """Mergeable per-worker transfer statistics (the reference's ``kv_connector_stats``).

    Counters add up when merged; nothing is averaged, so rates stay byte-weighted.
    """

    counters: dict[str, float] = {}

    def aggregate(self, other: TransferStats) -> TransferStats:
        """Return the sum of both sets of counters."""
        merged = dict(self.counters)
        for key, value in other.counters.items():
            merged[key] = merged.get(key, 0.0) + value
        return TransferStats(merged)

    def is_empty(self) -> bool:
        """Return True when no counter was recorded."""
        return not self.counters


class CacheEvent(msgspec.Struct, frozen=True):
    """One KV-cache event (block stored or removed) reported by a worker."""

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()


class CacheEvents(msgspec.Struct, frozen=True):
    """Mergeable list of cache events with the number of workers that contributed."""

    events: tuple[CacheEvent, ...] = ()
    num_workers: int = 1

    def merge(self, other: CacheEvents) -> CacheEvents:
        """Append the other worker's events and count its contribution."""
        return CacheEvents(self.events + other.events, self.num_workers + other.num_workers)


class WorkerReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's completion report for one step (the reference's ``KVConnectorOutput``).

    ``worker_id`` and ``step`` identify the report, so that a retried delivery counts once.
    ``expected_finished_count`` of 0 means "unchanged".
    """

    worker_id: str
    step: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    expected_finished_count: int = 0
    kv_connector_stats: TransferStats | None = None
    kv_cache_events: CacheEvents | None = None


class AggregatedOutput(msgspec.Struct, frozen=True):
    """What the engine's scheduler sees for one step, merged over every worker."""

    step: int
    finished_sending: frozenset[str] | None = None
    finished_recving: frozenset[str] | None = None
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    expected_finished_count: int = 0
    kv_connector_stats: TransferStats | None = None
    kv_cache_events: CacheEvents | None = None


# ---------------------------------------------------------------------------------------------
# Control protocol: commands from engine workers and the replies of the daemon.
#
# Framing (see docs/protocol.md): a request is one ZeroMQ multipart message, ``[header, *data]``.
# ``header`` is a msgpack-encoded `Request`; ``data`` are raw frames whose meaning the command
# fixes (block-id arrays, little-endian int32 or int64 as ``ids_dtype`` says). A reply has the same
# shape, ``[header, *data]`` with a msgpack-encoded `Reply`. The ROUTER's routing-id frame is
# added and stripped by ZeroMQ and is not part of this schema.
# ---------------------------------------------------------------------------------------------

ErrorCode = Literal[
    "bad_frame",
    "unknown_message",
    "invalid_message",
    "version_mismatch",
    "too_large",
    "unknown_engine",
    "unknown_worker",
    "unknown_layer",
    "already_registered",
    "incompatible_engine",
    "handle_error",
    "out_of_range",
    "duplicate_destination",
    "length_mismatch",
    "incompatible_buffers",
    "pool_exhausted",
    "not_allocated",
    "busy",
    "shutting_down",
    "timeout",
    "internal",
    # --- peer (node-to-node transfer) ---
    "incompatible_peer",
    "peer_unavailable",
    # --- completion aggregation (kvsidecar/completions.py) ---
    "stale_epoch",
    "step_collected",
    # --- reliability and security (kvsidecar/auth.py, access.py, admission.py) ---
    "forbidden",
    "worker_lost",
    "connection_lost",
]
"""The closed set of error codes a daemon replies with; docs/protocol.md explains each."""

ERROR_CODES: frozenset[str] = frozenset(typing.get_args(ErrorCode))
"""`ErrorCode` as a set, for checks at run time."""

IdsDtype = Literal["int32", "int64"]
"""Element type of a raw block-id frame (little-endian, C order)."""

Medium = Literal["device", "host"]
"""Which buffer set of a worker: its registered KV cache (``device``, whether GPU memory or CPU
shared memory) or its mirror region in the daemon's host pool (``host``)."""


class WorkerRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Names one registered worker: its engine and its ranks. Unique on a daemon."""

    engine_id: str
    tp_rank: int = 0
    pp_rank: int = 0
    dcp_rank: int = 0

    def label(self) -> str:
        """Short human-readable name, e.g. ``prefill/tp1.pp0.dcp0``."""
        return f"{self.engine_id}/tp{self.tp_rank}.pp{self.pp_rank}.dcp{self.dcp_rank}"


class BufferSetRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One side of a move: a worker's registered layers, or that worker's host-pool mirror."""

    worker: WorkerRef
    medium: Medium = "device"
    epoch: int = 0
    """The worker's registration epoch as the sender knows it (`Registered.epoch`); another
    current epoch fails the command with ``stale_epoch``. 0: not checked."""


class ShmRef(msgspec.Struct, frozen=True, tag="shm", tag_field="kind", forbid_unknown_fields=True):
    """A CPU tensor in shared memory whose storage fd was sent on the fd channel.

    Several refs may name the same ``fd_index``: tensors that are views of one storage (many
    layers in one region) share one fd, sent once and mapped once by the daemon. This is also the
    handle `kvsidecar.memory.shm` works with (``ShmHandle`` there).
    """

    fd_index: int
    """Index of the storage's fd among the fds sent under the registration's ``fd_token``."""
    storage_nbytes: int
    """Size of the whole storage (the mapping the daemon makes)."""
    offset: int
    """Byte offset of the tensor's first element within the storage."""
    nbytes: int
    """Bytes from the tensor's first to one past its last reachable byte (strides included)."""

    kind: ClassVar[Literal["shm"]] = "shm"
    """The handle's kind (also its tag on the wire)."""


class CudaIpcRef(
    msgspec.Struct, frozen=True, tag="cuda_ipc", tag_field="kind", forbid_unknown_fields=True
):
    """A CUDA tensor exported by CUDA IPC, the way torch shares CUDA storages.

    Also the handle `kvsidecar.memory.cuda_ipc` works with (``CudaIpcHandle`` there).
    """

    device: int
    """CUDA device index in the worker (the daemon must see the same devices)."""
    ipc_handle: bytes
    """``cudaIpcMemHandle_t`` of the allocation the storage lives in."""
    storage_nbytes: int
    """Size of the storage."""
    storage_offset: int
    """Byte offset of the storage within the CUDA allocation."""
    ref_counter_handle: bytes
    """Name of torch's shared reference-counter file."""
    ref_counter_offset: int
    """Slot of this export in the reference-counter file."""
    event_handle: bytes | None
    """IPC handle of the event to wait on before reading (None when none is needed)."""
    event_sync_required: bool
    """Whether the consumer must wait on ``event_handle``."""
    offset: int
    """Byte offset of the tensor within its storage."""
    nbytes: int
    """Bytes from the tensor's first to one past its last reachable byte."""

    kind: ClassVar[Literal["cuda_ipc"]] = "cuda_ipc"
    """The handle's kind (also its tag on the wire)."""

    def storage_key(self) -> tuple[bytes, int]:
        """Identify the storage: handles with equal keys are views of one storage."""
        return self.ipc_handle, self.storage_offset


HandleRef = ShmRef | CudaIpcRef
"""How the daemon maps a registered layer's memory."""


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered KV tensor: its name (unique per worker), its layout, and its handle."""

    name: str
    descriptor: BufferDescriptor
    handle: HandleRef


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The layout a worker's blocks were written in by a raw copy (the sender's layout)."""

    memory_order: MemoryOrder
    block_size: int


class _Request(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every request: the client-chosen request id echoed in the reply."""

    id: int


class Hello(_Request, tag="hello", frozen=True):
    """First message of a client: checks protocol versions, learns the daemon's limits."""

    protocol_version: int
    client_name: str = ""


class Register(_Request, tag="register", frozen=True):
    """Register one worker's KV tensors (all layers at once; all or nothing).

    The fds of ``shm`` layers must have been sent on the fd channel under ``fd_token``, before
    or at most ``fd_wait_s`` after this request. ``host_blocks`` declares the
    engine's host-pool capacity in blocks (the first worker of an engine sets it; later ones must
    agree or send 0).
    """

    protocol_version: int
    worker: WorkerRef
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    model_hash: str = ""
    layers: list[LayerSpec] = []
    host_blocks: int = 0
    fd_token: bytes = b""
    """Token of the fd-channel message that carried the fds of the ``shm`` layers."""


class Unregister(_Request, tag="unregister", frozen=True):
    """Drop a worker: waits for its in-flight moves, frees its mirror, releases its mappings."""

    worker: WorkerRef
    epoch: int = 0
    """Registration epoch (`Registered.epoch`) this unregister is meant for; 0: any."""


class Heartbeat(_Request, tag="heartbeat", frozen=True):
    """Renew the leases of these workers."""

    workers: list[WorkerRef] = []
    epochs: list[int] = []
    """Per worker, the registration epoch the sender holds (empty, or 0 for one: unchecked)."""


class HostAlloc(_Request, tag="host_alloc", frozen=True):
    """Allocate ``count`` host-pool blocks of an engine (all or nothing).

    The reply carries the ids in one raw frame of ``ids_dtype``.
    """

    engine_id: str
    count: int
    ids_dtype: IdsDtype = "int64"


class HostFree(_Request, tag="host_free", frozen=True):
    """Free host-pool blocks of an engine. Frame 0: the ids (``ids_dtype``)."""

    engine_id: str
    ids_dtype: IdsDtype = "int64"


class Move(_Request, tag="move", frozen=True):
    """Copy blocks from one buffer set to another. Frame 0: source ids, frame 1: destination ids.

    With equal block sizes both arrays have the same length and ``dst[i]`` receives ``src[i]``.
    When the destination's block size is ``r`` times the source's (``r`` = ``block_size_ratio``,
    inferred from the descriptors), ``len(src) == r * len(dst)`` and destination block ``dst[j]``
    receives source blocks ``src[r*j : r*j + r]`` in token order. Layouts that differ (HND/NHD)
    or ``r > 1`` are fixed on the destination after the raw copy. ``layers`` restricts the move to
    these layer names (default: every layer of the source).
    """

    src: BufferSetRef
    dst: BufferSetRef
    layers: list[str] | None = None
    ids_dtype: IdsDtype = "int64"
    request_ids: list[str] = []
    """Engine requests whose blocks this move carries (completion aggregation): once the move
    ends, a ``device`` source worker has finished sending them and a ``device`` destination worker
    has finished receiving them (failed, with the destination ids invalid, if the move failed)."""
    checksum: bool | None = None
    """Verify the copy end to end with a checksum (docs/reliability.md); None: the daemon's
    ``checksum`` setting."""


class FixLayout(_Request, tag="fix_layout", frozen=True):
    """Rewrite a worker's blocks in place from ``remote`` layout to the registered one.

    For blocks that were filled by a raw copy from a sender with another memory order or a
    smaller block size (``block_size`` of ``remote`` must divide the registered block size).
    Frame 0: the block ids.
    """

    target: BufferSetRef
    remote: LayoutSpec
    layers: list[str] | None = None
    ids_dtype: IdsDtype = "int64"


class Status(_Request, tag="status", frozen=True):
    """Ask for the daemon's state."""


class Grant(_Request, tag="grant", frozen=True):
    """Let another engine read and/or write this engine's buffers and host blocks.

    Sent by the client that registered ``owner`` (or by an administrative client, see
    docs/reliability.md): from then on, connections of engine ``grantee`` may use ``owner``'s
    engine as a move source (``read``) and/or destination (``write``). ``read`` and ``write``
    both False revoke. Grants end with the owner engine (when its last worker is released).
    """

    owner: WorkerRef
    grantee: str
    read: bool = True
    write: bool = False


# --- peer (node-to-node transfer, kvsidecar/peer/): commands and replies ----------------------


class PullItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request of a `Pull`: its id, and how many ids it has in each of the two id frames.

    ``num_remote`` ids (the producer's blocks, in token order) land in ``num_local`` local blocks:
    with a local block size ``r`` times the remote one, local block ``j`` receives remote blocks
    ``r*j .. r*j + r - 1``, so ``r * (num_local - 1) < num_remote <= r * num_local``.
    ``remote_request_id`` is the producer's id for it (default: the same id).
    """

    request_id: str
    num_remote: int
    num_local: int
    remote_request_id: str = ""


class Pull(_Request, tag="pull", frozen=True):
    """Read requests' KV blocks from another node's daemon into this engine's blocks.

    Frame 0: every item's remote block ids, concatenated in item order; frame 1: every item's
    local block ids, likewise. ``tp_rank`` None pulls for every registered rank of the engine
    (the scheduler's call); a number pulls for that one rank (a worker's call). The reply
    (`Pulled`) comes when every item is received or failed; ``timeout_s`` 0 means the daemon's
    ``peer_pull_timeout_s``.
    """

    engine_id: str
    remote_endpoint: str
    remote_engine_id: str
    items: list[PullItem]
    tp_rank: int | None = None
    pp_rank: int = 0
    medium: Medium = "device"
    ids_dtype: IdsDtype = "int64"
    timeout_s: float = 0.0
    plane: Literal["", "zmq", "nixl"] = ""
    """Data plane for this pull; "" = the daemon's ``peer_data_plane`` setting."""


class Publish(_Request, tag="publish", frozen=True):
    """Hold a request's blocks for remote readers (producer side). Frame 0: the block ids.

    The daemon reports ``finished_sending`` for the request once every producer rank was read
    by all its consumers, or once the lease (``lease_s``, 0 = ``peer_lease_s``) runs out.
    """

    engine_id: str
    request_id: str
    lease_s: float = 0.0
    ids_dtype: IdsDtype = "int64"


class TakePeerEvents(_Request, tag="take_peer_events", frozen=True):
    """Take (remove and return) the queued peer completion events; ``engine_id`` "" = all."""

    engine_id: str = ""


# --- end peer commands ------------------------------------------------------------------------


# --- completion aggregation (kvsidecar/completions.py): commands --------------------------------


class Report(_Request, tag="report", frozen=True):
    """One worker's completion report for one engine step (a `WorkerReport` on the wire).

    ``epoch`` is the one `Registered` returned for ``worker``: a report from an earlier
    registration (a dead process's last words) gets ``stale_epoch``. The same ``(worker, step)``
    delivered twice counts once (the reply says ``duplicate``); a step the scheduler already
    collected gets ``step_collected`` and its content belongs in the worker's next step.
    """

    worker: WorkerRef
    epoch: int
    step: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    expected_finished_count: int = 0
    kv_connector_stats: TransferStats | None = None
    kv_cache_events: CacheEvents | None = None


class Collect(_Request, tag="collect", frozen=True):
    """The scheduler's call: the aggregated completions of ``engine_id`` up to ``step``.

    Waits up to ``timeout_s`` until every live worker of the engine has reported ``step`` (0: do
    not wait), then aggregates every uncollected report of steps <= ``step``. Steps are collected
    in increasing order; collecting the last collected steps again returns the same answer.
    """

    engine_id: str
    step: int
    timeout_s: float = 1.0


# --- end completion aggregation commands --------------------------------------------------------


Request = (
    Hello
    | Register
    | Unregister
    | Heartbeat
    | HostAlloc
    | HostFree
    | Move
    | FixLayout
    | Status
    | Pull
    | Publish
    | TakePeerEvents  # peer
    | Report
    | Collect  # completion aggregation
    | Grant  # security
)
"""Every request a client may send."""

REQUEST_TAGS: frozenset[str] = frozenset(
    str(t.__struct_config__.tag) for t in typing.get_args(Request)
)
"""The ``type`` values of `Request`."""


class _Reply(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every reply: the id of the request it answers (0 if that was unreadable)."""

    id: int


class HelloReply(_Reply, tag="hello_reply", frozen=True):
    """The daemon's versions, its fd-channel path and the limits it enforces."""

    protocol_version: int
    daemon_version: str
    fd_socket: str
    lease_s: float
    max_message_bytes: int
    max_ids_per_command: int
    metrics_port: int = 0
    """Port of the daemon's HTTP endpoint (/metrics, /healthz, /readyz); 0 when it has none."""


class Registered(_Reply, tag="registered", frozen=True):
    """A worker is registered: its layer count, mapped bytes and host-mirror blocks."""

    worker: WorkerRef
    num_layers: int
    nbytes: int
    host_blocks: int
    lease_s: float
    epoch: int = 0
    """This registration's epoch: a worker's `Report` carries it (see `Report`)."""


class Ok(_Reply, tag="ok", frozen=True):
    """The request succeeded and has nothing to report."""


class HostAllocated(_Reply, tag="host_allocated", frozen=True):
    """Host blocks allocated; frame 0 holds ``count`` ids of ``ids_dtype``."""

    count: int
    ids_dtype: IdsDtype = "int64"


class Moved(_Reply, tag="moved", frozen=True):
    """A move finished: destination blocks written, bytes copied, seconds on the executor."""

    blocks: int
    nbytes: int
    seconds: float
    fixed: bool = False
    verified: bool = False
    """True when the copy was checked end to end with a checksum."""
    invalid_block_ids: list[int] = []
    """Destination blocks whose checksum did not match (their contents are unusable)."""


class Fixed(_Reply, tag="fixed", frozen=True):
    """A fix-layout finished on ``blocks`` blocks."""

    blocks: int


class BufferInfo(msgspec.Struct, frozen=True):
    """One registered layer as status reports it."""

    name: str
    kind: str
    nbytes: int
    descriptor: BufferDescriptor


class WorkerInfo(msgspec.Struct, frozen=True):
    """One registered worker as status reports it."""

    worker: WorkerRef
    tp_size: int
    pp_size: int
    dcp_size: int
    layers: list[BufferInfo]
    nbytes: int
    host_mirror_bytes: int
    lease_left_s: float
    in_flight: int


class EngineInfo(msgspec.Struct, frozen=True):
    """One engine as status reports it."""

    engine_id: str
    model_hash: str
    workers: list[WorkerInfo]
    host_blocks: int
    host_blocks_used: int


class StatusReply(_Reply, tag="status_reply", frozen=True):
    """The daemon's state and its running totals."""

    daemon_version: str
    protocol_version: int
    uptime_s: float
    endpoint: str
    engines: list[EngineInfo]
    host_pool_bytes: int
    host_pool_used_bytes: int
    in_flight_moves: int
    moves_total: int
    moves_failed_total: int
    bytes_moved_total: int
    errors_total: int
    draining: bool = False
    metrics_port: int = 0
    """Port of the daemon's HTTP endpoint (/metrics, /healthz, /readyz); 0 when it has none."""


class Error(_Reply, tag="error", frozen=True):
    """The request failed; nothing was changed. ``code`` is one of `ErrorCode`."""

    code: ErrorCode
    message: str


# --- peer (node-to-node transfer, kvsidecar/peer/): replies -------------------------------------


class Pulled(_Reply, tag="pulled", frozen=True):
    """A pull ended: which requests were received, which failed (and why), bytes and seconds.

    The local blocks of failed requests are in ``invalid_block_ids``; the same outcome is queued
    as a `PeerCompletion` for the completion aggregation.
    """

    finished: list[str]
    failed: list[str]
    invalid_block_ids: list[int]
    nbytes: int
    seconds: float
    plane: str
    error_code: str = ""
    error: str = ""


class PeerCompletion(msgspec.Struct, frozen=True):
    """One completion event of the peer service, for the engine's completion aggregation.

    ``worker`` None means the event covers every rank of the engine (a scheduler's pull, or a
    producer request that every producer rank finished sending). ``expired_sending`` is the
    subset of ``finished_sending`` released by lease expiry rather than by reads.
    """

    engine_id: str
    worker: WorkerRef | None = None
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    expired_sending: frozenset[str] = frozenset()


class PeerEvents(_Reply, tag="peer_events", frozen=True):
    """The peer completion events taken by `TakePeerEvents`, oldest first."""

    events: list[PeerCompletion]


# --- end peer replies -------------------------------------------------------------------------


# --- completion aggregation (kvsidecar/completions.py): replies ---------------------------------


class Reported(_Reply, tag="reported", frozen=True):
    """A `Report` was accepted; ``duplicate`` when this ``(worker, step)`` had been counted."""

    duplicate: bool = False


class Collected(_Reply, tag="collected", frozen=True):
    """The answer to `Collect`: the aggregated output, and who was missing or failed.

    ``missing`` names the live workers whose report for the step had not arrived when the wait
    ended (their late report gets ``step_collected``); ``failed_workers`` those that departed
    (lease expiry, process exit, unregister) since the previous collect, whose pending requests
    were completed on their behalf (receiving ones as failed).
    """

    output: AggregatedOutput
    missing: list[str] = []
    failed_workers: list[str] = []


# --- end completion aggregation replies ---------------------------------------------------------


Reply = (
    HelloReply
    | Registered
    | Ok
    | HostAllocated
    | Moved
    | Fixed
    | StatusReply
    | Error
    | Pulled
    | PeerEvents  # peer
    | Reported
    | Collected  # completion aggregation
)
"""Every reply the daemon sends."""


class Envelope(msgspec.Struct, frozen=True):
    """The two fields every request shares.

    Decoded alone when a request fails to decode as a whole, to tell an unknown tag from bad
    fields and still echo the request id.
    """

    type: str = ""
    id: int = 0
