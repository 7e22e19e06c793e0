"""What the connector's processes send each other through vLLM, as vLLM's own metadata types.

The scheduler's plan for each step goes to every worker (`SidecarMetadata`), each worker's load
outcomes come back (`SidecarWorkerMeta`), and the workers' cache layout reaches the scheduler once
(`SidecarHandshake`). vLLM pickles them between its processes. With
`kvsidecar.integrations.vllm.connector` and `kvsidecar.integrations.vllm.metrics`, the only
modules that import vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvsidecar.integrations.vllm.plan import StepPlan


class SidecarMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's `StepPlan`, from the scheduler to every worker (pickled by vLLM)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class SidecarWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One step's load outcomes, from every worker to the scheduler: ``(rank, request, ok)``."""

    def __init__(self, outcomes: list[tuple[int, str, bool]]) -> None:
        self.outcomes = outcomes

    def aggregate(self, other: Any) -> SidecarWorkerMeta:
        """Join another worker's outcomes of the same step (vLLM's aggregation of workers)."""
        if isinstance(other, SidecarWorkerMeta):
            self.outcomes = [*self.outcomes, *other.outcomes]
        return self


@dataclasses.dataclass
class SidecarHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler once: its cache layout (`CacheLayout.name`)."""

    layout: str
