"""The producer side of node-to-node transfer: published requests, their leases, and reads.

Blocks of a request are held from a `Publish` until every producer rank was read by its
``expected_readers`` consumer ranks (counted from the consumers' `Notify` messages; then
``finished_sending``), or until the lease ends (then ``finished_sending`` too, with
``expired_sending``, counted in `Producer.leases_expired_total`, and later reads of that request
are refused). Reads on the ZMQ plane are served here (`Producer.read`); the NIXL plane reads
registered memory without the producer's daemon.

`kvsidecar.peer.service.PeerService` owns the socket these messages arrive on and the task that
runs `Producer.lease_loop`; every outcome leaves through its ``emit`` hook.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvsidecar.core.mover import check_range
from kvsidecar.node.config import Config
from kvsidecar.node.registry import Engine, Registry
from kvsidecar.peer.messages import Claim, Notify, PeerError, ReadBlocks, Verdict
from kvsidecar.peer.plan import I64
from kvsidecar.peer.zmq_plane import CHUNK_RANGES, serve_read
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Ok
from kvsidecar.wire.pulls import Publish
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.peer")

_MAX_RANGES = 4 * CHUNK_RANGES
"""Most ranges one read may name (a consumer sends at most `CHUNK_RANGES`): a read is checked
and answered in one turn of the event loop, so its size is what that turn costs."""
_EXPIRED_MEMORY = 4096
"""How many expired request ids are remembered to refuse late reads."""
_EARLY_NOTIFIES = 4096
"""Requests whose notifications came before their publish, kept at most (each for one lease).
Beyond it further early notifications are dropped: such a request then ends at its lease, as a
lost notification does, and a peer sending notifications for made-up requests cannot grow this
daemon's memory without bound."""
_MAX_READERS = 1024
"""Readers counted per producer rank of one request (more than any real TP x DCP fan-in)."""
MAX_PUBLISHED_PER_OWNER = 4096
"""Requests one user's engines may hold published and unread, all together: a publish past it
is refused ``busy`` (the engine then frees the request's blocks and its consumer computes the
prompt). A publish holds the producer engine's blocks for up to ``peer_lease_s``, and its
request may come from an API client, so what unread publishes hold is bounded per user."""
MAX_PUBLISHED_BLOCKS_PER_OWNER = 1 << 22
"""Block ids the unread publishes of one user's engines may name, all together (32 MiB of ids in
the daemon): a publish past it is refused ``busy``."""


@dataclass(eq=False)
class _Held:
    """A published request (or notifications that came before its publish)."""

    deadline: float
    published: bool = False
    expected: int = 1
    readers: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    blocks: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The published block ids, sorted and unique: the only blocks a read may reach."""
    digest: str = ""
    """The prompt the blocks were published for (`Publish.prompt_digest`)."""
    owner: str = ""
    """The user of the engine that published it (its publishes are counted per user)."""


class Producer:
    """Holds published requests for their readers, releases them, and serves their reads."""

    def __init__(
        self, config: Config, registry: Registry, emit: Callable[[PeerCompletion], None]
    ) -> None:
        self.config = config
        self.registry = registry
        self.emit = emit
        """Where completion events go (`kvsidecar.peer.service.PeerService.emit`)."""
        self.leases_expired_total = 0
        self.bytes_served_total = 0
        self._held: dict[tuple[str, str], _Held] = {}
        self._early = 0
        """Entries of ``_held`` made by a notification before their publish."""
        self.notifies_dropped_total = 0
        """Notifications ignored: unknown engine or rank, or too many early ones."""
        self._expired: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._requests_of: collections.Counter[str] = collections.Counter()
        self._blocks_of: collections.Counter[str] = collections.Counter()
        """Published requests held, and the block ids they name, per owner."""
        self.publishes_refused_total = 0
        """Publishes refused ``busy``: their user held its bound of unread ones."""

    @property
    def published(self) -> int:
        """Requests published and held now."""
        return len(self._held) - self._early

    def publish(self, req: Publish, ids: IdArray) -> Ok:
        """Hold a request's blocks for remote readers until read or until the lease ends."""
        engine = self.registry.engine(req.engine_id)
        check_range(ids, _num_blocks(engine), "published")
        if not math.isfinite(req.lease_s):
            raise SidecarError(
                "invalid_message", f"lease_s must be a finite number, not {req.lease_s}"
            )
        # At most the daemon's lease: an unconsumed publish holds the producer's blocks in vLLM.
        lease = (
            min(req.lease_s, self.config.peer_lease_s)
            if req.lease_s > 0
            else self.config.peer_lease_s
        )
        key = (req.engine_id, req.request_id)
        before = self._held.get(key)
        blocks = np.union1d(
            np.zeros(0, dtype=np.int64) if before is None else before.blocks, ids.astype(np.int64)
        )
        self._check_room(engine.owner, before, blocks)
        held = before
        if held is None:
            held = self._held[key] = _Held(deadline=0.0)
        elif not held.published:  # notified before this publish: no longer an early entry
            self._early -= 1
        else:
            self._count(held, -1)  # counted again below, with its blocks (and owner) now
        held.published = True
        held.owner = engine.owner
        held.deadline = time.monotonic() + lease
        held.blocks = blocks
        held.digest = req.prompt_digest
        self._count(held, +1)
        self._expired.pop(key, None)
        self._check_sent(key)
        return Ok(id=req.id)

    def _check_room(self, owner: str, before: _Held | None, blocks: I64) -> None:
        """Refuse (``busy``) a publish that would pass its owner's bounds of unread publishes."""
        again = before is not None and before.published and before.owner == owner
        counted = before.blocks.size if before is not None and again else 0
        requests = self._requests_of[owner] + (0 if again else 1)
        named = self._blocks_of[owner] + blocks.size - counted
        why = ""
        if requests > MAX_PUBLISHED_PER_OWNER:
            why = f"{MAX_PUBLISHED_PER_OWNER} published requests"
        elif named > MAX_PUBLISHED_BLOCKS_PER_OWNER:
            why = f"{MAX_PUBLISHED_BLOCKS_PER_OWNER} published block ids"
        if why:
            self.publishes_refused_total += 1
            raise SidecarError(
                "busy",
                f"the engines of {owner} hold {why} nobody has read yet (the bound per user); "
                "they are released as their readers come or their leases end",
            )

    def _count(self, held: _Held, sign: int) -> None:
        """Count a published request's blocks for its owner (``sign`` -1: uncount them)."""
        if not held.published:
            return
        for counter, n in ((self._requests_of, 1), (self._blocks_of, int(held.blocks.size))):
            counter[held.owner] += sign * n
            if counter[held.owner] <= 0:
                del counter[held.owner]

    def on_notify(self, msg: Notify) -> None:
        """Count a consumer rank's read of one producer rank; release the request when all read."""
        key = (msg.engine_id, msg.request_id)
        engine = self.registry.engines.get(msg.engine_id)
        rank = (msg.tp_rank, msg.pp_rank)
        held = self._held.get(key)
        # Only a rank of a registered engine can have been read; anything else grows nothing.
        if engine is None or not (0 <= rank[0] < engine.tp_size and 0 <= rank[1] < engine.pp_size):
            self.notifies_dropped_total += 1
            return
        if held is None:
            if self._early >= _EARLY_NOTIFIES:
                self.notifies_dropped_total += 1
                return
            # Read before its publish arrived: remembered for one lease, then forgotten.
            held = self._held[key] = _Held(deadline=time.monotonic() + self.config.peer_lease_s)
            self._early += 1
        held.expected = max(held.expected, min(msg.expected_readers, _MAX_READERS))
        readers = held.readers.setdefault(rank, set())
        if len(readers) < _MAX_READERS:
            readers.add(msg.reader)
        self._check_sent(key)

    def _check_sent(self, key: tuple[str, str]) -> None:
        held = self._held.get(key)
        engine = self.registry.engines.get(key[0])
        if held is None or not held.published or engine is None:
            return
        ranks = {(w.ref.tp_rank, w.ref.pp_rank) for w in engine.workers.values()}
        if all(len(held.readers.get(r, ())) >= held.expected for r in ranks):
            self._forget(key)
            self.emit(PeerCompletion(engine_id=key[0], finished_sending=frozenset({key[1]})))

    async def lease_loop(self) -> None:
        """Release the requests whose lease ended, a few times per lease, until cancelled."""
        period = min(0.25, self.config.peer_lease_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for key, held in list(self._held.items()):
                if held.deadline > now:
                    continue
                self._forget(key)
                if held.published:
                    self._expire(key)

    def _forget(self, key: tuple[str, str]) -> None:
        held = self._held.pop(key)
        if not held.published:
            self._early -= 1
        self._count(held, -1)

    def _expire(self, key: tuple[str, str]) -> None:
        self.leases_expired_total += 1
        self._expired[key] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        log.info("lease of %s/%s expired unread: blocks released", *key)
        ids = frozenset({key[1]})
        self.emit(PeerCompletion(engine_id=key[0], finished_sending=ids, expired_sending=ids))

    def readable(self, engine_id: str, request_id: str) -> I64 | PeerError:
        """Return the blocks a read of this request may reach now, or why it may read none.

        A request is readable while it is published and within its lease; the blocks are those
        it was published with (sorted, unique).
        """
        key = (engine_id, request_id)
        if key in self._expired:
            return PeerError(
                id=0, code="expired", message=f"request {request_id!r} was released (lease ended)"
            )
        held = self._held.get(key)
        if held is None or not held.published or held.deadline <= time.monotonic():
            return PeerError(
                id=0, code="unknown_engine", message=f"request {request_id!r} is not published"
            )
        return held.blocks

    def verdict(self, claim: Claim) -> Verdict:
        """Say whether a pull may read what it claims: this request, these blocks, this prompt.

        Asked in the handshake (`Claim`), before any byte moves, whatever the data plane.
        """
        blocks = self.readable(claim.engine_id, claim.request_id)
        refused = ""
        if isinstance(blocks, PeerError):
            refused = f"{blocks.code}: {blocks.message}"
        elif claim.prompt_digest != self._held[(claim.engine_id, claim.request_id)].digest:
            refused = (
                f"another_prompt: request {claim.request_id!r} was published for another prompt "
                "than the one this pull is for"
            )
        elif not _within(claim.block_ids, blocks):
            refused = f"out_of_range: blocks that request {claim.request_id!r} did not publish"
        return Verdict(request_id=claim.request_id, refused=refused)

    def read(self, msg: ReadBlocks, data: list[zmq.Frame]) -> tuple[Any, list[Any]]:
        """Answer a ZMQ-plane read: the reply and its data frames, or a `PeerError`."""
        if len(data) != 1:
            return PeerError(id=msg.id, code="bad_message", message="a read has 1 frame"), []
        held = self._held.get((msg.engine_id, msg.request_id))
        if held is None or not held.published or held.deadline <= time.monotonic():
            # Only a published request within its lease opens blocks to readers: not an id
            # never published, not one past its lease, not one forgotten since.
            why = (
                "was released when its lease expired"
                if (msg.engine_id, msg.request_id) in self._expired
                else "is not published here (never, or its lease ended)"
            )
            return PeerError(
                id=msg.id, code="expired", message=f"request {msg.request_id!r} {why}"
            ), []
        worker = self.registry.rank_worker(msg.engine_id, msg.tp_rank, msg.pp_rank)
        if worker is None:
            return PeerError(
                id=msg.id,
                code="unknown_worker",
                message=f"no worker {msg.engine_id}/tp{msg.tp_rank}.pp{msg.pp_rank}",
            ), []
        reply, frames = serve_read(
            msg, data[0].buffer, worker.device.layers, _MAX_RANGES, blocks=held.blocks
        )
        if not isinstance(reply, PeerError):
            self.bytes_served_total += reply.nbytes
        return reply, frames


def _within(ids: list[int], published: I64) -> bool:
    """Whether every id is one of ``published`` (sorted, unique); ids past int64 are not."""
    try:
        wanted = np.asarray(ids, dtype=np.int64)
    except (OverflowError, ValueError):
        return False
    if not wanted.size:
        return True
    at = np.searchsorted(published, wanted)  # where each would be: sorted, so a binary search
    return bool((at < published.size).all() and (published[at] == wanted).all())


def _num_blocks(engine: Engine) -> int:
    first = next(iter(engine.workers.values()), None)
    return 0 if first is None else int(first.device.num_blocks)
