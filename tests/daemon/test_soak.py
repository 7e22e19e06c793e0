"""Load: 8 worker processes moving blocks and reporting completions against one daemon.

Each worker (a `tests.procs.fault_worker`, one TP rank of engine ``soak``) loops: an offload
of its own blocks, then a report of step ``s`` naming request ``req<s>`` as finished sending. The
test is the scheduler: it collects the engine's completions step by step. A request is finished
when all 8 ranks named it, so every ``req<s>`` that all ranks reached must come out exactly once
(zero lost, zero duplicated). Command latencies (p50/p99) and the daemon's RSS over time are
printed for docs/reliability.md; RSS must stay flat after warm-up.

``KVSIDECAR_SOAK_S`` sets the duration (default 30 s; longer for a benchmark run).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from kvsidecar.client import SidecarClient
from tests.support.children import FaultWorker
from tests.support.daemons import daemon_process, make_config
from tests.support.procfs import rss_mib, shm_entries

DURATION_S = float(os.environ.get("KVSIDECAR_SOAK_S", "30"))
RANKS = 8

pytestmark = pytest.mark.timeout(int(DURATION_S) + 240)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))] if values else float("nan")


def test_soak_eight_workers() -> None:
    shm_before = shm_entries()
    config = make_config(host_pool_bytes=256 << 20, lease_s=10.0)
    with daemon_process(config) as d:
        spec = {
            "endpoint": config.endpoint,
            "engine": "soak",
            "tp_size": RANKS,
            "blocks": 64,
            "layers": 4,
            "block_size": 16,
            "heads": 4,
            "head_size": 64,
            "batch": 8,
            "report": True,
            "pause_s": 0.005,
            "timeout_s": 10.0,
        }
        workers = [FaultWorker({**spec, "tp_rank": r}) for r in range(RANKS)]
        finished: Counter[str] = Counter()
        rss: list[tuple[float, float]] = []
        collect_s: list[float] = []
        try:
            for w in workers:
                w.wait_ready(180)
            with SidecarClient(config.endpoint, heartbeat=False, timeout_s=20) as sched:
                t_start = time.monotonic()
                step, last_rss = 0, 0.0
                while time.monotonic() - t_start < DURATION_S:
                    t0 = time.perf_counter()
                    got = sched.collect("soak", step, timeout_s=5.0)
                    collect_s.append(time.perf_counter() - t0)
                    assert not got.failed_workers, got.failed_workers
                    for rid in got.output.finished_sending or ():
                        finished[rid] += 1
                    step += 1
                    now = time.monotonic()
                    if now - last_rss >= 2.0:
                        rss.append((now - t_start, rss_mib(d.proc.pid)))
                        last_rss = now
                for w in workers:
                    w.stop()
                # The requests every rank reached: all must have finished, exactly once.
                reached = min(
                    sum(1 for x in w.outcomes() if "step" in x and "report_code" not in x)
                    for w in workers
                )
                collected_up_to = step - 1
        finally:
            for w in workers:
                w.stop()
    outcomes = [x for w in workers for x in w.outcomes()]
    errors = Counter(
        x.get("code") or x.get("report_code") for x in outcomes if "code" in x or "report_code" in x
    )
    for w in workers:
        done = [x for x in w.lines if "done" in x]
        assert done and [x["i"] for x in w.outcomes()] == list(range(done[0]["done"]))
    expected = {f"req{s}" for s in range(min(reached, collected_up_to + 1))}
    lost = expected - set(finished)
    dup = {k: n for k, n in finished.items() if n > 1}
    moves = [x["s"] for x in outcomes if x.get("ok")]
    reports = [x["report_s"] for x in outcomes if "report_s" in x]
    warm = [m for t, m in rss if t >= 10.0] or [m for _, m in rss]
    print(
        f"\nsoak {DURATION_S:.0f} s, {RANKS} workers: {len(moves)} moves, {len(reports)} reports, "
        f"{len(collect_s)} collects, {len(finished)} requests finished; errors {dict(errors)}\n"
        f"  move p50 {_pct(moves, 0.5) * 1e3:.2f} ms p99 {_pct(moves, 0.99) * 1e3:.2f} ms; "
        f"report p50 {_pct(reports, 0.5) * 1e3:.2f} ms p99 {_pct(reports, 0.99) * 1e3:.2f} ms; "
        f"collect p99 {_pct(collect_s, 0.99) * 1e3:.1f} ms\n"
        f"  daemon RSS MiB over time: {[round(m) for _, m in rss]}"
    )
    assert not errors, errors
    assert not lost, f"{len(lost)} requests never finished, e.g. {sorted(lost)[:5]}"
    assert not dup, f"duplicated completions: {dup}"
    assert len(expected) > 100
    assert max(warm) - min(warm) < 48, f"RSS not flat after warm-up: {warm}"
    assert not shm_entries() - shm_before, "segments left in /dev/shm"
