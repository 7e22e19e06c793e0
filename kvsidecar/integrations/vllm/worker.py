"""The connector's worker half (each vLLM worker process): the engine's cache and its copies.

The worker registers vLLM's KV cache with the daemon once (CPU: its storage moved into shared
memory in place; GPU: by CUDA IPC), then each step carries out the scheduler's
`kvsidecar.integrations.vllm.plan.StepPlan` without ever blocking a forward pass on the daemon
longer than the copies it needs:

- **before the forward** (vLLM's ``handle_preemptions``), the *fence*: a full block never
  changes while its request holds it, but once vLLM frees it the next forward may write it; so
  the stores of requests vLLM freed since the last step (preempted ones: a finished request with
  stores is held instead, `StepPlan.held`, and reported finished sending once they ended) must
  have copied their blocks first. Other stores go on while the engine computes. A store not done
  by its ``not_after`` is abandoned: the daemon throws a later copy away, so a block that changed
  under it is never published. Loads that timed out are fenced the same way: a freed block must
  not be written by a late copy into it;
- **loads** (``start_load_kv``): the prefix cache's blocks, submitted and left running when
  vLLM waits for them (async loads, the default) or waited for (sync: this step's forward reads
  them), `kvsidecar.integrations.vllm.loads`; pulls of a disaggregated prefill, submitted and
  left running;
- **stores** (``wait_for_save``): this step's full blocks, sent without waiting (a decode
  step's batched with later ones), `kvsidecar.integrations.vllm.stores`; except for requests
  whose load failed on this rank (their later blocks were computed over blocks nobody wrote:
  never stored until vLLM frees them);
- **completions** (``get_finished``): async loads and pulls that ended, published requests
  that their consumer read (the daemon's events for this worker, ``take_worker_events``, asked
  at one call and read at a later one: never waited for), and held requests whose stores ended.
  An event that names a request this worker has not been told of yet (its plan comes a step
  later under async scheduling) is kept until it is, for a while.

Nothing here raises into vLLM: a daemon that is away or fails turns every load into a load error
(vLLM recomputes those blocks), every store into nothing, every pull into a received request
with invalid blocks, and every send into a finished one. Each load's outcome also goes to the
scheduler (`take_outcomes`), which stops storing a request whose load failed on any rank.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Mapping

import torch

from kvsidecar.client import Pending, SidecarClient, SidecarError
from kvsidecar.integrations.vllm.connection import DaemonConnection
from kvsidecar.integrations.vllm.layout import CacheLayout, share_storages
from kvsidecar.integrations.vllm.loads import WorkerLoads
from kvsidecar.integrations.vllm.plan import PullSpec, StepPlan
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.integrations.vllm.stores import WorkerStores
from kvsidecar.wire.pulls import Pulled
from kvsidecar.wire.reports import PeerCompletion

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")

IDLE_WAIT_S = 0.005
"""In a step that computes nothing, how long to wait for a pull before handing back to vLLM
(without it, an engine waiting for a transfer spins through empty steps)."""
EARLY_EVENTS = 4096
"""Completion events for requests not known yet, kept at most (the oldest go first)."""
EARLY_EVENT_S = 600.0
"""How long such an event waits for its request; past it, it is dropped and counted."""


class WorkerSide:
    """See the module doc. One per vLLM worker process."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        model_hash: str,
        fingerprint: str = "",
    ) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model_hash = model_hash
        self.fingerprint = fingerprint
        """The namespace the scheduler starts with (for the log; each plan names its own)."""
        self.layout: CacheLayout | None = None
        self.conn: DaemonConnection | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._reconnects = -1
        self._pulls: list[tuple[list[PullSpec], Pending[Pulled] | None]] = []
        self._sending: set[str] = set()
        self._released: set[str] = set()
        """Sends given up on (the daemon went away): reported finished at the next call."""
        self._early: collections.OrderedDict[str, float] = collections.OrderedDict()
        """``finished_sending`` for requests not in ``_sending`` yet, and when each came."""
        self._errors: set[int] = set()
        """Blocks of pulls that were not written (load errors)."""
        self._failed: set[str] = set()
        """Pulls that failed, reported with their ``finished_recving``."""
        self._holding: set[str] = set()
        """Finished requests vLLM holds for their stores (`StepPlan.held`)."""
        self._events: Pending[list[PeerCompletion]] | None = None
        """The completion events asked for and not read yet (`_take_events`)."""
        self._announced = False
        self.counters: collections.Counter[str] = collections.Counter()
        """Running totals of blocks (``loaded_blocks``, ``load_errors``, ``stored_blocks``,
        ``not_stored``), ``pulled`` requests and ``events_dropped`` (also in the shutdown log)."""
        self.loads = WorkerLoads(settings, tp_rank, self.counters)
        self.stores = WorkerStores(settings, self.counters, self._client)

    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: CacheLayout) -> None:
        """Share the engine's cache and connect (in the background if the daemon is away).

        Raises `SharedMemoryTooSmall` when the cache does not fit in ``/dev/shm``.
        """
        self._kv_caches = dict(kv_caches)
        self.layout = layout
        share_storages(self._kv_caches)
        self.conn = DaemonConnection(
            self.settings,
            f"worker{self.tp_rank}",
            heartbeat=True,
            timeout_s=self.settings.timeout_s,
            on_connect=self._register_with,
        )
        self.conn.start()

    def _register_with(self, client: SidecarClient) -> None:
        layout = self.layout
        assert layout is not None
        client.register_kv_caches(
            self._kv_caches,
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            model_hash=self.model_hash,
            arrangement=layout.arrangement,
            memory_order=layout.memory_order,
            shape_order=layout.shape_order,
        )
        client.take_worker_events()  # subscribes this worker to its completion events
        self._reconnects = client.reconnects
        if not self._announced:
            self._announced = True
            daemon = client.daemon
            log.info(
                "kvsidecar worker %d: cache on: daemon %s (%s), namespace %s, engine %s, %d "
                "layers registered as %s",
                self.tp_rank,
                self.settings.daemon_endpoint,
                "" if daemon is None else daemon.daemon_id,
                self.fingerprint,
                self.engine_id,
                len(self._kv_caches),
                layout.name,
            )

    def _client(self) -> SidecarClient | None:
        """Return the client if the daemon is reachable (re-subscribing after a restart)."""
        client = None if self.conn is None else self.conn.get()
        if client is None or not client.available:
            return None
        if client.reconnects != self._reconnects:
            # A restarted daemon knows nothing of what we published before: those requests
            # are finished sending (their consumers, if any, recompute).
            self._release_sends()
            try:
                client.take_worker_events()
            except SidecarError:
                return None
            self._reconnects = client.reconnects
        return client

    def close(self) -> None:
        """Leave the daemon (it releases our registration) and log the totals."""
        if self.conn is not None:
            self.conn.close()
        log.info("kvsidecar worker %d: %s", self.tp_rank, dict(self.counters))

    def fence(self, freed: Collection[str]) -> None:
        """Before a forward: finish the stores and late loads of the ``freed`` requests."""
        gone = set(freed)
        if gone:
            self.loads.fence(gone)
        self.stores.fence(gone)

    def start_loads(self, plan: StepPlan) -> None:
        """Submit the pulls and the loads; wait for the sync loads.

        Should it raise, `fail_loads` reports what it did not settle.
        """
        self.loads.fail(plan.failed_loads)
        if plan.failed_pulls:
            self._pulls.append((list(plan.failed_pulls), None))
        if not plan.loads and not plan.pulls:
            return  # most steps: nothing to ask the daemon
        client = self._client()
        self._submit_pulls(client, plan.pulls)
        self.loads.start(client, plan.fingerprint, plan.loads)

    def fail_loads(self, plan: StepPlan) -> None:
        """Answer closed for a `start_loads` that raised: nothing reported twice.

        Every load of the plan not settled yet is a load error (an async one also received),
        every pull not submitted a failed one.
        """
        submitted = {s.request_id for group, _ in self._pulls for s in group}
        missing = [s for s in (*plan.pulls, *plan.failed_pulls) if s.request_id not in submitted]
        if missing:
            self._pulls.append((missing, None))
        self.loads.fail([*plan.loads, *plan.failed_loads])

    def store(self, plan: StepPlan) -> None:
        """After the forward: send (or batch) this step's stores; note the requests to send."""
        if plan.sends:
            self._sending.update(plan.sends)
            if self._early:
                self._match_early()
        self._holding.update(plan.held)  # reported finished sending once their stores end
        if plan.unsent:  # refused by the daemon: nobody reads them
            self._sending.difference_update(plan.unsent)
            self._released.update(plan.unsent)
        # Batched blocks wait for no step that computes nothing, nor for a held request.
        now = plan.idle or bool(plan.held)
        if self.tp_rank and self.layout is not None and self.layout.arrangement == "mla":
            return  # every rank holds the same latent: rank 0 stores it for all (one namespace)
        tainted = self.loads.tainted
        specs = plan.stores
        if tainted and specs:
            specs = [s for s in specs if s.request_id not in tainted]
            self.counters["not_stored"] += sum(
                len(s.block_ids) for s in plan.stores if s.request_id in tainted
            )
        if specs or now or self.stores.batched:
            self.stores.add(plan.step, plan.fingerprint, specs, now=now)

    def finished(self, *, idle: bool) -> tuple[set[str], set[str], set[str]]:
        """Return the requests that finished sending, receiving, and failed receiving.

        Since the last call; the failed ones are among the received ones.
        """
        recving = self._finished_pulls(idle)
        if self.loads.running:
            recving |= self.loads.finished(idle=idle and not recving, wait_s=IDLE_WAIT_S)
        failed, self._failed = self._failed & recving, self._failed - recving
        return self._finished_sends() | self._stored_held(), recving, failed

    def _stored_held(self) -> set[str]:
        """Held requests none of whose stores may still copy (done, or past ``not_after``)."""
        if not self._holding:
            return set()
        done = self._holding - self.stores.copying()
        self._holding -= done
        return done

    @property
    def transfers_pending(self) -> bool:
        """Whether a pull, a send or a release may have something to report (cheap)."""
        return bool(
            self._pulls
            or self._sending
            or self._released
            or self._failed
            or self._holding
            or self.loads.running
        )

    def take_load_errors(self) -> set[int]:
        """Return (and forget) the blocks that failed to load: vLLM recomputes them."""
        errors, self._errors = self._errors, set()
        return errors | self.loads.take_errors()

    def take_outcomes(self) -> list[tuple[int, str, bool]]:
        """Return (and forget) this step's load outcomes: ``(rank, request, loaded whole)``."""
        return self.loads.take_outcomes()

    def _submit_pulls(self, client: SidecarClient | None, specs: list[PullSpec]) -> None:
        groups: dict[tuple[str | None, str], list[PullSpec]] = {}
        ours = client.daemon.daemon_id if client is not None and client.daemon else None
        for spec in specs:
            # "": both engines on this daemon, a local pull; None: the producer cannot be reached
            endpoint = "" if spec.remote_daemon_id == ours else spec.remote_endpoint or None
            groups.setdefault((endpoint, spec.remote_engine_id), []).append(spec)
        for (endpoint, remote_engine), group in groups.items():
            pending = None
            if client is not None and endpoint is not None:
                try:
                    pending = client.submit_pull(
                        self.engine_id,
                        endpoint,
                        remote_engine,
                        {s.request_id: (s.remote_ids, s.local_ids) for s in group},
                        tp_rank=self.tp_rank,
                        timeout_s=self.settings.pull_timeout_s,
                        remote_request_ids={s.request_id: s.remote_request_id for s in group},
                        prompt_digests={s.request_id: s.prompt_digest for s in group},
                    )
                except SidecarError as exc:
                    log.warning("kvsidecar: pull not sent (%s): recomputing", exc)
            self._pulls.append((group, pending))

    def _finished_pulls(self, idle: bool) -> set[str]:
        recving: set[str] = set()
        still: list[tuple[list[PullSpec], Pending[Pulled] | None]] = []
        for group, pending in self._pulls:
            settled = pending is None or pending.done() or (idle and pending.wait(IDLE_WAIT_S))
            if not settled:
                still.append((group, pending))
                continue
            recving.update(s.request_id for s in group)
            failed = {s.request_id for s in group}
            invalid = {b for s in group for b in s.local_ids}
            if pending is not None:
                try:
                    reply = pending.result()
                    failed = set(reply.failed)
                    invalid = set(reply.invalid_block_ids)
                    if reply.error:
                        log.warning("kvsidecar: pull failed (%s): recomputing", reply.error)
                except SidecarError as exc:
                    log.warning("kvsidecar: pull failed (%s): recomputing", exc)
            self.counters["pulled"] += len(group) - len(failed)
            self.counters["load_errors"] += len(invalid)
            self._errors.update(invalid)
            self._failed |= failed
        self._pulls = still
        return recving

    def _finished_sends(self) -> set[str]:
        if self._sending:
            client = self._client()
            if client is None:
                self._release_sends()  # the daemon is away: nobody will read them
                self._events = None
            else:
                self._take_events(client)
        released, self._released = self._released, set()
        return released

    def _take_events(self, client: SidecarClient) -> None:
        """Read the events taken at an earlier call, if they came; ask for the next ones.

        Never waited for: what a step's call sends, a later step's reads.
        """
        pending = self._events
        if pending is None:
            try:
                self._events = client.submit_take_worker_events(timeout=self.settings.timeout_s)
            except SidecarError as exc:
                log.warning("kvsidecar: events not asked (%s): releasing published blocks", exc)
                self._release_sends()
            return
        if not pending.done():
            return
        self._events = None
        try:
            events = pending.result()
        except SidecarError as exc:
            log.warning("kvsidecar: events not read (%s): releasing published blocks", exc)
            self._release_sends()
            return
        now = time.monotonic()
        for e in events:
            for rid in e.finished_sending:
                self._early[rid] = now
        self._match_early()
        if self._sending:
            self._take_events(client)

    def _match_early(self) -> None:
        """Match completion events to known sends; keep the others a while, within a bound."""
        for rid in self._sending.intersection(self._early):
            del self._early[rid]
            self._sending.discard(rid)
            self._released.add(rid)
        horizon = time.monotonic() - EARLY_EVENT_S
        while self._early and (
            len(self._early) > EARLY_EVENTS or next(iter(self._early.values())) < horizon
        ):
            self._early.popitem(last=False)
            self.counters["events_dropped"] += 1

    def _release_sends(self) -> None:
        self._released |= self._sending
        self._sending = set()
