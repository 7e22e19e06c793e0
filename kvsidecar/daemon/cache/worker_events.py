"""Completion events per worker, for engines that aggregate completions themselves.

vLLM's executor gathers every worker's ``get_finished`` and counts a request as done when all
workers named it, so each worker must learn by itself when the daemon finished something for it:
a producer's published request read by its consumers (or its lease ended), a pull into its
blocks. `WorkerEvents` queues the peer completion events (`kvsidecar.wire.reports.PeerCompletion`)
for each worker that asked for them (``take_worker_events``): an event that names a worker goes
to that worker, an engine-wide one to every registered worker of the engine. The first take
subscribes; a worker that never takes costs nothing. This is separate from the daemon's own
aggregation (`kvsidecar.daemon.completions`, ``report``/``collect``), which keeps working
unchanged for engines that let the daemon aggregate.
"""

from __future__ import annotations

import collections
import logging

from kvsidecar.node.registry import Registry
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.types import WorkerRef

log = logging.getLogger("kvsidecar.daemon")

QUEUE_LIMIT = 1 << 16
"""Events kept per worker between two takes; older ones are dropped (and logged)."""


class WorkerEvents:
    """Per-worker queues of completion events (see the module doc)."""

    def __init__(self, registry: Registry, limit: int = QUEUE_LIMIT) -> None:
        self.registry = registry
        self.limit = limit
        self._queues: dict[WorkerRef, collections.deque[PeerCompletion]] = {}

    def on_peer_event(self, event: PeerCompletion) -> None:
        """Queue ``event`` for the worker it names, or for every worker of its engine."""
        if event.worker is not None:
            targets = [event.worker]
        else:
            engine = self.registry.engines.get(event.engine_id)
            targets = [] if engine is None else list(engine.workers)
        for ref in targets:
            queue = self._queues.get(ref)
            if queue is None:
                continue  # not subscribed
            if len(queue) == self.limit:
                log.warning("%s does not take its events: dropping the oldest", ref.label())
            queue.append(event)

    def take(self, ref: WorkerRef) -> list[PeerCompletion]:
        """Return and forget ``ref``'s queued events, oldest first (subscribing it)."""
        # Queues of workers released since are forgotten here: a new registration starts afresh.
        for gone in [r for r in self._queues if r not in self.registry.workers]:
            del self._queues[gone]
        queue = self._queues.setdefault(ref, collections.deque(maxlen=self.limit))
        events = list(queue)
        queue.clear()
        return events
