"""One worker's loads of prefix-cache hits: sent, waited for or left running, and settled.

A load copies cached blocks from the daemon into the engine's blocks of one request:

- a **sync** load (``LoadSpec.asynchronous`` false) is waited for in ``start_load_kv``: the
  step's forward reads its blocks;
- an **async** load is left running; vLLM keeps its request in ``WAITING_FOR_REMOTE_KVS`` until
  every worker reports it received (`WorkerLoads.finished`), failed or not, so each one is
  reported exactly once: when its reply came, or when it can no longer copy (past its
  ``not_after`` and the fence's second).

Every load settles into an outcome for the scheduler (``(rank, request, loaded whole)``) and
load errors for vLLM (the blocks not loaded: recomputed); a request whose load failed here is
*tainted*: nothing of it is stored until vLLM frees it. A sync load that timed out may still
copy: the fence (`WorkerLoads.fence`) waits for it before vLLM hands its blocks to another
request.
"""

from __future__ import annotations

import collections
import logging
import time

from kvsidecar.client import Pending, SidecarClient, SidecarError
from kvsidecar.integrations.vllm.plan import LoadSpec
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.wire.cache import CacheLoaded

log = logging.getLogger("vllm.kvsidecar")

OUTCOMES_KEPT = 4096
"""Load outcomes kept for the scheduler between two takes (one step's, in practice)."""
LOAD_FENCE_S = 1.0
"""How long past its ``load_timeout_s`` the reply of a load is still awaited before its blocks
may be written by anything else. The daemon starts no copy after the load's ``not_after``, so a
daemon that serves answers within this."""


class WorkerLoads:
    """See the module doc. ``counters`` is the worker's (``loaded_blocks``, ``load_errors``)."""

    def __init__(
        self, settings: ConnectorSettings, tp_rank: int, counters: collections.Counter[str]
    ) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.counters = counters
        self.tainted: set[str] = set()
        """Requests whose load failed on this rank: nothing of theirs is stored until freed."""
        self._late: list[tuple[Pending[CacheLoaded], str]] = []
        """Sync loads that timed out here and may still copy, with their request."""
        self._running: list[tuple[LoadSpec, Pending[CacheLoaded] | None, float]] = []
        """Async loads not reported yet, each with the time past which it cannot copy."""
        self._outcomes: list[tuple[int, str, bool]] = []
        self._errors: set[int] = set()

    @property
    def running(self) -> bool:
        """Whether an async load has still to be reported received (cheap)."""
        return bool(self._running)

    def start(self, client: SidecarClient | None, fingerprint: str, specs: list[LoadSpec]) -> None:
        """Send the loads; wait for the sync ones (with no client, every one fails)."""
        sync: list[tuple[LoadSpec, Pending[CacheLoaded] | None]] = []
        deadline = time.monotonic() + self.settings.load_timeout_s
        for spec in specs:
            pending = None
            if client is not None:
                try:
                    pending = client.submit_cache_load(
                        fingerprint,
                        spec.keys,
                        spec.block_ids,
                        pin_id=spec.pin_id,
                        timeout=self.settings.load_timeout_s + LOAD_FENCE_S,
                        not_after=deadline,
                    )
                except SidecarError as exc:
                    log.warning("kvsidecar: load not sent (%s): recomputing", exc)
            if spec.asynchronous:
                self._running.append((spec, pending, deadline + LOAD_FENCE_S))
            else:
                sync.append((spec, pending))
        for spec, load in sync:
            self._settle_sync(spec, load, deadline)

    def fail(self, specs: list[LoadSpec]) -> None:
        """Settle loads that were never sent as failed (an async one is reported received)."""
        for spec in specs:
            if spec.request_id in self._known():
                continue  # settled or running already: nothing reported twice
            if spec.asynchronous:
                self._running.append((spec, None, 0.0))
            else:
                self._settle(spec, set(spec.block_ids))

    def _known(self) -> set[str]:
        return {rid for _, rid, _ in self._outcomes} | {s.request_id for s, _, _ in self._running}

    def _settle_sync(
        self, spec: LoadSpec, load: Pending[CacheLoaded] | None, deadline: float
    ) -> None:
        if load is not None and not load.wait(deadline - time.monotonic()):
            log.warning(
                "kvsidecar: load of %d blocks not done in load_timeout_s: recomputing",
                len(spec.block_ids),
            )
            self._late.append((load, spec.request_id))
            load = None
        self._settle(spec, self._missing(spec, load))

    def _missing(self, spec: LoadSpec, load: Pending[CacheLoaded] | None) -> set[int]:
        """Return the blocks a load that ended (None: never sent, timed out) did not write."""
        if load is None:
            return set(spec.block_ids)
        try:
            reply = load.result()
        except SidecarError as exc:
            log.warning(
                "kvsidecar: load of %d blocks failed (%s): recomputing", len(spec.block_ids), exc
            )
            return set(spec.block_ids)
        self.counters["loaded_blocks"] += reply.loaded
        return set(reply.missing_block_ids)

    def _settle(self, spec: LoadSpec, bad: set[int]) -> None:
        self.counters["load_errors"] += len(bad)
        self._errors.update(bad)
        self._outcomes.append((self.tp_rank, spec.request_id, not bad))
        if len(self._outcomes) > OUTCOMES_KEPT:  # a vLLM that never takes them
            del self._outcomes[:-OUTCOMES_KEPT]
        if bad:
            self.tainted.add(spec.request_id)

    def finished(self, *, idle: bool, wait_s: float) -> set[str]:
        """Return the async loads' requests received since the last call (failed ones too).

        In an ``idle`` step (nothing computed) the first load still copying is waited for
        ``wait_s``: without it an engine that only waits for loads spins through empty steps.
        """
        received: set[str] = set()
        still = []
        now = time.monotonic()
        for spec, load, cutoff in self._running:
            ended = load is None or load.done() or (idle and not received and load.wait(wait_s))
            if ended:
                self._settle(spec, self._missing(spec, load))
            elif now >= cutoff:
                log.warning(
                    "kvsidecar: load of %d blocks has not ended past load_timeout_s: recomputing",
                    len(spec.block_ids),
                )
                self._settle(spec, set(spec.block_ids))
            else:
                still.append((spec, load, cutoff))
                continue
            received.add(spec.request_id)
        self._running = still
        return received

    def fence(self, gone: set[str]) -> None:
        """Before a forward: wait for the late sync loads into the blocks of ``gone`` requests."""
        self.tainted -= gone  # re-admitted, they load and compute afresh
        still = []
        for load, rid in self._late:
            if load.done():
                continue
            if rid in gone:
                if not load.wait(LOAD_FENCE_S):
                    log.warning(
                        "kvsidecar: a timed-out load into %s's blocks has not ended; they are "
                        "freed anyway",
                        rid,
                    )
                continue
            still.append((load, rid))
        self._late = still

    def take_errors(self) -> set[int]:
        """Return (and forget) the blocks that failed to load."""
        errors, self._errors = self._errors, set()
        return errors

    def take_outcomes(self) -> list[tuple[int, str, bool]]:
        """Return (and forget) the outcomes settled since the last take."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes
