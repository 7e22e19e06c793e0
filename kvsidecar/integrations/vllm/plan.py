"""What the scheduler tells its workers each step: the loads, stores, pulls and sends.

Built by `kvsidecar.integrations.vllm.scheduler.SchedulerSide` in vLLM's engine-core process,
pickled by vLLM into every worker (inside ``KVConnectorMetadata``), carried out there by
`kvsidecar.integrations.vllm.worker.WorkerSide`. Plain values only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol


@dataclasses.dataclass
class LoadSpec:
    """Blocks of a request that the prefix cache holds: load them (see ``asynchronous``)."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    pin_id: int = 0
    """The scheduler's pin of these blocks (released by the load)."""
    asynchronous: bool = False
    """vLLM waits for it in ``WAITING_FOR_REMOTE_KVS``: no forward reads the blocks until every
    worker reported the request received (``finished_recving``), which each does once its load
    ended, failed or not."""


@dataclasses.dataclass
class StoreSpec:
    """Full blocks of a request that this step computes: store them once the step has run."""

    keys: list[bytes]
    block_ids: list[int]
    request_id: str = ""
    batched: bool = False
    """Filled by a decode step (fewer tokens than a block): may be sent with later stores,
    `kvsidecar.integrations.vllm.stores`."""


@dataclasses.dataclass
class PullSpec:
    """A decode request's prefill, published by another engine: pull it into these blocks."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    remote_endpoint: str
    """The producer daemon's peer endpoint ("" if it has none)."""
    remote_daemon_id: str
    """The producer daemon's identity: equal to ours, the pull stays on this node."""
    remote_ids: list[int]
    local_ids: list[int]
    prompt_digest: str = ""
    """The digest of this request's prompt: the producer's daemon serves the pull only if the
    blocks were published for the same one (`kvsidecar.integrations.vllm.params`)."""


@dataclasses.dataclass
class StepPlan:
    """One step's work for every worker (see the module doc)."""

    step: int
    fingerprint: str
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    stores: list[StoreSpec] = dataclasses.field(default_factory=list)
    pulls: list[PullSpec] = dataclasses.field(default_factory=list)
    sends: list[str] = dataclasses.field(default_factory=list)
    """Requests published this step: their blocks are held until ``finished_sending``."""
    held: list[str] = dataclasses.field(default_factory=list)
    """Finished requests whose blocks vLLM holds until each worker reports them finished
    sending, which it does once its stores of them have ended."""
    idle: bool = False
    """No tokens are computed this step (the engine only waits for transfers)."""
    freed: list[str] = dataclasses.field(default_factory=list)
    """Requests whose blocks vLLM freed since the last step (finished, aborted, preempted): this
    step's forward may write into them, so their pending stores must be done first."""
    failed_loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    """Loads vLLM counts on that the scheduler could not plan (a hook failed): every worker
    reports their blocks as load errors, without asking the daemon."""
    failed_pulls: list[PullSpec] = dataclasses.field(default_factory=list)
    """Pulls likewise: reported as received with every local block invalid."""
    unsent: list[str] = dataclasses.field(default_factory=list)
    """Requests sent earlier whose publish the daemon refused: nobody can read them, so every
    worker reports them finished sending (vLLM frees their blocks)."""


class RequestView(Protocol):
    """The parts of vLLM's ``Request`` the scheduler half reads."""

    @property
    def request_id(self) -> str:
        """Unique within the engine."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """The hashes of the request's full blocks so far (grows as tokens are added)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` the request came with (disaggregated prefill)."""
        ...


class Scheduled(NamedTuple):
    """One request scheduled this step, as `SchedulerSide.build` needs it.

    A tuple: one is made per running request and step, and a frozen dataclass costs three
    times as much to make.
    """

    request_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    num_scheduled_tokens: int
    new_block_ids: list[int] | None
    """Blocks added this step (all of the request's blocks when ``resumed``)."""
    resumed: bool = False
