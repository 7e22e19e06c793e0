"""Completion aggregation as a service: `kvsidecar.daemon.completions` alone, then end to end.

The end-to-end test runs a daemon process and four worker processes of one engine (real
sockets, real registrations): duplicated and reordered reports, a daemon-credited offload, and a
worker killed with SIGKILL in the middle of a step. The scheduler side (this test) must see each
request exactly once, failures included, within a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Collect, Collected, Report
from kvsidecar.wire.reports import PeerCompletion
from kvsidecar.wire.types import BufferSetRef, WorkerRef
from tests.support.children import ReportWorker, all_ready
from tests.support.daemons import daemon_process, make_config

pytestmark = pytest.mark.timeout(60)

ENGINE = "eng"


def _ref(rank: int) -> WorkerRef:
    return WorkerRef(ENGINE, tp_rank=rank)


def _report(svc: CompletionService, rank: int, step: int, **sets: Any) -> Any:
    ref = _ref(rank)
    epoch = svc.epoch_of(ref)
    assert epoch is not None
    fields = {k: frozenset(v) for k, v in sets.items()}
    return svc.report(Report(id=1, worker=ref, epoch=epoch, step=step, **fields))


async def _collect(svc: CompletionService, step: int, timeout_s: float = 0.0) -> Collected:
    return await svc.collect(Collect(id=2, engine_id=ENGINE, step=step, timeout_s=timeout_s))


def _service(workers: int = 2) -> CompletionService:
    svc = CompletionService(retain_s=5.0)
    for rank in range(workers):
        svc.worker_registered(_ref(rank), workers)
    return svc


# --------------------------------------------------------------------------------------------------
# The service on its own (an event loop, no sockets)
# --------------------------------------------------------------------------------------------------


async def test_request_appears_once_every_worker_reported() -> None:
    svc = _service()
    _report(svc, 0, 0, finished_recving={"a", "b"})
    _report(svc, 1, 0, finished_recving={"a"})
    out = (await _collect(svc, 0)).output
    assert out.finished_recving == {"a"}
    assert svc.pending_requests() == {ENGINE: 1}
    _report(svc, 0, 1)
    _report(svc, 1, 1, finished_recving={"b"})
    out = (await _collect(svc, 1)).output
    assert out.finished_recving == {"b"} and out.step == 1


async def test_duplicates_count_once_and_late_reports_are_refused() -> None:
    svc = _service()
    assert not _report(svc, 0, 0, finished_sending={"a"}).duplicate
    assert _report(svc, 0, 0, finished_sending={"a"}).duplicate  # same step, not collected yet
    _report(svc, 1, 0, finished_sending={"a"})
    first = await _collect(svc, 0)
    assert first.output.finished_sending == {"a"}
    # A retried report of a collected step: acknowledged as the duplicate it is.
    assert _report(svc, 1, 0, finished_sending={"a"}).duplicate
    # A retried collect gets the same answer.
    again = await _collect(svc, 0)
    assert again.output == first.output
    # Worker 1 never reported step 1; after it was collected, its late report is refused.
    _report(svc, 0, 1)
    await _collect(svc, 1)
    with pytest.raises(SidecarError) as err:
        _report(svc, 1, 1, finished_recving={"x"})
    assert err.value.code == "step_collected"


async def test_stale_epoch_unknown_worker_and_engine() -> None:
    svc = _service()
    old = svc.epoch_of(_ref(0))
    svc.worker_departed(_ref(0), "test")
    svc.worker_registered(_ref(0), 2)
    with pytest.raises(SidecarError) as err:
        svc.report(Report(id=1, worker=_ref(0), epoch=old or 0, step=0))
    assert err.value.code == "stale_epoch"
    with pytest.raises(SidecarError) as err:
        svc.report(Report(id=1, worker=_ref(7), epoch=1, step=0))
    assert err.value.code == "unknown_worker"
    with pytest.raises(SidecarError) as err:
        await svc.collect(Collect(id=1, engine_id="nope", step=0))
    assert err.value.code == "unknown_engine"


async def test_dead_worker_fails_what_waits_for_it() -> None:
    svc = _service(3)
    _report(svc, 0, 0, finished_recving={"r"}, finished_sending={"s"})
    _report(svc, 1, 0, finished_recving={"r"}, finished_sending={"s"})
    _report(svc, 2, 0)
    assert (await _collect(svc, 0)).output.finished_recving is None
    svc.worker_departed(_ref(2), "lease expired")
    answer = await _collect(svc, 1)
    assert answer.output.finished_recving == {"r"}
    assert answer.output.failed_recving == {"r"}
    assert answer.output.finished_sending == {"s"}
    assert answer.failed_workers == [_ref(2).label()]
    assert svc.pending_requests() == {ENGINE: 0}


async def test_collect_waits_for_reports_and_is_bounded() -> None:
    svc = _service()
    _report(svc, 0, 3, finished_sending={"a"})
    task = asyncio.create_task(_collect(svc, 3, timeout_s=5.0))
    await asyncio.sleep(0.05)
    assert not task.done()  # waits for worker 1
    _report(svc, 1, 3, finished_sending={"a"})
    answer = await asyncio.wait_for(task, 1.0)
    assert answer.output.finished_sending == {"a"} and answer.missing == []
    started = time.monotonic()
    answer = await _collect(svc, 4, timeout_s=0.2)  # nobody reports: bounded
    assert 0.15 < time.monotonic() - started < 2.0
    assert answer.missing == [_ref(0).label(), _ref(1).label()]


async def test_daemon_credits_moves_and_peer_events() -> None:
    svc = _service()
    for rank in range(2):
        dev, host = BufferSetRef(_ref(rank), "device"), BufferSetRef(_ref(rank), "host")
        svc.move_finished(dev, host, ["off"], ok=True)  # offload: finished sending
    svc.move_finished(BufferSetRef(_ref(0), "host"), BufferSetRef(_ref(0)), ["on"], ok=True)
    svc.move_finished(
        BufferSetRef(_ref(1), "host"), BufferSetRef(_ref(1)), ["on"], ok=False, dst_ids=[5, 6]
    )
    svc.on_peer_event(PeerCompletion(engine_id=ENGINE, failed_recving=frozenset({"p"})))
    # Worker 0 also names "on" itself: merged with the daemon's credit, it counts once.
    _report(svc, 0, 0, finished_recving={"on"})
    out = (await _collect(svc, 0)).output
    assert out.finished_sending == {"off"}
    assert out.finished_recving == {"on", "p"}
    assert out.failed_recving == {"on", "p"}
    assert out.invalid_block_ids == {5, 6}


async def test_engine_state_outlives_its_workers_briefly() -> None:
    svc = CompletionService(retain_s=0.1)
    svc.worker_registered(_ref(0), 1)
    svc.worker_departed(_ref(0), "unregistered")
    await _collect(svc, 0)  # still there for the final answer
    await asyncio.sleep(0.2)
    with pytest.raises(SidecarError) as err:
        await _collect(svc, 1)
    assert err.value.code == "unknown_engine"


# --------------------------------------------------------------------------------------------------
# End to end: a daemon process, four worker processes, one killed mid-step
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def report_workers(endpoint: str, n: int) -> Iterator[list[ReportWorker]]:
    """Start ``n`` ranks of one engine (all at once), wait until registered, always stop them."""
    spec = {"endpoint": endpoint, "engine": ENGINE, "tp_size": n, "host_blocks": 8}
    with all_ready([ReportWorker({**spec, "tp_rank": r}) for r in range(n)]) as procs:
        yield procs


RANKS = 4
STEPS = 12
KILL_AT = 6
"""Rank 3 is killed after reporting steps 0..KILL_AT-1, while the others report step KILL_AT."""
VICTIM = 3


def _workload() -> tuple[dict[str, dict[int, int]], set[str], set[str]]:
    """Per request, the step at which each rank names it; the failed and the sending requests."""
    naming: dict[str, dict[int, int]] = {}
    for i in range(40):
        finish = i % (STEPS - 2)
        # Ranks name a request up to two steps apart, as workers of a real engine do.
        naming[f"r{i}"] = {rank: finish + (rank + i) % 3 for rank in range(RANKS)}
    failed = {f"r{i}" for i in range(0, 40, 7)}
    sending = {f"r{i}" for i in range(0, 40, 5)}
    return naming, failed, sending


def _reports(rank: int, step: int) -> dict[str, Any]:
    naming, failed, sending = _workload()
    body: dict[str, list[Any]] = {"finished_recving": [], "finished_sending": []}
    for rid, steps in naming.items():
        if steps[rank] != step:
            continue
        body["finished_sending" if rid in sending else "finished_recving"].append(rid)
        if rid in failed and rank == 0 and rid not in sending:
            body.setdefault("failed_recving", []).append(rid)
            body.setdefault("invalid_block_ids", []).append(int(rid[1:]))
    return body


def test_aggregation_end_to_end_with_a_killed_worker() -> None:
    naming, failed, sending = _workload()
    config = make_config(lease_s=2.0, host_pool_bytes=8 << 20)
    with (
        daemon_process(config) as daemon,
        report_workers(daemon.config.endpoint, RANKS) as procs,
        SidecarClient(daemon.config.endpoint, timeout_s=10, heartbeat=False) as scheduler,
    ):
        seen_recv: list[str] = []
        seen_send: list[str] = []
        seen_failed: list[str] = []
        invalid: set[int] = set()
        killed_at = 0.0
        sent_ahead: set[int] = set()
        for step in range(STEPS):
            live = [r for r in range(RANKS) if not (r == VICTIM and step >= KILL_AT)]
            if step == KILL_AT:
                # The victim dies mid-step: the others' reports of this step are on their way.
                for r in live:
                    procs[r].send({"steps": [step], "reports": {str(step): _reports(r, step)}})
                procs[VICTIM].proc.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                for r in live:
                    procs[r].line()
            elif step % 3 == 1 and step + 1 < STEPS and step + 1 != KILL_AT:
                # Reordered and duplicated: step+1 goes out before step, each twice.
                for r in live:
                    reports = {str(s): _reports(r, s) for s in (step, step + 1)}
                    procs[r].send({"steps": [step + 1, step], "reports": reports, "copies": 2})
                for r in live:
                    assert procs[r].line() == json.dumps({"duplicates": 2, "carried": 0})
                sent_ahead.add(step + 1)
            elif step not in sent_ahead:
                for r in live:
                    procs[r].send({"steps": [step], "reports": {str(step): _reports(r, step)}})
                for r in live:
                    procs[r].line()
            if step == 2:
                # The daemon credits an offload's request to each rank that ran it.
                for p in procs:
                    p.call({"move": "offload", "request_ids": ["offload-2"], "ids": [0, 1]})
            out = scheduler.collect(ENGINE, step, timeout_s=5.0).output
            seen_recv += sorted(out.finished_recving or ())
            seen_send += sorted(out.finished_sending or ())
            seen_failed += sorted(out.failed_recving)
            invalid |= out.invalid_block_ids
        took = time.monotonic() - killed_at
        # Each request exactly once, in its direction; failures with their completion.
        recving = set(naming) - sending
        assert sorted(seen_recv) == sorted(recving)
        assert sorted(seen_send) == sorted(sending | {"offload-2"})
        late = {rid for rid in recving if naming[rid][VICTIM] >= KILL_AT}
        assert late, "the workload must leave requests waiting for the victim"
        assert sorted(seen_failed) == sorted((failed & recving) | late)
        assert invalid == {int(rid[1:]) for rid in failed & recving}
        assert took < 30.0
        # The victim's pending requests were released through its fd channel closing, at once.
        status = scheduler.status()
        (engine,) = [e for e in status.engines if e.engine_id == ENGINE]
        assert len(engine.workers) == RANKS - 1
