"""The connector's worker half (each vLLM worker process): the engine's cache and its copies.

The worker registers vLLM's KV cache with the daemon once (CPU: its storage moved into shared
memory in place; GPU: by CUDA IPC), then each step carries out the scheduler's
`kvsidecar.integrations.vllm.plan.StepPlan` without ever blocking a forward pass on the daemon
longer than the copies it needs:

- **before the forward** (vLLM's ``handle_preemptions``), the *fence*: a full block never
  changes while its request holds it, but once vLLM frees it (the request finished, was aborted
  or preempted) the next forward may write it; so the stores of requests that vLLM freed since
  the last step must have copied their blocks first. Other stores go on while the engine
  computes. A store not done by its ``not_after`` is abandoned: the daemon throws a later copy
  away, so a block that changed under it is never published;
- **loads** (``start_load_kv``): the prefix cache's blocks, submitted and waited for (this
  step's forward reads them); pulls of a disaggregated prefill, submitted and left running;
- **stores** (``wait_for_save``): this step's full blocks, submitted without waiting;
- **completions** (``get_finished``): pulls that ended, and published requests that their
  consumer read (the daemon's events for this worker, ``take_worker_events``).

Nothing here raises into vLLM: a daemon that is away or fails turns every load into a load error
(vLLM recomputes those blocks), every store into nothing, every pull into a received request
with invalid blocks, and every send into a finished one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping

import torch

from kvsidecar.client import Pending, SidecarClient, SidecarError
from kvsidecar.integrations.vllm.connection import DaemonConnection
from kvsidecar.integrations.vllm.layout import CacheLayout, share_storages
from kvsidecar.integrations.vllm.plan import PullSpec, StepPlan
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.wire.cache import CacheLoaded, CacheStored
from kvsidecar.wire.pulls import Pulled

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")

IDLE_WAIT_S = 0.005
"""In a step that computes nothing, how long to wait for a pull before handing back to vLLM
(without it, an engine waiting for a transfer spins through empty steps)."""


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
    ) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model_hash = model_hash
        self.layout: CacheLayout | None = None
        self.conn: DaemonConnection | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._reconnects = -1
        self._stores: list[tuple[Pending[CacheStored], set[str]]] = []
        """Stores in flight and the requests whose blocks each one reads."""
        self._pulls: list[tuple[list[PullSpec], Pending[Pulled] | None]] = []
        self._sending: set[str] = set()
        self._released: set[str] = set()
        """Sends given up on (the daemon went away): reported finished at the next call."""
        self._errors: set[int] = set()
        self.counters = {"loaded_blocks": 0, "load_errors": 0, "stored_blocks": 0, "pulled": 0}
        """Running totals (also in the shutdown log line)."""

    # ------------------------------------------------------------------ registration

    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: CacheLayout) -> None:
        """Share the engine's cache and connect (in the background if the daemon is away)."""
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
        log.info("kvsidecar worker %d: %s", self.tp_rank, self.counters)

    # ------------------------------------------------------------------ step hooks

    def fence(self, freed: Collection[str]) -> None:
        """Before a forward: finish the stores of the ``freed`` requests (see the module doc)."""
        if not self._stores:
            return
        still = []
        gone = set(freed)
        for store, requests in self._stores:
            if store.done():
                self._count_store(store)
                continue
            left = store.deadline - time.monotonic()
            if left <= 0:
                continue  # abandoned: its copy, if it ever ends, is thrown away
            if requests & gone:
                if store.wait(min(left, self.settings.store_wait_s)):
                    self._count_store(store)
                continue  # abandoned likewise if it is not done by its deadline
            still.append((store, requests))
        self._stores = still

    def _count_store(self, store: Pending[CacheStored]) -> None:
        try:
            self.counters["stored_blocks"] += store.result().stored
        except SidecarError as exc:
            log.debug("store failed: %s", exc)

    def start_loads(self, plan: StepPlan) -> None:
        """Submit the pulls, then load the prefix cache's blocks and wait for them."""
        if not plan.loads and not plan.pulls:
            return  # most steps: nothing to ask the daemon
        client = self._client()
        self._submit_pulls(client, plan.pulls)
        loads: list[tuple[list[int], Pending[CacheLoaded] | None]] = []
        for spec in plan.loads:
            pending = None
            if client is not None:
                try:
                    pending = client.submit_cache_load(
                        plan.fingerprint,
                        spec.keys,
                        spec.block_ids,
                        pin_id=spec.pin_id,
                        timeout=self.settings.load_timeout_s,
                    )
                except SidecarError as exc:
                    log.warning("kvsidecar: load not sent (%s): recomputing", exc)
            loads.append((spec.block_ids, pending))
        for block_ids, load in loads:
            self._settle_load(block_ids, load)

    def _settle_load(self, block_ids: list[int], load: Pending[CacheLoaded] | None) -> None:
        bad = set(block_ids)
        if load is not None:
            try:
                reply = load.result()
                bad = set(reply.missing_block_ids)
                self.counters["loaded_blocks"] += reply.loaded
            except SidecarError as exc:
                log.warning("kvsidecar: load of %d blocks failed (%s): recomputing", len(bad), exc)
        self.counters["load_errors"] += len(bad)
        self._errors.update(bad)

    def store(self, plan: StepPlan) -> None:
        """After the forward: submit this step's stores; note the requests it must send."""
        self._sending.update(plan.sends)
        if not plan.stores:
            return
        client = self._client()
        if client is None:
            return
        keys = [k for spec in plan.stores for k in spec.keys]
        block_ids = [b for spec in plan.stores for b in spec.block_ids]
        not_after = time.monotonic() + self.settings.store_wait_s
        requests = {spec.request_id for spec in plan.stores}
        try:
            store = client.submit_cache_store(
                plan.fingerprint,
                keys,
                block_ids,
                not_after=not_after,
                capacity_bytes=self.settings.cache_bytes,
                timeout=self.settings.store_wait_s,
            )
            self._stores.append((store, requests))
        except SidecarError as exc:
            log.debug("store not sent: %s", exc)

    def finished(self, *, idle: bool) -> tuple[set[str], set[str]]:
        """Return the requests that finished sending and receiving since the last call."""
        recving = self._finished_pulls(idle)
        return self._finished_sends(), recving

    def take_load_errors(self) -> set[int]:
        """Return (and forget) the blocks that failed to load: vLLM recomputes them."""
        errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------------ pulls and sends

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
                except SidecarError as exc:
                    log.warning("kvsidecar: pull failed (%s): recomputing", exc)
            self.counters["pulled"] += len(group) - len(failed)
            self.counters["load_errors"] += len(invalid)
            self._errors.update(invalid)
        self._pulls = still
        return recving

    def _finished_sends(self) -> set[str]:
        if self._sending:
            client = self._client()
            if client is None:
                self._release_sends()  # the daemon is away: nobody will read them
            else:
                try:
                    events = client.take_worker_events()
                except SidecarError as exc:
                    log.warning("kvsidecar: events not read (%s): releasing published blocks", exc)
                    self._release_sends()
                else:
                    done = {r for e in events for r in e.finished_sending} & self._sending
                    self._sending -= done
                    self._released |= done
        released, self._released = self._released, set()
        return released

    def _release_sends(self) -> None:
        self._released |= self._sending
        self._sending = set()
