"""The connector's counters on vLLM's own ``/metrics`` (vLLM's KV-connector stats mechanism).

Each vLLM process of the connector keeps running totals (`SchedulerSide.counters`,
`WorkerSide.counters`, the hooks' caught exceptions); every step it hands vLLM what moved since
the last step (`SidecarStats`, plain data: it crosses processes), vLLM adds up the workers'
and the scheduler's, and in its API server `SidecarPromMetrics` adds them to counters:

- ``vllm:kvsidecar_kv_params_ignored_total{reason}``: requests whose ``kv_transfer_params``
  were ignored (computed here), by `kvsidecar.integrations.vllm.params.IGNORED_REASONS`;
- ``vllm:kvsidecar_blocks_total{event}``: blocks ``loaded`` from the daemon, ``load_failed``
  (recomputed), ``stored``, ``not_stored`` (held back: their request's load failed),
  ``disk_hit`` (planned loads of blocks the daemon had on its disk tier only);
- ``vllm:kvsidecar_pulled_requests_total``: prefills pulled whole;
- ``vllm:kvsidecar_events_dropped_total``: completion events that matched no send in time;
- ``vllm:kvsidecar_hook_errors_total{hook}``: exceptions a hook caught (it answered closed).
"""

from __future__ import annotations

import collections
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

Counts = collections.Counter
"""Counter names to counts: ``ignored:<reason>``, ``hook:<name>``, or a block/event counter."""

_BLOCK_EVENTS = {
    "loaded_blocks": "loaded",
    "load_errors": "load_failed",
    "stored_blocks": "stored",
    "not_stored": "not_stored",
    "disk_hits": "disk_hit",
}


class SidecarStats(KVConnectorStats):  # type: ignore[misc]
    """What the connector's counters moved by, in one or several processes (plain data)."""

    def reset(self) -> None:
        """Forget every count."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: Any) -> SidecarStats:
        """Add another process's counts (vLLM adds the workers' and the scheduler's)."""
        for key, value in getattr(other, "data", {}).items():
            self.data[key] = self.data.get(key, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Return the counts, for vLLM's periodic log line."""
        return {key: int(value) for key, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        """Whether nothing moved."""
        return not any(self.data.values())


class SidecarPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The counters of the module doc, one child per engine of the API server."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return self._counter_cls(
                name=f"vllm:kvsidecar_{name}", documentation=doc, labelnames=[*labelnames, *extra]
            )

        self._ignored = counter(
            "kv_params_ignored", "Requests whose kv_transfer_params were ignored.", ("reason",)
        )
        self._blocks = counter("blocks", "Blocks loaded, failed, stored, held back.", ("event",))
        self._pulled = counter("pulled_requests", "Prefills pulled whole from a producer.")
        self._dropped = counter("events_dropped", "Completion events that matched no send.")
        self._hooks = counter("hook_errors", "Exceptions caught by a connector hook.", ("hook",))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts to the counters of engine ``engine_idx``."""
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, value in transfer_stats_data.items():
            n = int(value)
            if n <= 0:
                continue
            kind, _, detail = key.partition(":")
            if kind == "ignored":
                self._ignored.labels(*labels, detail).inc(n)
            elif kind == "hook":
                self._hooks.labels(*labels, detail).inc(n)
            elif key in _BLOCK_EVENTS:
                self._blocks.labels(*labels, _BLOCK_EVENTS[key]).inc(n)
            elif key == "pulled":
                self._pulled.labels(*labels).inc(n)
            elif key == "events_dropped":
                self._dropped.labels(*labels).inc(n)
