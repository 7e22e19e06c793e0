"""One worker's stores of full blocks into the node's cache: batched, sent, and fenced.

A store copies blocks of the engine's cache into the daemon's once a step computed them. It is
sent after the forward (``wait_for_save``) and never waited for there: a full block does not
change while its request holds it. Two things bound it:

- the **fence** (`WorkerStores.fence`, before a forward): once vLLM frees a request's blocks the
  next forward may write them, so the stores that read them must have copied first;
- ``not_after`` (``store_wait_s`` after sending): the daemon throws a later copy away, so a
  store abandoned by the fence never publishes a block that changed under it.

Blocks a decode step filled (`StoreSpec.batched`: one block, now and then, per running request)
are *batched*: kept here and sent with the next store, at most ``store_batch_steps`` steps
later, so that most decode steps send nothing and poll nothing. They are sent at once when
their request is freed (by the fence, before it waits), when the engine holds finished requests
for their stores (`StepPlan.held`), and in a step that computes nothing. A prompt's blocks are
sent in the step that computed them: another engine may look them up at once.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from kvsidecar.client import Pending, SidecarClient, SidecarError
from kvsidecar.integrations.vllm.plan import StoreSpec
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.wire.cache import CacheStored

log = logging.getLogger("vllm.kvsidecar")


class WorkerStores:
    """See the module doc.

    ``counters`` is the worker's (``stored_blocks``); ``client`` returns the client while the
    daemon is reachable (None: what would be sent is dropped).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        counters: collections.Counter[str],
        client: Callable[[], SidecarClient | None],
    ) -> None:
        self.settings = settings
        self.counters = counters
        self._client = client
        self._in_flight: list[tuple[Pending[CacheStored], set[str]]] = []
        """Stores sent and not settled, with the requests whose blocks each one reads."""
        self._batch: list[StoreSpec] = []
        """Batched blocks not sent yet (all of one namespace: `_batch_fingerprint`)."""
        self._batch_fingerprint = ""
        self._batch_step = 0
        """The step of the oldest batched blocks."""

    @property
    def batched(self) -> bool:
        """Whether batched blocks wait to be sent (cheap)."""
        return bool(self._batch)

    def add(self, step: int, fingerprint: str, specs: list[StoreSpec], *, now: bool) -> None:
        """Store ``specs`` of ``step`` (after its forward): send them, or batch the batched ones.

        ``now``: send the batch too, whatever its age.
        """
        if self._batch and fingerprint != self._batch_fingerprint:
            self.flush()  # a reset: the batch belongs to the namespace it was computed for
        later = [s for s in specs if s.batched]
        if later:
            if not self._batch:
                self._batch_step, self._batch_fingerprint = step, fingerprint
            self._batch.extend(later)
        due = step - self._batch_step + 1 >= self.settings.store_batch_steps
        sent = [s for s in specs if not s.batched]
        if sent or now or (self._batch and due):
            self._send(fingerprint, [*self._batch, *sent])
            self._batch = []

    def flush(self) -> None:
        """Send the batched blocks now."""
        if self._batch:
            self._send(self._batch_fingerprint, self._batch)
            self._batch = []

    def _send(self, fingerprint: str, specs: list[StoreSpec]) -> None:
        client = self._client()
        if client is None or not specs:
            return
        timeout = self.settings.store_wait_s
        try:
            store = client.submit_cache_store(
                fingerprint,
                [k for spec in specs for k in spec.keys],
                [b for spec in specs for b in spec.block_ids],
                not_after=time.monotonic() + timeout,
                capacity_bytes=self.settings.cache_bytes,
                timeout=timeout,
            )
        except SidecarError as exc:
            log.debug("store not sent: %s", exc)
            return
        self._in_flight.append((store, {spec.request_id for spec in specs}))

    def fence(self, gone: set[str]) -> None:
        """Before a forward: the stores of the ``gone`` requests (freed) copy first, or never."""
        if gone and any(spec.request_id in gone for spec in self._batch):
            self.flush()
        if not self._in_flight:
            return
        still = []
        for store, requests in self._in_flight:
            if store.done():
                self._count(store)
                continue
            left = store.deadline - time.monotonic()
            if left <= 0:
                continue  # abandoned: its copy, if it ever ends, is thrown away
            if requests & gone:
                if store.wait(min(left, self.settings.store_wait_s)):
                    self._count(store)
                continue  # abandoned likewise if it is not done by its deadline
            still.append((store, requests))
        self._in_flight = still

    def copying(self) -> set[str]:
        """Return the requests a store may still read from (batched, or sent and unsettled)."""
        now = time.monotonic()
        busy = {spec.request_id for spec in self._batch}
        for store, requests in self._in_flight:
            if now < store.deadline and not store.done():
                busy |= requests
        return busy

    def _count(self, store: Pending[CacheStored]) -> None:
        try:
            self.counters["stored_blocks"] += store.result().stored
        except SidecarError as exc:
            log.debug("store failed: %s", exc)
