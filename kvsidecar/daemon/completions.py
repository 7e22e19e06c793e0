"""Completion aggregation as a daemon service: workers report per step, the scheduler collects.

The pure counting is `kvsidecar.core.aggregator.CompletionAggregator` (the reference's
``KVOutputAggregator`` semantics, duplicate suppression, dead-worker crediting). This module is
what turns it into a service on the daemon's event loop:

- **Identity and epochs.** Every registration of a worker gets a fresh *epoch* (daemon-wide,
  increasing, seeded from the wall clock so that a restarted daemon never reissues one). A
  `Report` names its worker and epoch; one from an earlier registration of the same worker (a dead
  process's late words) gets ``stale_epoch``, one from an unregistered worker ``unknown_worker``.
- **Per-step buffers.** Reports wait in per-step buffers until the scheduler collects. A
  ``(worker, step)`` delivered twice counts once (the client may retry a lost reply). `Collect`
  waits (bounded) until every live worker has reported the step, then feeds every buffered report
  of steps <= that step, oldest first, to the aggregator in one call. Steps are collected in
  increasing order; a report for a step already collected gets ``step_collected`` (its content
  belongs in the worker's next step), unless it is a copy of one that was counted, which is
  acknowledged as a duplicate. The answers of the last steps are kept so that a retried `Collect`
  gets the same answer instead of losing it.
- **The daemon reports too.** A `Move` that carries request ids, and every peer pull or publish
  outcome (the sink given to `kvsidecar.peer.service.PeerService`), is credited to the workers
  it ran for: a ``device`` source finished sending, a ``device`` destination finished receiving
  (failed, with the destination blocks invalid, when the move failed). These accrue per worker
  and join that worker's report at the next collect (merged into its own report, so a request the
  worker also names counts once for it); a worker that never reports still gets them counted.
- **Dead workers.** When a worker departs (lease expiry, fd channel closed, unregister) it is
  failed in the aggregator at once: every request waiting for it is completed on its behalf, the
  receiving ones as failed, so nothing waits for a report that will never come. Its buffered,
  uncollected reports are dropped (they would be fenced anyway); `Collected.failed_workers`
  names it once.
- **Engine lifetime.** An engine's state starts with its first registration and is dropped
  ``retain_s`` after its last worker departed, so that the scheduler can still collect the final
  failures. A registration after that, or after every worker has gone, starts a fresh state
  (a restarted engine counts steps from 0 again).

Everything here runs on the event loop; nothing blocks and nothing is shared with threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from kvsidecar.core.aggregator import CompletionAggregator
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Collect, Collected, Report, Reported
from kvsidecar.wire.reports import PeerCompletion, WorkerReport
from kvsidecar.wire.types import BufferSetRef, WorkerRef

__all__ = ["MAX_COLLECT_WAIT_S", "CompletionService"]

log = logging.getLogger("kvsidecar.completions")

MAX_COLLECT_WAIT_S = 60.0
"""Longest wait one `Collect` may ask for: a scheduler step is milliseconds, not minutes."""

V = TypeVar("V")

_HEAD = ""
"""Worker id of the placeholder report that carries a collect's step into the aggregator's output
slot. No worker has it: registered workers are named by `WorkerRef.label`, never empty."""


@dataclass(slots=True)
class _Accrual:
    """Completions the daemon observed for one worker since the last collect."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
        )

    def merged_into(self, report: WorkerReport) -> WorkerReport:
        """``report`` with these completions added (a request named by both counts once)."""
        return msgspec.structs.replace(
            report,
            finished_sending=report.finished_sending | self.finished_sending,
            finished_recving=report.finished_recving | self.finished_recving,
            failed_recving=report.failed_recving | self.failed_recving,
            invalid_block_ids=report.invalid_block_ids | self.invalid_block_ids,
        )


@dataclass(eq=False)
class _Engine:
    """Aggregation state of one engine."""

    engine_id: str
    aggregator: CompletionAggregator
    live: dict[str, int] = field(default_factory=dict)
    """Registered workers (label -> registration epoch)."""
    latest: dict[str, int] = field(default_factory=dict)
    """Highest step each live worker has reported (what a collect waits for)."""
    buffered: dict[int, dict[str, WorkerReport]] = field(default_factory=dict)
    """Uncollected reports: step -> worker label -> report."""
    accrued: dict[str, _Accrual] = field(default_factory=dict)
    collected_upto: int | None = None
    included: collections.OrderedDict[int, frozenset[str]] = field(
        default_factory=collections.OrderedDict
    )
    """Collected steps (recent ones) -> the workers whose own report for it was counted."""
    answers: collections.OrderedDict[int, Collected] = field(
        default_factory=collections.OrderedDict
    )
    """Recent collect answers, for a retried collect."""
    failed_since: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    drop: asyncio.TimerHandle | None = None
    closed: bool = False

    def notify(self) -> None:
        """Wake every collect waiting on this engine (they re-check their condition)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def accrual(self, label: str) -> _Accrual:
        acc = self.accrued.get(label)
        if acc is None:
            acc = self.accrued[label] = _Accrual()
        return acc

    def missing(self, step: int) -> list[str]:
        """Live workers that have not reported ``step`` (or a later one) yet."""
        return sorted(w for w in self.live if self.latest.get(w, -1) < step)


class CompletionService:
    """Per-engine completion aggregation for one daemon (see the module docstring).

    The daemon calls `worker_registered` / `worker_departed` as workers come and go,
    `move_finished` and `on_peer_event` as transfers end, and routes the `Report` and `Collect`
    commands to `report` and `collect`.
    """

    def __init__(
        self,
        *,
        retain_s: float = 60.0,
        max_pending_steps: int = 1024,
        history: int = 64,
        answers: int = 16,
    ) -> None:
        """``retain_s``: how long an engine's state outlives its last worker.

        ``max_pending_steps`` bounds the distinct uncollected steps per engine (a runaway worker
        gets ``busy``); ``history`` collected steps are remembered to tell a duplicate from a late
        report, and the last ``answers`` collect answers are kept for retries.
        """
        self.retain_s = retain_s
        self.max_pending_steps = max_pending_steps
        self.history = history
        self.max_answers = answers
        self.engines: dict[str, _Engine] = {}
        # Microseconds since the Unix epoch: later than any epoch an earlier daemon handed out.
        self._next_epoch = time.time_ns() // 1000
        self.reports_total = 0
        self.duplicate_reports_total = 0
        self.collects_total = 0

    def worker_registered(
        self, ref: WorkerRef, expected_finished_count: int, *, epoch: int | None = None
    ) -> int:
        """Record a new registration of ``ref``; return its epoch.

        ``epoch`` is the daemon's registration epoch when it has one (`Worker.epoch`), else one
        is drawn here. ``expected_finished_count`` (the engine's worker count) seeds a fresh
        engine state; an engine whose workers had all gone starts afresh (a restarted engine
        counts steps anew).
        """
        st = self.engines.get(ref.engine_id)
        if st is not None and not st.live:
            self._drop(st)
            st = None
        if st is None:
            st = _Engine(ref.engine_id, CompletionAggregator(max(1, expected_finished_count)))
            self.engines[ref.engine_id] = st
        label = ref.label()
        if label in st.aggregator.dead_workers:
            # Back under the same name: counted again for requests first reported from now on.
            st.aggregator.forget_worker(label)
        st.latest.pop(label, None)
        if epoch is None:
            self._next_epoch += 1
            epoch = self._next_epoch
        st.live[label] = epoch
        st.notify()
        return epoch

    def worker_departed(self, ref: WorkerRef, why: str) -> None:
        """Fail a departed worker: complete what waits for it (receiving requests as failed)."""
        st = self.engines.get(ref.engine_id)
        label = ref.label()
        if st is None or st.live.pop(label, None) is None:
            return
        st.latest.pop(label, None)
        st.accrued.pop(label, None)
        for bucket in st.buffered.values():
            bucket.pop(label, None)
        failure = st.aggregator.fail_worker(label)
        st.failed_since.append(label)
        if failure.sending or failure.recving:
            log.info(
                "%s departed (%s): %d sending and %d receiving requests completed on its behalf",
                label,
                why,
                len(failure.sending),
                len(failure.recving),
            )
        if not st.live:
            loop = asyncio.get_running_loop()
            st.drop = loop.call_later(self.retain_s, self._drop, st)
        st.notify()

    def _drop(self, st: _Engine) -> None:
        if st.drop is not None:
            st.drop.cancel()
            st.drop = None
        st.closed = True
        if self.engines.get(st.engine_id) is st:
            del self.engines[st.engine_id]
        st.notify()

    def close(self) -> None:
        """Forget every engine (daemon shutdown); waiting collects end with ``unknown_engine``."""
        for st in list(self.engines.values()):
            self._drop(st)

    def move_finished(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        request_ids: Iterable[str],
        *,
        ok: bool,
        dst_ids: Iterable[int] = (),
    ) -> None:
        """Credit a finished (or failed) move's requests to the workers it ran for."""
        ids = set(request_ids)
        if not ids:
            return
        if src.medium == "device":
            # An offload or a local send: the source's blocks may be reused, ok or not.
            acc = self._accrual_of(src.worker)
            if acc is not None:
                acc.finished_sending |= ids
        if dst.medium == "device":
            acc = self._accrual_of(dst.worker)
            if acc is not None:
                acc.finished_recving |= ids
                if not ok:
                    acc.failed_recving |= ids
                    acc.invalid_block_ids.update(int(i) for i in dst_ids)

    def on_peer_event(self, event: PeerCompletion) -> None:
        """Part of the daemon's `PeerService` sink: credit a peer outcome to its worker (or all)."""
        st = self.engines.get(event.engine_id)
        if st is None:
            log.debug("peer event for engine %r without aggregation state", event.engine_id)
            return
        targets = [event.worker.label()] if event.worker is not None else list(st.live)
        for label in targets:
            if label not in st.live:
                continue
            acc = st.accrual(label)
            acc.finished_sending |= event.finished_sending
            # A failed receive has ended too: the aggregator holds failures until the request
            # shows as finished-receiving, so both sets name it.
            acc.finished_recving |= event.finished_recving | event.failed_recving
            acc.failed_recving |= event.failed_recving
            acc.invalid_block_ids |= event.invalid_block_ids

    def _accrual_of(self, ref: WorkerRef) -> _Accrual | None:
        st = self.engines.get(ref.engine_id)
        label = ref.label()
        if st is None or label not in st.live:
            return None
        return st.accrual(label)

    def report(self, req: Report) -> Reported:
        """Buffer one worker's report for its step (typed errors; nothing changed on error)."""
        ref = req.worker
        st = self.engines.get(ref.engine_id)
        if st is None:
            raise SidecarError("unknown_engine", f"no engine {ref.engine_id!r} is registered")
        label = ref.label()
        epoch = st.live.get(label)
        if epoch is None:
            raise SidecarError("unknown_worker", f"no worker {label} is registered")
        if req.epoch != epoch:
            raise SidecarError(
                "stale_epoch",
                f"{label}: report of epoch {req.epoch}, the current registration is epoch {epoch}",
            )
        step = req.step
        if step < 0 or req.expected_finished_count < 0:
            raise SidecarError("invalid_message", "step and expected_finished_count must be >= 0")
        if st.collected_upto is not None and step <= st.collected_upto:
            if label in st.included.get(step, ()):
                self.duplicate_reports_total += 1
                return Reported(id=req.id, duplicate=True)
            raise SidecarError(
                "step_collected",
                f"{label}: step {step} of {ref.engine_id!r} was collected (up to step "
                f"{st.collected_upto}); send this report's content with the next step",
            )
        bucket = st.buffered.get(step)
        if bucket is None:
            if len(st.buffered) >= self.max_pending_steps:
                raise SidecarError(
                    "busy",
                    f"{ref.engine_id!r} has {len(st.buffered)} uncollected steps; collect first",
                )
            bucket = st.buffered[step] = {}
        elif label in bucket:
            self.duplicate_reports_total += 1
            return Reported(id=req.id, duplicate=True)
        bucket[label] = WorkerReport(
            worker_id=label,
            step=step,
            finished_sending=req.finished_sending,
            finished_recving=req.finished_recving,
            invalid_block_ids=req.invalid_block_ids,
            failed_recving=req.failed_recving,
            expected_finished_count=req.expected_finished_count,
            kv_connector_stats=req.kv_connector_stats,
            kv_cache_events=req.kv_cache_events,
        )
        if step > st.latest.get(label, -1):
            st.latest[label] = step
        self.reports_total += 1
        st.notify()
        return Reported(id=req.id)

    async def collect(self, req: Collect) -> Collected:
        """Wait (bounded) for the step's reports, then aggregate every step up to it."""
        if req.step < 0:
            raise SidecarError("invalid_message", "step must be >= 0")
        if not 0.0 <= req.timeout_s <= MAX_COLLECT_WAIT_S:  # also refuses NaN
            raise SidecarError(
                "invalid_message", f"timeout_s must be within 0..{MAX_COLLECT_WAIT_S:g}"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout_s
        while True:
            st = self._engine(req.engine_id)
            answer = self._already(st, req)
            if answer is not None:
                return answer
            left = deadline - loop.time()
            if not st.missing(req.step) or left <= 0:
                break
            changed = st.changed
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        return self._aggregate(st, req)

    def _engine(self, engine_id: str) -> _Engine:
        st = self.engines.get(engine_id)
        if st is None or st.closed:
            raise SidecarError("unknown_engine", f"no engine {engine_id!r} is registered")
        return st

    @staticmethod
    def _already(st: _Engine, req: Collect) -> Collected | None:
        """Return the earlier answer for a collected step, None if it is not collected yet."""
        if st.collected_upto is None or req.step > st.collected_upto:
            return None
        answer = st.answers.get(req.step)
        if answer is None:
            raise SidecarError(
                "step_collected",
                f"step {req.step} of {req.engine_id!r} was collected (up to step "
                f"{st.collected_upto}) and its answer is no longer kept",
            )
        return msgspec.structs.replace(answer, id=req.id)

    def _aggregate(self, st: _Engine, req: Collect) -> Collected:
        step = req.step
        steps = sorted(k for k in st.buffered if k <= step)
        reports: list[WorkerReport | None] = [WorkerReport(worker_id=_HEAD, step=step)]
        last: dict[str, int] = {}  # worker -> index of its newest report in `reports`
        for k in steps:
            bucket = st.buffered.pop(k)
            for label in sorted(bucket):
                last[label] = len(reports)
                reports.append(bucket[label])
            _remember(st.included, k, frozenset(bucket), self.history)
        for label, acc in st.accrued.items():
            if not acc:
                continue
            index = last.get(label)
            if index is None:
                # Its own report for this step (if it ever sends one) will get step_collected, so
                # this synthetic one under its name cannot shadow real content.
                reports.append(acc.merged_into(WorkerReport(worker_id=label, step=step)))
            else:
                own = reports[index]
                assert own is not None
                reports[index] = acc.merged_into(own)
        st.accrued.clear()
        output = st.aggregator.aggregate(reports, 0)
        assert output is not None  # the head slot is never None
        answer = Collected(
            id=req.id,
            output=output,
            missing=st.missing(step),
            failed_workers=st.failed_since,
        )
        st.failed_since = []
        st.collected_upto = step
        _remember(st.answers, step, answer, self.max_answers)
        self.collects_total += 1
        return answer

    def pending_requests(self) -> dict[str, int]:
        """Return how many requests each engine's aggregator waits on (the metrics gauge)."""
        return {e: st.aggregator.pending_requests() for e, st in self.engines.items()}

    def epoch_of(self, ref: WorkerRef) -> int | None:
        """Return the current registration epoch of ``ref``, None if it is not registered."""
        st = self.engines.get(ref.engine_id)
        return None if st is None else st.live.get(ref.label())


def _remember(memory: collections.OrderedDict[int, V], key: int, value: V, limit: int) -> None:
    """Insert into a bounded, oldest-first memory."""
    memory[key] = value
    while len(memory) > limit:
        memory.popitem(last=False)
