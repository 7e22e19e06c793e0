"""The consumer side of node-to-node transfer: one pull, from its checks to its completion event.

`check_pull` checks a `Pull` completely against this daemon's registry (typed errors, nothing
sent); `PeerPull.run` takes its steps, bounded by its timeout (a dead or silent peer fails it):

1. handshake: `PeerHello` -> `PeerWelcome` with the remote daemon; the data plane is chosen;
2. plan: the compatibility check (``incompatible_peer`` naming the mismatch, before any byte
   moves) and every local rank's reads (`kvsidecar.peer.plan`);
3. transfer, once the caller's ready event has passed (`kvsidecar.node.copy_events`), each
   request on its own: the reads, the layout fixes on the copy executor, the notifications;
4. completion: one `PeerCompletion` (finished and failed requests, the failed ones' local blocks
   invalid) and the `Pulled` reply. A pull that fails before any read fails every request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import zmq

from kvsidecar.core.mover import check_range, check_unique
from kvsidecar.memory.base import HandleError
from kvsidecar.node.config import Config
from kvsidecar.node.copy_events import ready_of, ready_passed
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.jobs import fix_layers
from kvsidecar.node.registry import BufferSet, Engine, Worker
from kvsidecar.peer.context import PullContext
from kvsidecar.peer.handshake import IncompatiblePeer, check_compatible, describe_engine
from kvsidecar.peer.link import PeerGone, PeerLink, PeerRefused
from kvsidecar.peer.local import LOCAL_PLANE
from kvsidecar.peer.messages import (
    PEER_PROTOCOL_VERSION,
    Claim,
    Notify,
    PeerEngine,
    PeerHello,
    PeerWelcome,
    PeerWorker,
)
from kvsidecar.peer.plan import I64, PlanError, RankPlan, plan_rank
from kvsidecar.peer.planes import DataPlane, ReadTarget
from kvsidecar.wire.errors import SidecarError, require_distinct
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Reply
from kvsidecar.wire.pulls import Pull, Pulled, PullItem
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.peer")

MAX_PULL_BLOCK_LAYERS = 1 << 23
"""Most remote blocks times local layers (all receiving ranks together) one pull may name: a
pull plans about two ranges per block and layer, and its plan's arrays (about 40 bytes a range)
are held until it ends. Twice a 1024-layer engine's 4096 blocks; a larger pull is refused
``too_large`` before anything is planned or sent."""
PLAN_ON_LOOP = 1 << 14
"""Block-layers planned on the event loop; a larger pull is planned on a thread, so that a pull's
size never holds the loop (a plan costs about a microsecond per range)."""


@dataclass(eq=False)
class LocalRank:
    """One local rank taking part in a pull."""

    worker: Worker
    buffers: BufferSet
    desc: PeerWorker


class ItemIds(NamedTuple):
    """One request of a pull with its slices of the two id frames."""

    item: PullItem
    remote_ids: I64
    local_ids: I64


def check_pull(
    ctx: PullContext,
    req: Pull,
    remote_ids: IdArray,
    local_ids: IdArray,
    may_read: Callable[[str], bool],
) -> PeerPull:
    """Check a pull completely against this daemon (typed errors, nothing sent).

    ``may_read`` decides on the remote engine when the remote daemon is this one.
    """
    engine = ctx.registry.engine(req.engine_id)
    # Its one spelling, if it passes the peer endpoint rule and ``peers`` (kvsidecar.peer.links).
    endpoint = ctx.links.check(req.remote_endpoint) if req.remote_endpoint else ""
    require_distinct(
        [it.request_id for it in req.items],
        empty="a pull needs at least one item",
        repeated="a request id appears twice in one pull",
    )
    if any(it.num_remote < 0 or it.num_local < 0 for it in req.items):
        raise SidecarError("invalid_message", "negative id counts")
    if (
        sum(it.num_remote for it in req.items) != remote_ids.size
        or sum(it.num_local for it in req.items) != local_ids.size
    ):
        raise SidecarError("length_mismatch", "item id counts do not match the id frames")
    local, ranks = _local_ranks(engine, req, local_ids)
    block_layers = remote_ids.size * sum(len(r.desc.layers) for r in ranks)
    if block_layers > MAX_PULL_BLOCK_LAYERS:
        raise SidecarError(
            "too_large",
            f"a pull of {remote_ids.size} blocks into {block_layers // max(remote_ids.size, 1)} "
            f"layers: at most {MAX_PULL_BLOCK_LAYERS} blocks x layers per pull (split it)",
        )
    if not math.isfinite(req.timeout_s):
        raise SidecarError(
            "invalid_message", f"timeout_s must be a finite number, not {req.timeout_s}"
        )
    timeout = req.timeout_s if req.timeout_s > 0 else ctx.config.peer_pull_timeout_s
    splits_r = np.cumsum([it.num_remote for it in req.items])[:-1]
    splits_l = np.cumsum([it.num_local for it in req.items])[:-1]
    items = [
        ItemIds(item, rids, lids)
        for item, rids, lids in zip(
            req.items,
            np.split(remote_ids.astype(np.int64), splits_r),
            np.split(local_ids.astype(np.int64), splits_l),
            strict=True,
        )
    ]
    ready = ready_of([r.buffers for r in ranks], req.events)
    return PeerPull(ctx, req, endpoint, local, ranks, items, timeout, may_read, ready)


def _local_ranks(
    engine: Engine, req: Pull, local_ids: IdArray
) -> tuple[PeerEngine, list[LocalRank]]:
    """Return this engine's description and the ranks that receive; check the local ids."""
    workers = sorted(
        (
            w
            for w in engine.workers.values()
            if req.tp_rank is None or (w.ref.tp_rank, w.ref.pp_rank) == (req.tp_rank, req.pp_rank)
        ),
        key=lambda w: (w.ref.pp_rank, w.ref.tp_rank),
    )
    if not workers:
        raise SidecarError(
            "unknown_worker", f"no worker tp{req.tp_rank}.pp{req.pp_rank} of {engine.engine_id}"
        )
    sets = [w.buffer_set(req.medium) for w in workers]
    num_blocks = sets[0].num_blocks
    check_range(local_ids, num_blocks, "local")
    check_unique(local_ids, "local", num_blocks)
    local = describe_engine(engine, medium=req.medium)
    by_rank = {(d.tp_rank, d.pp_rank): d for d in local.workers}
    ranks = [
        LocalRank(w, s, by_rank[(w.ref.tp_rank, w.ref.pp_rank)])
        for w, s in zip(workers, sets, strict=True)
    ]
    return local, ranks


@dataclass(frozen=True)
class _Source:
    """The producer side of a planned pull: where its reads go and on which data plane."""

    link: PeerLink
    engine: PeerEngine
    workers: dict[tuple[int, int], PeerWorker]
    agent: str
    """NIXL agent name of the producer ("" on the ZMQ plane)."""
    plane: DataPlane


class _Outcome(NamedTuple):
    """How one request of a pull ended."""

    ok: bool
    nbytes: int
    error: str


@dataclass(eq=False)
class PeerPull:
    """A checked pull (`check_pull`): `run` takes its steps (see the module doc)."""

    ctx: PullContext
    req: Pull
    endpoint: str
    """The remote daemon's endpoint, canonical ("": this daemon itself)."""
    local: PeerEngine
    """This engine as the handshake describes it (for the compatibility check)."""
    ranks: list[LocalRank]
    items: list[ItemIds]
    timeout: float
    may_read: Callable[[str], bool]
    """Whether the sender may read an engine of this daemon (`check_pull`)."""
    ready: tuple[int, bytes] | None = None  # the caller's event (GPU, handle): write after it
    started: float = 0.0
    deadline: float = 0.0
    """Loop time by which every step is done (set by `run`)."""

    @property
    def config(self) -> Config:
        """The daemon's settings."""
        return self.ctx.config

    @property
    def pref(self) -> str:
        """The data plane asked for: ``auto``, ``zmq`` or ``nixl``."""
        return self.req.plane or self.config.peer_data_plane

    async def run(self) -> Reply:
        """Take the pull's steps; the reply says which requests arrived and which failed."""
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self.deadline = self.started + self.timeout
        self.ctx.counts.pulls += 1
        if not self.endpoint:
            return await self._run(self.ctx.local_link)
        try:
            link = self.ctx.links.acquire(self.endpoint)
        except SidecarError:
            self._report_failed()
            raise
        try:
            return await self._run(link)
        finally:
            self.ctx.links.release(link)

    async def _run(self, link: PeerLink) -> Reply:
        welcome = await self._handshake(link)
        if isinstance(welcome, Pulled):
            return welcome
        if self.endpoint:
            self.ctx.links.adopt(link, (welcome.daemon_id, link.server_key))
        remote = self._remote_engine(welcome)
        plane_name = self._choose_plane(welcome)
        plans = await self._plan(remote)
        if plane_name == "nixl":
            failed = self._connect_nixl(welcome)
            if failed is not None:
                return failed
        source = _Source(
            link=link,
            engine=remote,
            workers={(w.tp_rank, w.pp_rank): w for w in remote.workers},
            agent=welcome.nixl_agent,
            plane=self.ctx.planes.by_name[plane_name],
        )
        if self.ready is not None and not await ready_passed(*self.ready, self.deadline):
            return self._fail("timeout", "the engine's stream did not reach the pull's event")
        outcomes = await asyncio.gather(
            *(
                self._transfer(source, item, item_plans, verdict.refused)
                for item, item_plans, verdict in zip(
                    self.items, plans, welcome.verdicts, strict=True
                )
            )
        )
        return await self._complete(link, outcomes, plane_name)

    async def _handshake(self, link: PeerLink) -> PeerWelcome | Pulled:
        """Greet the remote daemon; a failed handshake fails the pull (the reply says why)."""
        ctx = self.ctx
        local = not self.req.remote_endpoint
        if not local and self.pref in ("auto", "nixl") and self.config.peer_data_plane != "zmq":
            await ctx.planes.ensure_nixl()
        wants_nixl = not local and ctx.planes.nixl is not None and self.pref in ("auto", "nixl")
        loop = asyncio.get_running_loop()
        try:
            welcome = await link.request(
                PeerHello(
                    id=link.next_id(),
                    protocol_version=PEER_PROTOCOL_VERSION,
                    daemon_id=ctx.daemon_id,
                    want_nixl=wants_nixl,
                    claims=self._claims(),
                ),
                timeout=min(self.config.peer_handshake_timeout_s, self.deadline - loop.time()),
            )
        except PeerGone as exc:
            if not local:
                await ctx.links.drop(link)
            return self._fail("peer_unavailable", str(exc))
        except PeerRefused as exc:
            return self._fail("incompatible_peer", str(exc))
        if not isinstance(welcome, PeerWelcome):
            return self._fail("peer_unavailable", "unexpected handshake reply")
        if len(welcome.verdicts) != len(self.items):
            return self._fail("incompatible_peer", "the producer did not answer every claim")
        return welcome

    def _claims(self) -> list[Claim]:
        """Return what this pull will read, request by request, for the producer to allow."""
        return [
            Claim(
                engine_id=self.req.remote_engine_id,
                request_id=ids.item.remote_request_id or ids.item.request_id,
                block_ids=ids.remote_ids.tolist(),
                prompt_digest=ids.item.prompt_digest,
            )
            for ids in self.items
        ]

    def _remote_engine(self, welcome: PeerWelcome) -> PeerEngine:
        req = self.req
        if welcome.daemon_id == self.ctx.daemon_id and not self.may_read(req.remote_engine_id):
            # This daemon's own peer endpoint, however spelled: read with the sender's rights.
            self._report_failed()
            raise SidecarError(
                "forbidden",
                f"pull from this daemon's own engine {req.remote_engine_id!r}: no grant to read it",
            )
        remote = next((e for e in welcome.engines if e.engine_id == req.remote_engine_id), None)
        if remote is None:
            self._report_failed()
            raise SidecarError(
                "unknown_engine",
                f"remote daemon {req.remote_endpoint} has no engine {req.remote_engine_id!r}",
            )
        return remote

    def _choose_plane(self, welcome: PeerWelcome) -> str:
        if not self.req.remote_endpoint:
            return LOCAL_PLANE  # this daemon's own engines: copied in memory
        pref = self.pref
        offered = self.ctx.planes.nixl is not None and "nixl" in welcome.planes
        both_nixl = offered and bool(welcome.nixl_metadata)
        if pref == "nixl" and not both_nixl:
            self._report_failed()
            raise SidecarError(
                "incompatible_peer",
                f"peer_data_plane=nixl but the remote daemon offers {welcome.planes}",
            )
        return "nixl" if both_nixl and pref in ("auto", "nixl") else "zmq"

    def _connect_nixl(self, welcome: PeerWelcome) -> Pulled | None:
        """Load the producer's NIXL agent and register our buffers; a failure fails the pull."""
        nixl = self.ctx.planes.nixl
        assert nixl is not None
        try:
            nixl.load_remote(welcome.nixl_agent, welcome.nixl_metadata)
            nixl.sync(self.ctx.planes.registered_buffers())
        except Exception as exc:
            return self._fail("peer_unavailable", f"NIXL setup failed: {exc}")
        return None

    async def _plan(self, remote: PeerEngine) -> list[list[RankPlan]]:
        """Every request's plan, rank by rank; ``incompatible_peer`` if the engines disagree.

        A large pull is planned on a thread (`PLAN_ON_LOOP`); the plan is pure, the refusal is
        reported here, on the loop.
        """
        size = sum(ids.remote_ids.size for ids in self.items) * sum(
            len(r.desc.layers) for r in self.ranks
        )
        try:
            if size <= PLAN_ON_LOOP:
                return self._plans(remote)
            return await asyncio.to_thread(self._plans, remote)
        except (IncompatiblePeer, PlanError) as exc:
            self._report_failed()
            raise SidecarError("incompatible_peer", str(exc)) from None

    def _plans(self, remote: PeerEngine) -> list[list[RankPlan]]:
        max_frame = min(1 << 20, self.config.peer_chunk_bytes)
        check_compatible(self.local, remote)
        return [
            [
                plan_rank(self.local, r.desc, remote, rids, lids, max_frame=max_frame)
                for r in self.ranks
            ]
            for _, rids, lids in self.items
        ]

    async def _transfer(
        self, source: _Source, ids: ItemIds, plans: list[RankPlan], refused: str
    ) -> _Outcome:
        """Read one request on every local rank, fix its layouts, then notify its producers.

        ``refused``: why the producer does not allow this read (its handshake verdict); such a
        request fails without a byte read.
        """
        if refused:
            return _Outcome(False, 0, f"refused by the producer: {refused}")
        request_id = ids.item.remote_request_id or ids.item.request_id
        reads = self._reads(source, request_id, plans)
        loop = asyncio.get_running_loop()
        try:
            # Every read is waited for, also once one has failed: the failure is reported only
            # when no read of this request writes any more (each ends by the deadline).
            done = await asyncio.gather(*reads, return_exceptions=True)
            failure = next((r for r in done if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure
            nbytes = sum(r for r in done if isinstance(r, int))
            await _fix_layouts(
                self.ctx.executor, self.ranks, plans, ids.local_ids, self.deadline - loop.time()
            )
        except (PeerGone, PeerRefused, TimeoutError, asyncio.TimeoutError) as exc:
            return _Outcome(False, 0, str(exc) or type(exc).__name__)
        except HandleError as exc:  # a worker of the pull was released meanwhile
            return _Outcome(False, 0, f"a worker's buffers went away during the pull: {exc}")
        await self._notify(source, request_id, plans)
        return _Outcome(True, nbytes, "")

    def _reads(
        self, source: _Source, request_id: str, plans: list[RankPlan]
    ) -> list[Coroutine[Any, Any, int]]:
        reads = []
        for rank, plan in zip(self.ranks, plans, strict=True):
            layers = [rank.buffers.layers[n] for n in rank.desc.layers]
            for rp in plan.reads:
                target = ReadTarget(
                    link=source.link,
                    engine_id=source.engine.engine_id,
                    request_id=request_id,
                    remote=source.workers[(rp.remote_tp_rank, rp.remote_pp_rank)],
                    remote_agent=source.agent,
                    local_layers=layers,
                )
                reads.append(source.plane.read(target, rp, self.deadline))
        return reads

    async def _notify(self, source: _Source, request_id: str, plans: list[RankPlan]) -> None:
        """Tell each producer rank that this rank read it (best effort: the lease is the net)."""
        link = source.link
        for rank, plan in zip(self.ranks, plans, strict=True):
            reader = f"{self.ctx.daemon_id}/{rank.worker.ref.label()}"
            for tp, pp in plan.notify:
                msg = Notify(
                    id=link.next_id(),
                    engine_id=source.engine.engine_id,
                    request_id=request_id,
                    tp_rank=tp,
                    pp_rank=pp,
                    reader=reader,
                    expected_readers=plan.expected_readers,
                )
                try:
                    await link.send(msg)
                except (PeerGone, zmq.ZMQError):
                    log.warning("notification for %s not sent", request_id)

    async def _complete(self, link: PeerLink, outcomes: list[_Outcome], plane: str) -> Pulled:
        """Report every request as finished or failed, and build the reply."""
        items = self.items
        finished = [items[i].item.request_id for i, r in enumerate(outcomes) if r.ok]
        failed = [items[i].item.request_id for i, r in enumerate(outcomes) if not r.ok]
        invalid = sorted(
            int(b) for i, r in enumerate(outcomes) if not r.ok for b in items[i].local_ids.tolist()
        )
        nbytes = sum(r.nbytes for r in outcomes)
        self.ctx.counts.nbytes += nbytes
        errors = [r.error for r in outcomes if not r.ok]
        if failed:
            self.ctx.counts.failed += 1
            if self.endpoint and not link.connected:
                await self.ctx.links.drop(link)
        self._report(finished, failed, invalid)
        return self._reply(
            finished,
            failed,
            invalid,
            nbytes=nbytes,
            plane=plane,
            code="peer_unavailable" if failed else "",
            error=errors[0] if errors else "",
        )

    def _report_failed(self) -> tuple[list[str], list[int]]:
        """Count the pull failed and report every request failed, with all its local blocks."""
        self.ctx.counts.failed += 1
        every = [ids.item.request_id for ids in self.items]
        invalid = sorted({int(i) for ids in self.items for i in ids.local_ids})
        self._report([], every, invalid)
        return every, invalid

    def _fail(self, code: str, message: str) -> Pulled:
        """Fail every request of the pull before any read; the reply says why."""
        every, invalid = self._report_failed()
        return self._reply([], every, invalid, nbytes=0, plane="", code=code, error=message)

    def _report(self, finished: list[str], failed: list[str], invalid: list[int]) -> None:
        self.ctx.emit(
            PeerCompletion(
                engine_id=self.req.engine_id,
                worker=None if self.req.tp_rank is None else self.ranks[0].worker.ref,
                finished_recving=frozenset(finished),
                failed_recving=frozenset(failed),
                invalid_block_ids=frozenset(invalid),
            )
        )

    def _reply(
        self,
        finished: list[str],
        failed: list[str],
        invalid: list[int],
        *,
        nbytes: int,
        plane: str,
        code: str,
        error: str,
    ) -> Pulled:
        return Pulled(
            id=self.req.id,
            finished=finished,
            failed=failed,
            invalid_block_ids=invalid,
            nbytes=nbytes,
            seconds=asyncio.get_running_loop().time() - self.started,
            plane=plane,
            error_code=code,
            error=error,
        )


async def _fix_layouts(
    executor: CopyExecutor,
    ranks: list[LocalRank],
    plans: list[RankPlan],
    lids: IdArray,
    timeout: float,
) -> None:
    """Turn received blocks into each rank's own layout on the copy executor, by ``timeout``."""
    jobs = []
    index = torch.from_numpy(np.ascontiguousarray(lids, dtype=np.int64))
    for rank, plan in zip(ranks, plans, strict=True):
        if not plan.fixes or not lids.size:
            continue
        targets = [(rank.buffers.layers[name], order) for name, order in plan.fixes]
        ratio = plan.block_size_ratio

        def run(targets: list[Any] = targets, ratio: int = ratio) -> int:
            fix_layers(targets, index, ratio)
            return 0

        jobs.append(executor.submit(run, reads={}, writes={rank.buffers.key: lids}))
    if not jobs:
        return
    _, late = await asyncio.wait(jobs, timeout=max(timeout, 0.001))
    if late:
        # A fix rewrites the destination in place: the pull fails only once none of them runs
        # (or is still to run), so nothing writes the blocks after they were reported invalid.
        await asyncio.wait(late)
        raise TimeoutError("the layout fixes did not finish before the pull's deadline")
    for job in jobs:
        job.result()  # a fix that raised fails the pull
