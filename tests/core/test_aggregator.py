"""CompletionAggregator against a plain counting model, plus the reference's behaviours by example.

The model keeps everything in the most literal form: the full set of steps seen per worker, and
per waiting request the list of workers that named it and the set of dead workers credited.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvsidecar.core.aggregator import DEDUP_WINDOW, CompletionAggregator, WorkerFailure
from kvsidecar.wire.reports import (
    AggregatedOutput,
    CacheEvent,
    CacheEvents,
    TransferStats,
    WorkerReport,
)

# ---- the model ----


@dataclass
class Waiting:
    target: int
    reporters: list[str] = field(default_factory=list)
    credits: set[str] = field(default_factory=set)

    def done(self) -> bool:
        return len(self.reporters) + len(self.credits) >= self.target


@dataclass
class Model:
    expected: int
    waiting: dict[str, dict[str, Waiting]] = field(default_factory=lambda: {"send": {}, "recv": {}})
    failed_pending: set[str] = field(default_factory=set)
    steps_seen: dict[str, set[int]] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    queued: dict[str, set[str]] = field(default_factory=lambda: {"send": set(), "recv": set()})
    queued_invalid: set[int] = field(default_factory=set)
    duplicates: int = 0
    stale: int = 0
    fenced: int = 0

    def accept(self, report: WorkerReport) -> bool:
        if report.worker_id in self.dead:
            self.fenced += 1
            return False
        seen = self.steps_seen.setdefault(report.worker_id, set())
        # Too old to tell apart from a duplicate: stale, whatever it is.
        if seen and report.step <= max(seen) - DEDUP_WINDOW:
            self.stale += 1
            return False
        if report.step in seen:
            self.duplicates += 1
            return False
        seen.add(report.step)
        return True

    def finish(self, direction: str, request_id: str, into: set[str]) -> None:
        entry = self.waiting[direction].pop(request_id)
        into.add(request_id)
        if direction == "recv" and entry.credits:
            self.failed_pending.add(request_id)

    def aggregate(
        self, reports: list[WorkerReport | None], output_rank: int
    ) -> AggregatedOutput | None:
        head = reports[output_rank]
        if head is None:
            return None
        finished = {"send": self.queued["send"], "recv": self.queued["recv"]}
        self.queued = {"send": set(), "recv": set()}
        invalid, self.queued_invalid = self.queued_invalid, set()
        stats = events = None
        for report in reports:
            if report is None or not self.accept(report):
                continue
            if report.expected_finished_count > 0:
                self.expected = report.expected_finished_count
            for direction, ids in (
                ("send", report.finished_sending),
                ("recv", report.finished_recving),
            ):
                for request_id in ids:
                    entry = self.waiting[direction].setdefault(
                        request_id, Waiting(self.expected, credits=set(self.dead))
                    )
                    entry.reporters.append(report.worker_id)
                    if entry.done():
                        self.finish(direction, request_id, finished[direction])
            if report.kv_connector_stats is not None:
                if stats is None:
                    stats = dict(report.kv_connector_stats.counters)
                else:
                    for k, v in report.kv_connector_stats.counters.items():
                        stats[k] = stats.get(k, 0.0) + v
            if report.kv_cache_events is not None:
                if events is None:
                    events = (
                        list(report.kv_cache_events.events),
                        report.kv_cache_events.num_workers,
                    )
                else:
                    events = (
                        events[0] + list(report.kv_cache_events.events),
                        events[1] + report.kv_cache_events.num_workers,
                    )
            invalid |= report.invalid_block_ids
            self.failed_pending |= report.failed_recving
        failed = self.failed_pending & finished["recv"]
        self.failed_pending -= failed
        return AggregatedOutput(
            step=head.step,
            finished_sending=frozenset(finished["send"]) or None,
            finished_recving=frozenset(finished["recv"]) or None,
            invalid_block_ids=frozenset(invalid),
            failed_recving=frozenset(failed),
            expected_finished_count=self.expected,
            kv_connector_stats=None if stats is None else TransferStats(stats),
            kv_cache_events=None if events is None else CacheEvents(tuple(events[0]), events[1]),
        )

    def fail_worker(self, worker_id: str) -> WorkerFailure:
        if worker_id in self.dead:
            return WorkerFailure(worker_id, frozenset(), frozenset())
        self.dead.add(worker_id)
        self.steps_seen.pop(worker_id, None)
        credited: dict[str, set[str]] = {"send": set(), "recv": set()}
        for direction in ("send", "recv"):
            for request_id, entry in list(self.waiting[direction].items()):
                if worker_id in entry.reporters or worker_id in entry.credits:
                    continue
                entry.credits.add(worker_id)
                credited[direction].add(request_id)
                if entry.done():
                    self.finish(direction, request_id, self.queued[direction])
        return WorkerFailure(worker_id, frozenset(credited["send"]), frozenset(credited["recv"]))

    def forget_worker(self, worker_id: str) -> None:
        self.dead.discard(worker_id)
        self.steps_seen.pop(worker_id, None)

    def pending(self) -> int:
        return len(set(self.waiting["send"]) | set(self.waiting["recv"]))


# ---- property test over random histories ----

REQUESTS = [f"r{i}" for i in range(6)]
request_sets = st.frozensets(st.sampled_from(REQUESTS), max_size=3)


@st.composite
def fresh_report(draw: st.DrawFn, worker_id: str, top: int | None) -> WorkerReport:
    if top is None:
        step = draw(st.integers(0, 3))
    else:
        step = draw(
            st.one_of(
                st.integers(top + 1, top + 3),  # in order
                st.just(top + DEDUP_WINDOW + 5),  # a jump that makes old steps stale
                st.integers(top - DEDUP_WINDOW - 3, top - 1),  # late, inside or outside window
            )
        )
    stats = draw(
        st.none()
        | st.builds(
            TransferStats,
            st.dictionaries(st.sampled_from(["bytes", "ops"]), st.integers(0, 9).map(float)),
        )
    )
    events = draw(
        st.none()
        | st.builds(
            CacheEvents,
            st.lists(
                st.builds(CacheEvent, st.sampled_from(["stored", "removed"]), st.just((1,))),
                max_size=2,
            ).map(tuple),
        )
    )
    return WorkerReport(
        worker_id=worker_id,
        step=step,
        finished_sending=draw(request_sets),
        finished_recving=draw(request_sets),
        invalid_block_ids=draw(st.frozensets(st.integers(0, 9), max_size=2)),
        failed_recving=draw(st.frozensets(st.sampled_from(REQUESTS), max_size=1)),
        expected_finished_count=draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4])),
        kv_connector_stats=stats,
        kv_cache_events=events,
    )


# No shrinking: shrinking st.data() histories takes minutes; the failure report lists every draw.
@settings(
    max_examples=120,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data(), num_workers=st.integers(1, 4), expected=st.integers(1, 4))
def test_matches_model(data: st.DataObject, num_workers: int, expected: int) -> None:
    workers = [f"w{i}" for i in range(num_workers)]
    agg = CompletionAggregator(expected)
    model = Model(expected)
    sent: dict[str, list[WorkerReport]] = {w: [] for w in workers}
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["call"] * 6 + ["fail", "forget", "invalid"]))
        if op == "fail":
            w = data.draw(st.sampled_from(workers))
            assert agg.fail_worker(w) == model.fail_worker(w)
        elif op == "forget":
            w = data.draw(st.sampled_from(workers))
            agg.forget_worker(w)
            model.forget_worker(w)
            if data.draw(st.booleans()):
                sent[w] = []  # the worker restarts its step counter
        elif op == "invalid":
            blocks = data.draw(st.frozensets(st.integers(100, 110), max_size=3))
            agg.add_invalid_blocks(blocks)
            model.queued_invalid |= blocks
        else:
            slots: list[WorkerReport | None] = []
            for w in workers:
                kind = data.draw(st.sampled_from(["fresh", "fresh", "none", "again"]))
                if kind == "again" and sent[w]:
                    slots.append(data.draw(st.sampled_from(sent[w])))
                elif kind == "none":
                    slots.append(None)
                else:
                    top = max((r.step for r in sent[w]), default=None)
                    report = data.draw(fresh_report(w, top))
                    sent[w].append(report)
                    slots.append(report)
            # Same-call duplicates: the same delivery twice in one batch.
            for _ in range(data.draw(st.integers(0, 2))):
                slots.append(data.draw(st.sampled_from(slots)))
            output_rank = data.draw(st.integers(0, len(slots) - 1))
            assert agg.aggregate(slots, output_rank) == model.aggregate(slots, output_rank)
        assert agg.pending_requests() == model.pending()
        assert agg.expected_finished_count == model.expected
        assert agg.dead_workers == model.dead
        assert (agg.duplicate_reports, agg.stale_reports, agg.fenced_reports) == (
            model.duplicates,
            model.stale,
            model.fenced,
        )


# ---- reference behaviours by example ----


def rep(worker: str, step: int, **kwargs: object) -> WorkerReport:
    return WorkerReport(worker, step, **kwargs)  # type: ignore[arg-type]


def S(*ids: str) -> frozenset[str]:
    return frozenset(ids)


def test_counts_across_workers_and_steps() -> None:
    agg = CompletionAggregator(2)
    out = agg.aggregate(
        [rep("a", 0, finished_sending=S("x"), finished_recving=S("y")), rep("b", 0)]
    )
    assert out == AggregatedOutput(step=0, expected_finished_count=2)
    assert out.finished_sending is None and out.finished_recving is None
    assert agg.pending_requests() == 2
    out = agg.aggregate(
        [rep("a", 1), rep("b", 1, finished_sending=S("x"), finished_recving=S("y"))]
    )
    assert out is not None
    assert (out.step, out.finished_sending, out.finished_recving) == (1, S("x"), S("y"))
    assert agg.pending_requests() == 0


def test_empty_output_rank_returns_none_and_consumes_nothing() -> None:
    agg = CompletionAggregator(1)
    report = rep("b", 0, finished_recving=S("x"))
    assert agg.aggregate([None, report]) is None
    assert agg.pending_requests() == 0
    # Nothing was marked seen, so the same delivery counts when the output rank is there.
    out = agg.aggregate([None, report], output_rank=1)
    assert out is not None and out.finished_recving == S("x")


def test_other_none_slots_are_skipped() -> None:
    agg = CompletionAggregator(2)
    out = agg.aggregate([rep("a", 0, finished_sending=S("x")), None])
    assert out is not None and out.finished_sending is None
    out = agg.aggregate([rep("a", 1), None, rep("b", 0, finished_sending=S("x"))])
    assert out is not None and out.finished_sending == S("x")


def test_expected_count_changes_before_counting_that_report() -> None:
    agg = CompletionAggregator(3)
    out = agg.aggregate([rep("a", 0, finished_recving=S("old"))])
    assert out is not None and out.finished_recving is None
    out = agg.aggregate([rep("a", 1, finished_recving=S("new"), expected_finished_count=1)])
    assert out is not None
    assert out.finished_recving == S("new")
    assert out.expected_finished_count == 1
    # "old" keeps the count it started with: two more reports.
    out = agg.aggregate([rep("b", 1, finished_recving=S("old"))])
    assert out is not None and out.finished_recving is None
    out = agg.aggregate([rep("c", 1, finished_recving=S("old"))])
    assert out is not None and out.finished_recving == S("old")


def test_failed_recving_waits_for_finished_recving() -> None:
    agg = CompletionAggregator(2)
    out = agg.aggregate(
        [
            rep("a", 0, finished_recving=S("x"), failed_recving=S("x"), invalid_block_ids={3}),
            rep("b", 0),
        ]
    )
    assert out is not None
    assert out.failed_recving == frozenset() and out.invalid_block_ids == {3}
    out = agg.aggregate([rep("a", 1), rep("b", 1, finished_recving=S("x"))])
    assert out is not None
    assert out.finished_recving == S("x") and out.failed_recving == S("x")
    assert out.invalid_block_ids == frozenset()


def test_failure_after_completion_waits_for_the_next_completion_of_that_id() -> None:
    agg = CompletionAggregator(1)
    out = agg.aggregate([rep("a", 0, finished_recving=S("x"))])
    assert out is not None and out.failed_recving == frozenset()
    out = agg.aggregate([rep("a", 1, failed_recving=S("x"))])
    assert out is not None and out.failed_recving == frozenset()
    out = agg.aggregate([rep("a", 2, finished_recving=S("x"))])
    assert out is not None and out.failed_recving == S("x")


def test_stats_and_events_merge_in_order() -> None:
    agg = CompletionAggregator(1)
    e1 = CacheEvents((CacheEvent("stored", (1,)),))
    e2 = CacheEvents((CacheEvent("removed", (2,)),))
    out = agg.aggregate(
        [
            rep("a", 0, kv_cache_events=e1),
            rep("b", 0, kv_connector_stats=TransferStats({"bytes": 1.0})),
            rep("c", 0, kv_connector_stats=TransferStats({"bytes": 2.0, "ops": 1.0})),
            rep("d", 0, kv_cache_events=e2),
        ]
    )
    assert out is not None
    assert out.kv_connector_stats == TransferStats({"bytes": 3.0, "ops": 1.0})
    assert out.kv_cache_events == CacheEvents(e1.events + e2.events, 2)


def test_constructor_rejects_nonpositive_count() -> None:
    with pytest.raises(ValueError, match="expected_finished_count"):
        CompletionAggregator(0)


# ---- duplicates ----


def test_duplicate_in_same_call_counts_once() -> None:
    agg = CompletionAggregator(2)
    r = rep("a", 0, finished_sending=S("x"), kv_connector_stats=TransferStats({"n": 1.0}))
    out = agg.aggregate([r, r])
    assert out is not None
    assert out.finished_sending is None
    assert out.kv_connector_stats == TransferStats({"n": 1.0})
    assert agg.duplicate_reports == 1


def test_duplicate_in_later_call_counts_once() -> None:
    agg = CompletionAggregator(2)
    r = rep("a", 5, finished_sending=S("x"), invalid_block_ids={1}, failed_recving=S("y"))
    agg.aggregate([r])
    out = agg.aggregate([r])
    assert out is not None
    assert out.finished_sending is None and out.invalid_block_ids == frozenset()
    assert out.step == 5  # a duplicate at the output rank still yields the call's output
    assert agg.pending_requests() == 1
    assert agg.duplicate_reports == 1


def test_out_of_order_within_window_is_accepted_and_older_is_stale() -> None:
    agg = CompletionAggregator(1)
    agg.aggregate([rep("a", 100)])
    out = agg.aggregate([rep("a", 100 - DEDUP_WINDOW + 1, finished_recving=S("late"))])
    assert out is not None and out.finished_recving == S("late")
    out = agg.aggregate([rep("a", 100 - DEDUP_WINDOW, finished_recving=S("stale"))])
    assert out is not None and out.finished_recving is None
    assert agg.stale_reports == 1


def test_window_after_a_jump_accepts_steps_just_below() -> None:
    agg = CompletionAggregator(1)
    agg.aggregate([rep("a", 0)])
    agg.aggregate([rep("a", 1000)])
    for step in (999, 1000 - DEDUP_WINDOW + 1):
        out = agg.aggregate([rep("a", step, finished_sending=S(f"x{step}"))])
        assert out is not None and out.finished_sending == S(f"x{step}")
    assert agg.duplicate_reports == agg.stale_reports == 0


def test_forget_worker_allows_step_counter_restart() -> None:
    agg = CompletionAggregator(1)
    agg.aggregate([rep("a", 500)])
    agg.forget_worker("a")
    out = agg.aggregate([rep("a", 0, finished_sending=S("x"))])
    assert out is not None and out.finished_sending == S("x")


def test_dedup_memory_is_per_worker() -> None:
    agg = CompletionAggregator(4)
    workers = [f"w{i}" for i in range(4)]
    for step in range(5000):
        ids = S(f"r{step}")
        agg.aggregate([rep(w, step, finished_recving=ids) for w in workers])
    assert agg.pending_requests() == 0
    assert len(agg._windows) == 4
    assert all(bits < (1 << DEDUP_WINDOW) for _, bits in agg._windows.values())


# ---- dead workers ----


def test_fail_worker_settles_waiting_requests_as_failed() -> None:
    agg = CompletionAggregator(2)
    agg.aggregate([rep("a", 0, finished_recving=S("x", "z"), finished_sending=S("s")), rep("b", 0)])
    agg.aggregate([rep("a", 1), rep("b", 1, finished_recving=S("z"))])
    # "b" already named "z" (finished); it still owes "x" and "s".
    failure = agg.fail_worker("b")
    assert failure == WorkerFailure("b", S("s"), S("x"))
    assert agg.pending_requests() == 0
    agg.add_invalid_blocks([7, 8])
    out = agg.aggregate([rep("a", 2)])
    assert out is not None
    assert out.finished_recving == S("x") and out.failed_recving == S("x")
    assert out.finished_sending == S("s")
    assert out.invalid_block_ids == {7, 8}
    assert agg.fail_worker("b") == WorkerFailure("b", frozenset(), frozenset())


def test_fail_worker_partial_credit_fails_at_completion() -> None:
    agg = CompletionAggregator(3)
    agg.aggregate([rep("a", 0, finished_recving=S("x"))])
    assert agg.fail_worker("c") == WorkerFailure("c", frozenset(), S("x"))
    assert agg.pending_requests() == 1
    out = agg.aggregate([rep("a", 1), rep("b", 1, finished_recving=S("x"))])
    assert out is not None
    assert out.finished_recving == S("x") and out.failed_recving == S("x")


def test_dead_worker_is_credited_for_new_requests_and_fenced() -> None:
    agg = CompletionAggregator(2)
    agg.fail_worker("b")
    out = agg.aggregate(
        [rep("a", 0, finished_recving=S("new")), rep("b", 0, finished_recving=S("new"))]
    )
    assert out is not None
    assert out.finished_recving == S("new") and out.failed_recving == S("new")
    assert agg.fenced_reports == 1
    agg.forget_worker("b")
    assert agg.dead_workers == frozenset()
    out = agg.aggregate([rep("a", 1, finished_recving=S("next"))])
    assert out is not None and out.finished_recving is None
    out = agg.aggregate([rep("a", 2), rep("b", 0, finished_recving=S("next"))])
    assert out is not None
    assert out.finished_recving == S("next") and out.failed_recving == frozenset()


def test_queued_completions_wait_for_a_call_with_an_output_rank() -> None:
    agg = CompletionAggregator(2)
    agg.aggregate([rep("a", 0, finished_sending=S("x"))])
    agg.fail_worker("b")
    assert agg.aggregate([None]) is None
    out = agg.aggregate([rep("a", 1)])
    assert out is not None and out.finished_sending == S("x")


# ---- wire round trips ----


def test_report_types_round_trip_msgpack() -> None:
    report = WorkerReport(
        "w0",
        7,
        finished_sending=S("a"),
        finished_recving=S("b"),
        invalid_block_ids=frozenset({1, 2}),
        failed_recving=S("b"),
        expected_finished_count=2,
        kv_connector_stats=TransferStats({"bytes": 1.5}),
        kv_cache_events=CacheEvents((CacheEvent("stored", (1, 2)),), 1),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=WorkerReport) == report
    out = CompletionAggregator(1).aggregate([report])
    assert out is not None
    wire = msgspec.msgpack.encode(out)
    assert msgspec.msgpack.decode(wire, type=AggregatedOutput) == out
