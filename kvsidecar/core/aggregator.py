"""Per-engine completion aggregation: when every worker has finished a request.

A request is finished-sending (or finished-receiving) once ``expected_finished_count`` worker
reports have named it. `CompletionAggregator` keeps the reference engine's semantics
(``KVOutputAggregator``) and adds what a daemon needs on top of them.

Reference semantics, kept as they are:

- a call whose output-rank slot is ``None`` returns ``None`` and consumes nothing;
- each request id starts at the expected count current when it is first reported and finishes
  when that many reports have named it; a report with a positive ``expected_finished_count``
  different from the current one changes it before that report's ids are counted (requests
  already waiting keep their count);
- transfer stats and cache events are merged in report order, ``invalid_block_ids`` united;
- ``failed_recving`` ids wait until the request shows as finished-receiving in a call, then leave
  in that call's output;
- empty finished sets are ``None``.

Added here:

- **Duplicates.** A report is identified by ``(worker_id, step)`` and counts at most once, whether
  the copy arrives in the same call or a later one. Per worker the aggregator keeps the highest
  step accepted and a 64-step window of which steps below it were accepted (anti-replay window,
  as in IPsec): memory is two ints per worker. A step more than 63 below the highest is dropped
  as stale; workers send their steps in order, so only a duplicate can be that old. A worker
  whose step counter restarts (a new process under the same id) must be `forget_worker`-ed first.
- **Missing slots.** ``None`` in a slot other than the output rank means "no report from that
  worker in this call" and is skipped (the reference requires every slot to be filled).
- **Dead workers.** `fail_worker` reports on a dead worker's behalf: every waiting request it has
  not named is credited with its report, requests that reach their count are emitted by the next
  `aggregate` call (receiving ones as failed), requests first reported later are credited too,
  and the dead worker's own late reports are dropped. A receiving request that finishes with the
  help of such a credit is always failed: the dead worker never received its part.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsidecar.wire.reports import AggregatedOutput, CacheEvents, TransferStats, WorkerReport

DEDUP_WINDOW = 64
"""Steps per worker below the highest accepted step that are still told apart from duplicates."""

_WINDOW_MASK = (1 << DEDUP_WINDOW) - 1


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """What `CompletionAggregator.fail_worker` did on a dead worker's behalf.

    ``recving`` lists the receiving requests that were waiting for the worker: they will all be
    reported as failed, so the daemon should invalidate their local blocks
    (`CompletionAggregator.add_invalid_blocks`) before the next `CompletionAggregator.aggregate`.
    """

    worker_id: str
    sending: frozenset[str]
    """Sending requests credited with the dead worker's report."""
    recving: frozenset[str]
    """Receiving requests credited with the dead worker's report (all will fail)."""


class _Waiting:
    """Bookkeeping for one request that still waits for reports in one direction."""

    __slots__ = ("credited", "remaining", "reporters")

    def __init__(self, remaining: int, reporters: int, credited: bool) -> None:
        self.remaining = remaining
        self.reporters = reporters
        """Bit set of the workers that named it or were credited (see ``_worker_bit``)."""
        self.credited = credited
        """Whether a dead worker's report was credited."""


class CompletionAggregator:
    """Merges the workers' `WorkerReport`s of one engine into one `AggregatedOutput` per call.

    Not thread-safe: call it from one thread (the daemon's event loop).
    """

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError(
                f"expected_finished_count must be >= 1, got {expected_finished_count}."
            )
        self._expected = expected_finished_count
        self._sending: dict[str, _Waiting] = {}
        self._recving: dict[str, _Waiting] = {}
        self._failed_pending: set[str] = set()
        # Completions and invalid blocks produced between calls, emitted by the next call.
        self._queued_sending: set[str] = set()
        self._queued_recving: set[str] = set()
        self._queued_invalid: set[int] = set()
        # Duplicate suppression: worker id -> (highest accepted step, window bits).
        self._windows: dict[str, tuple[int, int]] = {}
        self._bits: dict[str, int] = {}
        self._dead: set[str] = set()
        self._dead_mask = 0
        self._duplicates = 0
        self._stale = 0
        self._fenced = 0

    @property
    def expected_finished_count(self) -> int:
        """How many reports a request first reported from now on must collect."""
        return self._expected

    @property
    def duplicate_reports(self) -> int:
        """Reports dropped because the same ``(worker_id, step)`` was already counted."""
        return self._duplicates

    @property
    def stale_reports(self) -> int:
        """Reports dropped because their step was below the duplicate window (even duplicates)."""
        return self._stale

    @property
    def fenced_reports(self) -> int:
        """Reports dropped because their worker had been failed with `fail_worker`."""
        return self._fenced

    @property
    def dead_workers(self) -> frozenset[str]:
        """Workers failed with `fail_worker` and not forgotten since."""
        return frozenset(self._dead)

    def pending_requests(self) -> int:
        """How many distinct requests wait for more reports (sending, receiving or both)."""
        if not self._sending or not self._recving:
            return len(self._sending) + len(self._recving)
        return len(self._sending.keys() | self._recving.keys())

    def aggregate(
        self, reports: Sequence[WorkerReport | None], output_rank: int = 0
    ) -> AggregatedOutput | None:
        """Count one batch of reports and return what the scheduler sees for it.

        ``reports[output_rank]`` decides the output's ``step``; when it is ``None`` nothing is
        consumed and ``None`` is returned. Dropped reports (duplicates, stale, fenced) take no
        part at all: no ids, stats, events, blocks, failures or expected-count changes.
        """
        head = reports[output_rank]
        if head is None:
            return None
        finished_sending, self._queued_sending = self._queued_sending, set()
        finished_recving, self._queued_recving = self._queued_recving, set()
        invalid_block_ids, self._queued_invalid = self._queued_invalid, set()
        stats: TransferStats | None = None
        events: CacheEvents | None = None
        for report in reports:
            if report is None or not self._accept(report):
                continue
            expected = report.expected_finished_count
            if expected > 0:
                self._expected = expected
            bit = self._worker_bit(report.worker_id)
            if report.finished_sending:
                self._count(report.finished_sending, self._sending, finished_sending, bit, False)
            if report.finished_recving:
                self._count(report.finished_recving, self._recving, finished_recving, bit, True)
            if report.kv_connector_stats is not None:
                stats = (
                    report.kv_connector_stats
                    if stats is None
                    else stats.aggregate(report.kv_connector_stats)
                )
            if report.kv_cache_events is not None:
                events = (
                    report.kv_cache_events
                    if events is None
                    else events.merge(report.kv_cache_events)
                )
            if report.invalid_block_ids:
                invalid_block_ids |= report.invalid_block_ids
            if report.failed_recving:
                self._failed_pending |= report.failed_recving
        failed_recving: frozenset[str] = frozenset()
        if self._failed_pending and finished_recving:
            failed_recving = frozenset(self._failed_pending & finished_recving)
            self._failed_pending -= failed_recving
        return AggregatedOutput(
            step=head.step,
            finished_sending=frozenset(finished_sending) if finished_sending else None,
            finished_recving=frozenset(finished_recving) if finished_recving else None,
            invalid_block_ids=frozenset(invalid_block_ids),
            failed_recving=failed_recving,
            expected_finished_count=self._expected,
            kv_connector_stats=stats,
            kv_cache_events=events,
        )

    def _accept(self, report: WorkerReport) -> bool:
        """Decide whether a report counts, and remember it if so (the duplicate rule)."""
        worker_id = report.worker_id
        if worker_id in self._dead:
            self._fenced += 1
            return False
        step = report.step
        window = self._windows.get(worker_id)
        if window is None:
            self._windows[worker_id] = (step, 1)
            return True
        top, seen = window
        if step > top:
            shift = step - top
            seen = ((seen << shift) | 1) & _WINDOW_MASK if shift < DEDUP_WINDOW else 1
            self._windows[worker_id] = (step, seen)
            return True
        offset = top - step
        if offset >= DEDUP_WINDOW:
            self._stale += 1
            return False
        flag = 1 << offset
        if seen & flag:
            self._duplicates += 1
            return False
        self._windows[worker_id] = (top, seen | flag)
        return True

    def _count(
        self,
        request_ids: Iterable[str],
        waiting: dict[str, _Waiting],
        finished: set[str],
        bit: int,
        recving: bool,
    ) -> None:
        """Count one report's naming of each request; move those that reach zero to finished."""
        for request_id in request_ids:
            entry = waiting.get(request_id)
            if entry is None:
                # Dead workers will never name it: credit them from the start.
                entry = _Waiting(
                    self._expected - len(self._dead), self._dead_mask, bool(self._dead)
                )
                waiting[request_id] = entry
            entry.remaining -= 1
            entry.reporters |= bit
            if entry.remaining <= 0:
                del waiting[request_id]
                finished.add(request_id)
                if recving and entry.credited:
                    self._failed_pending.add(request_id)

    def _worker_bit(self, worker_id: str) -> int:
        # Bits are never reused, so a waiting request's reporter set stays truthful even after
        # its worker is forgotten; there is one per worker id the engine ever used.
        bit = self._bits.get(worker_id)
        if bit is None:
            bit = self._bits[worker_id] = 1 << len(self._bits)
        return bit

    def fail_worker(self, worker_id: str) -> WorkerFailure:
        """Declare a worker dead and report on its behalf from now on.

        Every waiting request the worker has not named is credited with its report; those that
        reach their count are emitted by the next `aggregate` call, receiving ones as failed.
        Requests first reported later are credited too, and the worker's own reports are dropped
        until `forget_worker`. Failing a worker that is already dead changes nothing and returns
        empty sets.
        """
        if worker_id in self._dead:
            return WorkerFailure(worker_id, frozenset(), frozenset())
        bit = self._worker_bit(worker_id)
        self._dead.add(worker_id)
        self._dead_mask |= bit
        self._windows.pop(worker_id, None)
        sending = self._credit(self._sending, self._queued_sending, bit, recving=False)
        recving = self._credit(self._recving, self._queued_recving, bit, recving=True)
        return WorkerFailure(worker_id, sending, recving)

    def _credit(
        self, waiting: dict[str, _Waiting], queued: set[str], bit: int, recving: bool
    ) -> frozenset[str]:
        credited = []
        for request_id, entry in list(waiting.items()):
            if entry.reporters & bit:
                continue
            credited.append(request_id)
            entry.reporters |= bit
            entry.credited = True
            entry.remaining -= 1
            if entry.remaining <= 0:
                del waiting[request_id]
                queued.add(request_id)
                if recving:
                    self._failed_pending.add(request_id)
        return frozenset(credited)

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's state so that it can (re)join with a fresh step counter.

        A dead worker stops being credited for requests first reported from now on; requests
        that were credited keep their credit. Its duplicate window is reset.
        """
        if worker_id in self._dead:
            self._dead.discard(worker_id)
            self._dead_mask &= ~self._bits[worker_id]
        self._windows.pop(worker_id, None)

    def add_invalid_blocks(self, block_ids: Iterable[int]) -> None:
        """Queue local block ids to report as invalid in the next `aggregate` output."""
        self._queued_invalid.update(block_ids)
