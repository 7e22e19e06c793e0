"""The connector's scheduler half (vLLM's engine-core process): what to load, store, pull, send.

It sees requests as vLLM's scheduler admits, schedules and finishes them, asks the daemon which
blocks it holds, and writes each step's `kvsidecar.integrations.vllm.plan.StepPlan` for the
workers. vLLM's contract (docs/vllm.md has the whole story):

- **Prefix cache** (role ``kv_both``): `SchedulerSide.lookup` counts the leading blocks beyond
  the engine's own prefix-cache hit that every rank holds in the daemon. By default the load is
  *asynchronous* (``async_loads``): vLLM parks the request until its workers report it received
  and computes other requests meanwhile; the hit may cover every full block of the prompt (vLLM
  recomputes the last token). A *sync* load stops one token short of the prompt (the scheduler
  must compute at least one token) and the forward waits for it.
  The lookup pins its hits for the load that `SchedulerSide.after_alloc` plans. Every full block a
  step computes is stored after that step (`StepPlan.stores`; a decode step's may be batched,
  `kvsidecar.integrations.vllm.stores`); blocks the engine already had are not stored again.
- **Nothing computed over a failed load is stored**: the workers report each load's outcome per
  rank (`SchedulerSide.confirm`); a request whose load failed on any rank stores nothing more,
  and with TP > 1 its stores wait until every rank has confirmed its load.
- **Disaggregated prefill**, only where it is turned on (``disaggregated``: the roles
  ``kv_producer`` and ``kv_consumer``, or the setting): a prefill engine's finished request with
  ``do_remote_decode`` is published with a lease and the digest of its prompt, and answered with
  ``kv_transfer_params`` naming its blocks, its engine and its daemon; vLLM holds the blocks until
  the workers report ``finished_sending``. A decode engine given those params, once checked
  (`kvsidecar.integrations.vllm.params`; else ignored, with a warning and a count), loads the
  whole prompt *asynchronously*: its workers pull the blocks through their daemon, which reads
  them only if they were published for a prompt with the same digest.

No hook waits on the daemon (`kvsidecar.integrations.vllm.background`): lookups are answered
from replies that came in the background, publishes are sent without waiting. The daemon may be
absent or die at any time: a lookup that fails is a miss (and the daemon is left alone for
``retry_s``), a publish that cannot be sent or is refused frees the blocks (the consumer then
computes the prompt itself). When a hook fails on a bug, `fail_alloc`, `fail_build` and
`fail_finished` give vLLM the closed answer: planned loads become load errors, planned pulls
failed transfers, published blocks stay held until their lease ends.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvsidecar.integrations.vllm.background import Lookups, Publishes
from kvsidecar.integrations.vllm.connection import DaemonConnection
from kvsidecar.integrations.vllm.params import (
    Ignored,
    IgnoredReason,
    RemotePrefill,
    parse_remote_prefill,
    prompt_digest,
    request_prompt,
)
from kvsidecar.integrations.vllm.plan import (
    LoadSpec,
    PullSpec,
    RequestView,
    Scheduled,
    StepPlan,
    StoreSpec,
)
from kvsidecar.integrations.vllm.settings import ConnectorSettings

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")

TWO_REGIONS = frozenset({"kv_first", "blocks_first"})
"""Layouts whose blocks hold K's region, then V's: a pull from one into another is served."""


@dataclasses.dataclass
class _Tracked:
    """A request whose computed blocks are stored as they fill."""

    request: RequestView
    block_ids: list[int]
    stored: int
    """Blocks the daemon has (or that were never this engine's to store)."""
    stores_planned: bool = False
    """Whether a plan stored any of its blocks (which a worker may still be copying)."""


@dataclasses.dataclass
class _Pending:
    """What `SchedulerSide.lookup` found for a request, for `SchedulerSide.after_alloc`."""

    local: int
    """Blocks of the engine's own prefix-cache hit."""
    hits: int = 0
    """Blocks beyond them the daemon holds."""
    pull: RemotePrefill | None = None
    """The checked hand-over of a decode request."""


class SchedulerSide:
    """See the module doc. ``engine_id`` names the engine its workers register."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        role: str,
        engine_id: str,
        fingerprint: str,
        block_size: int,
        tp_size: int,
        prefix_cache: bool,
        disaggregated: bool = False,
        replicated: bool = False,
        num_blocks: int = 0,
    ) -> None:
        self.settings = settings
        self.role = role
        self.engine_id = engine_id
        self.base_fingerprint = fingerprint
        self.fingerprint = fingerprint
        """The namespace's name now: ``base_fingerprint`` and, after `reset`, a generation."""
        self.block_size = block_size
        self.tp_size = tp_size
        self.prefix_cache = prefix_cache
        self.disaggregated = disaggregated
        self.layout = ""
        """The workers' cache layout (their handshake metadata): sent to decode engines."""
        self.conn = DaemonConnection(
            settings, "scheduler", heartbeat=False, timeout_s=settings.lookup_timeout_s
        )
        # MLA: every rank holds the same latent, which the daemon keeps once (rank 0's namespace).
        self.lookups = Lookups(self.conn, settings, tp_size, replicated=replicated)
        self.counters: collections.Counter[str] = collections.Counter()
        """Running totals: ``ignored:<reason>`` for every request whose params were ignored."""
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[str, _Pending] = {}
        self._awaiting: dict[str, set[int]] = {}
        """Request -> ranks that have not confirmed its load yet (stores wait for them, TP > 1)."""
        self._next = StepPlan(step=0, fingerprint=fingerprint)
        self._building: StepPlan | None = None
        """The plan `build` is writing (for `fail_build`, should it raise)."""
        self._warned: set[IgnoredReason] = set()
        self._ignored: set[str] = set()
        """Requests counted as ignored and not finished yet."""
        self.publishes = Publishes(self.conn, settings, engine_id)
        self.max_held_blocks = settings.max_held_blocks or num_blocks // 2
        """Blocks this engine may hold for hand-overs nobody has read yet (0: no bound known)."""
        self._handed: dict[str, int] = {}
        """Requests handed over and not finished sending: the blocks each holds."""
        self.held_blocks = 0
        """Their blocks, all together."""

    def start(self) -> None:
        """Begin connecting to the daemon (in the background when it does not answer at once)."""
        self.conn.start()

    def close(self) -> None:
        """Drop the daemon connection."""
        self.conn.close()

    def reset(self) -> None:
        """Answer ``reset_cache``: blocks stored from now on go to a namespace of their own.

        After a weight update the blocks of the old namespace would be wrong for this engine,
        and its new blocks wrong for engines that kept the old weights: a generation that no
        other engine has is added to the fingerprint, and nothing computed before is stored.
        """
        self.fingerprint = f"{self.base_fingerprint}~{uuid.uuid4().hex[:12]}"
        self._next.fingerprint = self.fingerprint
        self._tracked.clear()
        self._pending.clear()
        self._awaiting.clear()
        self.lookups.clear()
        log.info("kvsidecar: cache reset: namespace %s from now on", self.fingerprint)

    def may_load_async(self, request: RequestView) -> bool:
        """Whether `lookup` may answer an asynchronous load for this request (cheap)."""
        params = request.kv_transfer_params
        if not (self.disaggregated and params and self.role != "kv_producer"):
            return False
        return params.get("do_remote_prefill") is True

    def lookup(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Answer ``get_num_new_matched_tokens``: tokens to load (None: later), and if async."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            try:
                return self._remote_prefill(request, num_computed_tokens, params)
            except Ignored as why:
                self.ignore(request.request_id, why)
        if not self.prefix_cache:
            return 0, False
        bs = self.block_size
        local = num_computed_tokens // bs
        # What the engine had itself is never stored again, hit or not.
        self._pending[request.request_id] = _Pending(local)
        # A sync load must leave the last prompt token to compute (vLLM asserts it); after an
        # async one vLLM recomputes that token itself, so it may cover every full block.
        asynchronous = self.settings.async_loads
        end = request.num_tokens if asynchronous else request.num_tokens - 1
        keys = list(request.block_hashes[local : end // bs])
        hits = self.lookups.answer(request.request_id, self.fingerprint, keys) if keys else 0
        if hits is None:
            return None, False  # asked in the background: vLLM asks again
        self._pending[request.request_id] = _Pending(local, hits=hits)
        return hits * bs, asynchronous and hits > 0

    def ignore(self, request_id: str, why: Ignored) -> None:
        """Count a request whose params are ignored; warn (once per reason at warning level).

        vLLM asks again for a request it could not admit yet: each request counts once.
        """
        if request_id in self._ignored:
            return
        self._ignored.add(request_id)
        self.counters[f"ignored:{why.reason}"] += 1
        level = logging.INFO if why.reason in self._warned else logging.WARNING
        self._warned.add(why.reason)
        log.log(
            level,
            "kvsidecar: %s: kv_transfer_params ignored, the prompt is computed here (%s)",
            request_id,
            why,
        )

    def _remote_prefill(
        self, request: Any, num_computed_tokens: int, params: dict[str, Any]
    ) -> tuple[int, bool]:
        if not self.disaggregated or self.role == "kv_producer":
            raise Ignored("disabled", "this engine does not pull prefills (disaggregated)")
        pull = parse_remote_prefill(params, num_prompt_tokens=int(request.num_prompt_tokens))
        request_prompt(request)  # refuses what a digest cannot name, before vLLM waits on it
        problem = self._pull_problem(pull.block_size, pull.layout)
        if problem is not None:
            raise Ignored("inconsistent", problem)
        client = self.conn.get()
        if client is None or client.daemon is None:
            return 0, False  # no daemon to pull through: computed here, not the params' fault
        if pull.daemon_id != client.daemon.daemon_id and (
            not pull.endpoint or pull.endpoint not in self.settings.peers
        ):
            raise Ignored(
                "endpoint", f"{pull.endpoint[:80]!r} is neither this daemon nor one of peers"
            )
        external = pull.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        self._pending[request.request_id] = _Pending(
            num_computed_tokens // self.block_size, pull=pull
        )
        return external, True

    def _pull_problem(self, remote_bs: int, remote_layout: str) -> str | None:
        if remote_bs < 1 or self.block_size % remote_bs:
            return f"block size {self.block_size} is not a multiple of the producer's {remote_bs}"
        if remote_bs != self.block_size and "opaque" in (remote_layout, self.layout):
            return "block sizes differ and a cache layout is one the daemon cannot re-block"
        layouts = {remote_layout, self.layout}
        if "" not in layouts and len(layouts) > 1 and not layouts <= TWO_REGIONS:
            # vLLM's CPU kernels pack a block each their own way (the ISA follows the CPU, the
            # dtype, the block size); cells hold K and V together: the daemon would refuse it.
            return f"the producer's cache is {remote_layout!r}, this engine's {self.layout!r}"
        return None

    def after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Answer ``update_state_after_alloc``: queue the loads or the pull, start tracking."""
        rid = request.request_id
        self._ignored.discard(rid)
        if num_external_tokens == 0:
            self.lookups.forget(rid)  # admitted without a load: its pin ends with pin_s
        # Taken only once the load or pull is queued: `fail_alloc` needs it if this raises.
        pending = self._pending.get(rid)
        blocks = list(block_ids)
        if num_external_tokens > 0 and pending is not None and pending.pull is not None:
            self._queue_pull(request, blocks, pending.local, pending.pull)
            self._pending.pop(rid, None)
            return
        if rid in self._tracked and num_external_tokens == 0:
            self._pending.pop(rid, None)
            return  # called again after an async load: nothing new
        local = pending.local if pending is not None else 0
        loaded = num_external_tokens // self.block_size
        if loaded:
            self._queue_load(request, blocks, local, loaded)
        self._pending.pop(rid, None)
        if self.prefix_cache:
            self._tracked[rid] = _Tracked(request, blocks, stored=local + loaded)

    def _queue_load(self, request: RequestView, blocks: list[int], local: int, count: int) -> None:
        keys = list(request.block_hashes[local : local + count])
        pin_id, disk_hits = self.lookups.take(request.request_id)  # pinned by the lookup
        self.counters["disk_hits"] += min(disk_hits, count)
        self._awaiting[request.request_id] = set(range(self.tp_size))
        self._next.loads.append(
            LoadSpec(
                request.request_id,
                keys,
                blocks[local : local + count],
                pin_id,
                asynchronous=self.settings.async_loads,
            )
        )

    def _queue_pull(self, request: Any, blocks: list[int], local: int, pull: RemotePrefill) -> None:
        ratio = self.block_size // pull.block_size
        n_local = -(-pull.num_tokens // self.block_size)
        tokens, lora_name, salt = request_prompt(request)
        self._next.pulls.append(  # last: a pull is queued whole or not at all (`fail_alloc`)
            PullSpec(
                request_id=request.request_id,
                remote_engine_id=pull.engine_id,
                remote_request_id=pull.request_id,
                remote_endpoint=pull.endpoint,
                remote_daemon_id=pull.daemon_id,
                remote_ids=list(pull.block_ids[local * ratio :]),
                local_ids=blocks[local:n_local],
                prompt_digest=prompt_digest(tokens, lora_name=lora_name, cache_salt=salt),
            )
        )
        # Loaded once, as vLLM's NIXL connector does: a recomputed request does not pull again.
        if request.kv_transfer_params is not None:
            request.kv_transfer_params["do_remote_prefill"] = False

    def pulls(self, request_id: str) -> bool:
        """Whether the next plan pulls this request (its tokens come from a peer engine)."""
        return any(p.request_id == request_id for p in self._next.pulls)

    def fail_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """`after_alloc` raised: report the tokens vLLM counted as loaded as failed, store none.

        vLLM has counted ``num_external_tokens`` as computed: the workers report their blocks as
        load errors (a sync load, recomputed) or the request as received with every block
        invalid (an asynchronous one, which vLLM would otherwise wait for forever).
        """
        rid = request.request_id
        pending = self._pending.pop(rid, None)
        self._tracked.pop(rid, None)
        if num_external_tokens <= 0:
            return
        local = pending.local if pending is not None else 0
        count = -(-num_external_tokens // self.block_size)
        blocks = list(block_ids)[local : local + count]
        if pending is not None and pending.pull is not None:
            self._next.failed_pulls.append(PullSpec(rid, "", "", "", "", [], blocks))
        else:
            # vLLM waits for an async one (the lookup said so): it must be reported received.
            failed = LoadSpec(rid, [], blocks, asynchronous=self.settings.async_loads)
            self._next.failed_loads.append(failed)

    def build(
        self, scheduled: Sequence[Scheduled], preempted: Sequence[str], finished: Sequence[str] = ()
    ) -> StepPlan:
        """Answer ``build_connector_meta``: this step's plan (stores of the blocks it fills).

        ``preempted`` and ``finished`` (vLLM's ``preempted_req_ids`` and ``finished_req_ids``)
        lost their blocks since the last step: the workers' fence waits for their stores.
        """
        plan, self._next = (
            self._next,
            StepPlan(step=self._next.step + 1, fingerprint=self.fingerprint),
        )
        self._building = plan
        plan.idle = not any(s.num_scheduled_tokens for s in scheduled)
        plan.unsent = self.publishes.refused()
        self.sent(plan.unsent)  # freed by the workers: nobody can read them
        held = set(plan.held)  # their blocks are freed once their stores ended: no fence
        plan.freed = [*preempted, *(rid for rid in finished if rid not in held)]
        for rid in preempted:  # their blocks are gone; re-admission starts over
            self._tracked.pop(rid, None)
            self._awaiting.pop(rid, None)
        bs = self.block_size
        for s in scheduled:
            tracked = self._tracked.get(s.request_id)
            if tracked is None:
                continue
            if s.new_block_ids is not None:
                if s.resumed:
                    tracked.block_ids = list(s.new_block_ids)
                else:
                    tracked.block_ids.extend(s.new_block_ids)
            if self.tp_size > 1 and s.request_id in self._awaiting:
                continue  # stored once every rank has confirmed its load
            hashes = tracked.request.block_hashes
            done = s.num_computed_tokens + s.num_scheduled_tokens
            full = min(done // bs, len(hashes), len(tracked.block_ids))
            if full > tracked.stored:
                keys = list(hashes[tracked.stored : full])
                ids = tracked.block_ids[tracked.stored : full]
                decode = s.num_scheduled_tokens < bs  # fills a block now and then: batched
                plan.stores.append(StoreSpec(keys, ids, s.request_id, batched=decode))
                tracked.stores_planned = True
                tracked.stored = full
        self._building = None
        return plan

    def fail_build(self, preempted: Sequence[str], finished: Sequence[str]) -> StepPlan:
        """`build` raised: a plan whose loads and pulls fail, and which stores nothing.

        Sends stay (their blocks are held until the workers report them); requests whose stores
        this plan would have carried are not tracked any more (so nothing believed stored is not).
        """
        plan = self._building or self._next
        if plan is self._next:
            self._next = StepPlan(step=plan.step + 1, fingerprint=self.fingerprint)
        self._building = None
        for spec in plan.stores:
            self._tracked.pop(spec.request_id, None)
        return StepPlan(
            step=plan.step,
            fingerprint=plan.fingerprint,
            sends=plan.sends,
            freed=[*preempted, *finished],
            failed_loads=[*plan.failed_loads, *plan.loads],
            failed_pulls=[*plan.failed_pulls, *plan.pulls],
        )

    def sent(self, request_ids: Iterable[str]) -> None:
        """Learn that these requests finished sending (vLLM's ``finished_sending``).

        Read or not (a lease that ended, a publish refused): what they held no longer counts
        against `max_held_blocks`.
        """
        for rid in request_ids:
            self.held_blocks -= self._handed.pop(rid, 0)

    def confirm(self, outcomes: Iterable[tuple[int, str, bool]]) -> None:
        """Learn how loads ended, rank by rank (the workers' metadata): ``(rank, request, ok)``.

        A request whose load failed on any rank stores nothing more: what it computes after the
        failed block depends on a block nobody wrote.
        """
        for rank, rid, ok in outcomes:
            if not ok:
                self._awaiting.pop(rid, None)
                if self._tracked.pop(rid, None) is not None:
                    log.info("kvsidecar: %s: a load failed, none of its blocks is stored", rid)
                continue
            ranks = self._awaiting.get(rid)
            if ranks is not None:
                ranks.discard(rank)
                if not ranks:
                    del self._awaiting[rid]

    def request_finished(
        self,
        request: RequestView,
        block_ids: Sequence[int],
        *,
        num_computed_tokens: int,
        capped: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Answer ``request_finished``: publish a prefill, hold the blocks, or let go.

        Held: blocks that stores may still be copying; the workers report the request finished
        sending once their stores of it ended, so no forward waits for them.
        """
        rid = request.request_id
        tracked = self._tracked.pop(rid, None)
        self._pending.pop(rid, None)
        self._awaiting.pop(rid, None)
        self._ignored.discard(rid)
        self.lookups.forget(rid)
        transfer = self._publish(request, block_ids, num_computed_tokens, capped)
        if transfer is not None:
            self._next.sends.append(rid)
            return True, transfer
        if tracked is not None and tracked.stores_planned:
            self._next.held.append(rid)
            return True, None
        return False, None

    def _publish(
        self, request: RequestView, block_ids: Sequence[int], num_computed_tokens: int, capped: bool
    ) -> dict[str, Any] | None:
        """Publish a finished prefill asked for (``do_remote_decode``); its params, or None."""
        rid = request.request_id
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return None
        try:
            if not self.disaggregated or self.role == "kv_consumer":
                raise Ignored("disabled", "this engine does not publish prefills (disaggregated)")
            if params.get("do_remote_decode") is not True:
                raise Ignored("malformed", "do_remote_decode must be true")
            tokens, lora_name, salt = request_prompt(request, num_computed_tokens)
        except Ignored as why:
            self.ignore(rid, why)
            self._ignored.discard(rid)
            return None
        if not capped:
            return None
        client = self.conn.get()
        if client is None or client.daemon is None:
            return None
        blocks = [int(b) for b in block_ids[: -(-num_computed_tokens // self.block_size)]]
        bound = self.max_held_blocks
        if bound and self.held_blocks + len(blocks) > bound:
            # Whoever asks for hand-overs and never reads them must not take the engine's
            # blocks from everyone else's requests for whole leases.
            self.ignore(
                rid,
                Ignored(
                    "held",
                    f"this engine holds {self.held_blocks} blocks for hand-overs nobody has read "
                    f"yet; {len(blocks)} more would pass max_held_blocks {bound}: freed, not "
                    "handed over",
                ),
            )
            self._ignored.discard(rid)
            return None
        digest = prompt_digest(tokens, lora_name=lora_name, cache_salt=salt)
        transfer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_block_ids": blocks,
            "remote_num_tokens": num_computed_tokens,
            "remote_block_size": self.block_size,
            "remote_layout": self.layout,
            "remote_endpoint": client.daemon.peer_endpoint,
            "remote_daemon_id": client.daemon.daemon_id,
        }
        if not self.publishes.send(client, rid, blocks, digest):
            return None
        self._handed[rid] = len(blocks)
        self.held_blocks += len(blocks)
        return transfer

    def fail_finished(self, request: RequestView) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` raised: hold the blocks if they were published or held."""
        rid = request.request_id
        return rid in self._next.sends or rid in self._next.held, None
