"""Node-to-node pulls on the control socket: what a worker or scheduler asks its own daemon.

`Pull` has the daemon fetch a request's blocks from another node's daemon (or, with an empty
endpoint, from another engine of this daemon), `Publish` offers this engine's blocks to such
readers, `TakePeerEvents` collects what finished. The daemons' own peer protocol is
`kvsidecar.peer.messages`. Members of the unions in `kvsidecar.wire.protocol`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvsidecar.wire.bases import ReplyBase as _Reply
from kvsidecar.wire.bases import RequestBase as _Request
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.types import IdsDtype, Medium, MoveEvents, PromptDigest


class PullItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request of a `Pull`: its id, and how many ids it has in each of the two id frames.

    ``num_remote`` ids (the producer's blocks, in token order) land in ``num_local`` local blocks:
    with a local block size ``r`` times the remote one, local block ``j`` receives remote blocks
    ``r*j .. r*j + r - 1``, so ``r * (num_local - 1) < num_remote <= r * num_local``.
    ``remote_request_id`` is the producer's id for it (default: the same id).
    ``prompt_digest`` names the prompt the consumer holds (`Publish.prompt_digest`): the producer
    serves the request only when it was published with the same digest.
    """

    request_id: str
    num_remote: int
    num_local: int
    remote_request_id: str = ""
    prompt_digest: PromptDigest = ""


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
    events: MoveEvents | None = None
    """For GPU memory of one rank (``tp_rank`` given): the caller's ``ready`` event; no block is
    written before the caller's stream has reached it (`Move.events`)."""


class Publish(_Request, tag="publish", frozen=True):
    """Hold a request's blocks for remote readers (producer side). Frame 0: the block ids.

    The daemon reports ``finished_sending`` for the request once every producer rank was read
    by all its consumers, or once the lease (``lease_s``, 0 = ``peer_lease_s``) runs out.
    Only these blocks of the request can be read, and only by pulls whose item carries the same
    ``prompt_digest`` (a digest of the prompt whose KV the blocks hold; "" for none): a consumer
    holding another prompt cannot read them.
    """

    engine_id: str
    request_id: str
    lease_s: float = 0.0
    ids_dtype: IdsDtype = "int64"
    prompt_digest: PromptDigest = ""


class TakePeerEvents(_Request, tag="take_peer_events", frozen=True):
    """Take (remove and return) the queued peer completion events; ``engine_id`` "" = all."""

    engine_id: str = ""


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


class PeerEvents(_Reply, tag="peer_events", frozen=True):
    """The peer completion events taken by `TakePeerEvents`, oldest first."""

    events: list[PeerCompletion]
