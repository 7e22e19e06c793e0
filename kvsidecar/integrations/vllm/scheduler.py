"""The connector's scheduler half (vLLM's engine-core process): what to load, store, pull, send.

It sees requests as vLLM's scheduler admits, schedules and finishes them, asks the daemon which
blocks it holds, and writes each step's `kvsidecar.integrations.vllm.plan.StepPlan` for the
workers. vLLM's contract (docs/vllm.md has the whole story):

- **Prefix cache** (role ``kv_both``): `SchedulerSide.lookup` counts the leading blocks beyond
  the engine's own prefix-cache hit that every rank holds in the daemon: a *sync* load, so the
  hit stops one token short of the prompt (the scheduler must compute at least one token).
  Lookups change nothing; `SchedulerSide.after_alloc` pins what it will load. Every full block a
  step computes is stored after that step (`StepPlan.stores`); blocks the engine already had are
  not stored again.
- **Disaggregated prefill**: a prefill engine's finished request with ``do_remote_decode`` is
  published with a lease and answered with ``kv_transfer_params`` naming its blocks, its engine
  and its daemon; vLLM holds the blocks until the workers report ``finished_sending``. A decode
  engine given those params loads the whole prompt *asynchronously* (the request waits, then
  computes only its last token): its workers pull the blocks, through the same daemon when both
  engines share it, from the producer's daemon otherwise.

The daemon may be absent or die at any time: a lookup that fails is a miss (and the daemon is
left alone for ``retry_s``), a publish that fails frees the blocks at once (the consumer then
computes the prompt itself).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from kvsidecar.client import SidecarError
from kvsidecar.core.layout import CPU_PACKED
from kvsidecar.integrations.vllm.connection import DaemonConnection
from kvsidecar.integrations.vllm.plan import LoadSpec, PullSpec, StepPlan, StoreSpec
from kvsidecar.integrations.vllm.settings import ConnectorSettings

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")


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


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One request scheduled this step, as `SchedulerSide.build` needs it."""

    request_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    num_scheduled_tokens: int
    new_block_ids: list[int] | None
    """Blocks added this step (all of the request's blocks when ``resumed``)."""
    resumed: bool = False


@dataclasses.dataclass
class _Tracked:
    """A request whose computed blocks are stored as they fill."""

    request: RequestView
    block_ids: list[int]
    stored: int
    """Blocks the daemon has (or that were never this engine's to store)."""


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
    ) -> None:
        self.settings = settings
        self.role = role
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.tp_size = tp_size
        self.prefix_cache = prefix_cache
        self.layout = ""
        """The workers' cache layout (their handshake metadata): sent to decode engines."""
        self.conn = DaemonConnection(
            settings, "scheduler", heartbeat=False, timeout_s=settings.lookup_timeout_s
        )
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        """Request -> (blocks of the engine's own hit, blocks the daemon holds beyond them)."""
        self._next = StepPlan(step=0, fingerprint=fingerprint)

    def start(self) -> None:
        """Begin connecting to the daemon (in the background when it does not answer at once)."""
        self.conn.start()

    def close(self) -> None:
        """Drop the daemon connection."""
        self.conn.close()

    # ------------------------------------------------------------------ admission

    def lookup(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Answer ``get_num_new_matched_tokens``: tokens to load, and whether asynchronously."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and self.role in ("kv_consumer", "kv_both"):
            return self._remote_prefill(request, num_computed_tokens, params)
        if not self.prefix_cache:
            return 0, False
        bs = self.block_size
        local = num_computed_tokens // bs
        # What the engine had itself is never stored again, hit or not.
        self._matched[request.request_id] = (local, 0)
        # Sync loads must leave the last prompt token to compute (vLLM asserts it).
        keys = list(request.block_hashes[local : (request.num_tokens - 1) // bs])
        client = self.conn.get() if keys else None
        if client is None:
            return 0, False
        try:
            hits = client.cache_lookup(self.fingerprint, keys, tp_size=self.tp_size).hits
        except SidecarError as exc:
            self.conn.away(f"lookup: {exc}")
            return 0, False
        self._matched[request.request_id] = (local, hits)
        return hits * bs, False

    def _remote_prefill(
        self, request: RequestView, num_computed_tokens: int, params: dict[str, Any]
    ) -> tuple[int, bool]:
        try:
            remote_tokens = int(params["remote_num_tokens"])
            remote_bs = int(params["remote_block_size"])
        except (KeyError, TypeError, ValueError):
            log.warning("kvsidecar: %s: kv_transfer_params without a prefill", request.request_id)
            return 0, False
        problem = self._pull_problem(remote_bs, str(params.get("remote_layout", "")))
        if problem is not None or self.conn.get() is None:
            if problem is not None:
                log.warning("kvsidecar: %s computes its prompt: %s", request.request_id, problem)
            return 0, False
        external = remote_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens // self.block_size, 0)
        return external, True

    def _pull_problem(self, remote_bs: int, remote_layout: str) -> str | None:
        if remote_bs < 1 or self.block_size % remote_bs:
            return f"block size {self.block_size} is not a multiple of the producer's {remote_bs}"
        if remote_bs != self.block_size and "opaque" in (remote_layout, self.layout):
            return "block sizes differ and a cache layout is one the daemon cannot re-block"
        packed = {remote_layout, self.layout} & set(CPU_PACKED)
        if packed and remote_layout != self.layout:
            # vLLM's vec and amx CPU kernels pack a block differently (the ISA follows the CPU,
            # the dtype and the block size): the daemon would refuse the pull.
            return f"the producer's cache is {remote_layout!r}, this engine's {self.layout!r}"
        return None

    def after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Answer ``update_state_after_alloc``: queue the loads or the pull, start tracking."""
        rid = request.request_id
        matched = self._matched.pop(rid, None)
        params = request.kv_transfer_params or {}
        blocks = list(block_ids)
        if num_external_tokens > 0 and params.get("do_remote_prefill") and matched is not None:
            self._queue_pull(request, blocks, matched[0], params)
            return
        if rid in self._tracked and num_external_tokens == 0:
            return  # called again after an async load: nothing new
        local = matched[0] if matched is not None else 0
        loaded = num_external_tokens // self.block_size
        if loaded:
            self._queue_load(request, blocks, local, loaded)
        if self.prefix_cache:
            self._tracked[rid] = _Tracked(request, blocks, stored=local + loaded)

    def _queue_load(self, request: RequestView, blocks: list[int], local: int, count: int) -> None:
        keys = list(request.block_hashes[local : local + count])
        pin_id = 0
        client = self.conn.get()
        if client is not None:
            try:
                pin = client.cache_lookup(
                    self.fingerprint, keys, tp_size=self.tp_size, pin_s=self.settings.pin_s
                )
                pin_id = pin.pin_id
            except SidecarError as exc:
                self.conn.away(f"pin: {exc}")  # the load will fail and be recomputed
        self._next.loads.append(
            LoadSpec(request.request_id, keys, blocks[local : local + count], pin_id)
        )

    def _queue_pull(
        self, request: RequestView, blocks: list[int], local: int, params: dict[str, Any]
    ) -> None:
        bs, remote_bs = self.block_size, int(params["remote_block_size"])
        ratio = bs // remote_bs
        n_local = -(-int(params["remote_num_tokens"]) // bs)
        remote_ids = [int(b) for b in params["remote_block_ids"]][local * ratio :]
        self._next.pulls.append(
            PullSpec(
                request_id=request.request_id,
                remote_engine_id=str(params["remote_engine_id"]),
                remote_request_id=str(params["remote_request_id"]),
                remote_endpoint=str(params.get("remote_endpoint", "")),
                remote_daemon_id=str(params.get("remote_daemon_id", "")),
                remote_ids=remote_ids,
                local_ids=blocks[local:n_local],
            )
        )
        params["do_remote_prefill"] = False  # loaded once, as vLLM's NIXL connector does

    # ------------------------------------------------------------------ steps

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
        plan.idle = not any(s.num_scheduled_tokens for s in scheduled)
        plan.freed = [*preempted, *finished]
        for rid in preempted:  # their blocks are gone; re-admission starts over
            self._tracked.pop(rid, None)
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
            hashes = tracked.request.block_hashes
            done = s.num_computed_tokens + s.num_scheduled_tokens
            full = min(done // bs, len(hashes), len(tracked.block_ids))
            if full > tracked.stored:
                keys = list(hashes[tracked.stored : full])
                ids = tracked.block_ids[tracked.stored : full]
                plan.stores.append(StoreSpec(keys, ids, s.request_id))
                tracked.stored = full
        return plan

    def request_finished(
        self,
        request: RequestView,
        block_ids: Sequence[int],
        *,
        num_computed_tokens: int,
        capped: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Answer ``request_finished``: publish a prefill for its decode engine, or let go."""
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._matched.pop(rid, None)
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_decode") and capped and self.role != "kv_consumer"):
            return False, None
        client = self.conn.get()
        if client is None or client.daemon is None:
            return False, None
        blocks = [int(b) for b in block_ids[: -(-num_computed_tokens // self.block_size)]]
        try:
            client.publish(self.engine_id, rid, blocks, lease_s=self.settings.lease_s)
        except SidecarError as exc:
            self.conn.away(f"publish: {exc}")
            return False, None
        self._next.sends.append(rid)
        return True, {
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
