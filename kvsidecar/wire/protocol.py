"""The control protocol: every command and reply on the daemon's socket, in two tagged unions.

Every message that crosses the control socket is a `msgspec.Struct` here; the values they are made
of live in `kvsidecar.wire.types` (descriptors, references, handles, status entries),
`kvsidecar.wire.reports` (completion reports) and `kvsidecar.wire.errors` (error codes).
Schema evolution follows msgspec's rules: new fields go at the end and carry defaults; a field's
type never changes. Bulk data (block ids, block bytes) never travels inside these structs: it
rides in raw frames next to them.
"""

from __future__ import annotations

import typing

import msgspec

from kvsidecar.wire.bases import ReplyBase as _Reply
from kvsidecar.wire.bases import RequestBase as _Request
from kvsidecar.wire.batch import MoveBatch, MovedBatch
from kvsidecar.wire.cache import (  # prefix cache and connectors
    CacheHits,
    CacheLoad,
    CacheLoaded,
    CacheLookup,
    CacheNamespaceInfo,
    CacheStore,
    CacheStored,
    CacheTierInfo,
    TakeWorkerEvents,
)
from kvsidecar.wire.errors import ErrorCode
from kvsidecar.wire.pulls import PeerEvents, Publish, Pull, Pulled, TakePeerEvents
from kvsidecar.wire.reports import AggregatedOutput, CacheEvents, TransferStats
from kvsidecar.wire.types import (
    BufferSetRef,
    EngineInfo,
    IdsDtype,
    LayerSpec,
    LayoutSpec,
    MoveEvents,
    WorkerRef,
)

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the messages below."""

# Control protocol: commands from engine workers and the replies of the daemon.
#
# Framing (see docs/protocol.md): a request is one ZeroMQ multipart message, ``[header, *data]``.
# ``header`` is a msgpack-encoded `Request`; ``data`` are raw frames whose meaning the command
# fixes (block-id arrays, little-endian int32 or int64 as ``ids_dtype`` says). A reply has the same
# shape, ``[header, *data]`` with a msgpack-encoded `Reply`. The ROUTER's routing-id frame is
# added and stripped by ZeroMQ and is not part of this schema.


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
    fd_tokens: list[bytes] = []
    """Tokens of further fd-channel messages, when the fds do not fit one (253 at most): their
    fds continue the list that ``fd_token`` starts, in this order (``fd_index`` counts across
    all of them)."""


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
    events: MoveEvents | None = None
    """CUDA events ordering the move against the caller's GPU work (docs/protocol.md, "Ordering
    against the engine's GPU work"); None on CPU memory. Needs the ``cuda_events`` capability."""


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
    both False revoke. Grants end with the owner engine (when its last worker is released) and
    with the grantee engine: a later engine of the same name does not inherit them.
    """

    owner: WorkerRef
    grantee: str
    read: bool = True
    write: bool = False
    grantee_user: str = ""
    """The transport user (``uid:<n>``, ``curve:<key>``) whose engine ``grantee`` is meant; ""
    the owner engine's own user. The grant holds that user's engine of that name only, as
    registered now or, if none is, the next one to register, and ends with it."""


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
    | MoveBatch  # many moves per command (kvsidecar/wire/batch.py)
    | CacheLookup
    | CacheStore
    | CacheLoad
    | TakeWorkerEvents  # prefix cache and connectors
)
"""Every request a client may send."""

REQUEST_TAGS: frozenset[str] = frozenset(
    str(t.__struct_config__.tag) for t in typing.get_args(Request)
)
"""The ``type`` values of `Request`."""


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
    peer_endpoint: str = ""
    """Where other daemons pull this node's published blocks (`Pull.remote_endpoint`); "" when
    the daemon has no peer endpoint."""
    daemon_id: str = ""
    """This daemon's identity (changes on restart): two engines that see the same id share a
    daemon, and a pull between them is a local one (`Pull` with ``remote_endpoint`` "")."""
    capabilities: list[str] = []
    """Optional features this daemon serves (`CAPABILITIES`); a client uses a feature only when
    it is listed, so an older daemon is never sent what it would ignore or refuse."""


CAPABILITIES = ("cuda_events", "cuda_vmm", "fd_tokens")
"""Every capability a daemon may announce in `HelloReply.capabilities`:

- ``cuda_events``: `Move.events` is honoured;
- ``cuda_vmm``: `CudaVmmRef` handles are imported (needs CUDA and the driver's VMM API);
- ``fd_tokens``: `Register.fd_tokens` is read (more than 253 fds per registration).
"""


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
    cache_namespaces: list[CacheNamespaceInfo] = []
    """The prefix cache's namespaces (`kvsidecar.daemon.cache.prefix`)."""
    pulls_total: int = 0
    """Pulls into this daemon's engines (`kvsidecar.peer.pull`), local ones included."""
    pulls_failed_total: int = 0
    """Pulls of which at least one request failed."""
    bytes_pulled_total: int = 0
    published_requests: int = 0
    """Requests published by this daemon's engines and not yet read or expired."""
    cache_tiers: list[CacheTierInfo] = []
    """The prefix cache's tiers below the host pool (the disk tier, where configured)."""


class Error(_Reply, tag="error", frozen=True):
    """The request failed; nothing was changed. ``code`` is one of `ErrorCode`."""

    code: ErrorCode
    message: str


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
    | MovedBatch  # kvsidecar/wire/batch.py
    | CacheHits
    | CacheStored
    | CacheLoaded  # prefix cache
)
"""Every reply the daemon sends."""


class Envelope(msgspec.Struct, frozen=True):
    """The two fields every request shares.

    Decoded alone when a request fails to decode as a whole, to tell an unknown tag from bad
    fields and still echo the request id.
    """

    type: str = ""
    id: int = 0
