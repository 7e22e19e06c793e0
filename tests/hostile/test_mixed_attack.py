"""The mixed attack: six hostile processes at once while 8 honest workers move and report.

A flooder (4 DEALERs sending status, garbage, oversize frames and forbidden moves, never
reading), an fd hoarder (hundreds of fd-channel connections, thousands of unclaimed fds, half-open
connections, reconnecting throughout), a slow reader (requests whose replies it never reads), a
shrinking worker (registers an unsealed memfd and truncates it under the daemon's mapping, then
asks for moves out of it), a pin-and-store client (pins its whole cache namespace, then stores
thousands of new keys at a time, none of which finds a slot) and an endpoint-spelling flooder
(pulls naming the daemon's own peer endpoint in ever new spellings, and dead ports, 16 at a time)
attack one daemon process for ``KVSIDECAR_MIXED_S`` seconds (default 30). Meanwhile 8 worker
processes (TP ranks of engine ``honest``, `tests.procs.fault_worker` in ``verify`` mode) move
their blocks device -> host -> device and check every element against what they wrote, and
report each step's request as finished; the test, as the scheduler, collects.

A calm phase of ``BASELINE_S`` comes first, with the same workers and scheduler, so that the
figures under attack have a baseline from the same run. It ends with every honest command
answered (no gap in any worker's log, no error), no element wrong, every request that all ranks
reported finished exactly once, and the daemon alive (``/healthz`` answers are recorded). The honest
round trips' p50/p99 (calm and under attack) are printed and written to ``mixed_attack.json`` in
the test's tmp dir (docs/reliability.md quotes them).

The shrinker needs the daemon to refuse shrinkable memory (or survive the fault); without that
fix the daemon dies of SIGBUS at its first move. ``KVSIDECAR_MIXED_SHRINKER=0`` leaves it out
(for a branch that does not have that fix yet); CI runs it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from tests.support.attack import Attacker, http_status
from tests.support.children import FaultWorker
from tests.support.daemons import cluster_key, daemon_process, make_config
from tests.support.ports import tcp_endpoint
from tests.support.procfs import rss_mib

DURATION_S = float(os.environ.get("KVSIDECAR_MIXED_S", "30"))
BASELINE_S = 10.0
"""The same workers and scheduler without attackers first: the round trips to compare with."""
SHRINKER = os.environ.get("KVSIDECAR_MIXED_SHRINKER", "1") != "0"
RANKS = 8
PINNED_SLOTS = 8192
"""The pin-and-store client's namespace: every slot stored and pinned before its stores begin."""

pytestmark = pytest.mark.timeout(int(DURATION_S) + 360)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))] if values else float("nan")


def _attackers(endpoint: str, fd_socket: str, peer_endpoint: str) -> list[Attacker]:
    specs: list[dict[str, Any]] = [
        {"attack": "control_flood", "endpoint": endpoint, "kind": "mix", "sockets": 4},
        {
            "attack": "fd_hoard",
            "path": fd_socket,
            "connections": 300,
            "fds": 200,
            "messages": 4,
            "half_open": 20,
            "reconnect_s": DURATION_S,
        },
        {"attack": "slow_reader", "endpoint": endpoint, "rate": 200.0},
        {
            "attack": "pin_and_store",
            "endpoint": endpoint,
            "fd_socket": fd_socket,
            "slots": PINNED_SLOTS,
            "keys": 4096,
        },
    ]
    if SHRINKER:
        specs.append({"attack": "shrinker", "endpoint": endpoint, "fd_socket": fd_socket})
    specs.append(
        {
            "attack": "endpoint_flood",
            "endpoint": endpoint,
            "fd_socket": fd_socket,
            "peer_port": int(peer_endpoint.rsplit(":", 1)[1]),
            "inflight": 16,
            "timeout_s": 5.0,
        }
    )
    started: list[Attacker] = []
    try:
        for spec in specs:
            started.append(Attacker(spec))
    except BaseException:
        for a in started:
            a.stop()
        raise
    return started


def _schedule(
    endpoint: str, port: int, finished: Counter[str], step: int, seconds: float
) -> dict[str, Any]:
    """Collect the engine's completions step by step for ``seconds``, from ``step`` on."""
    health: Counter[str] = Counter()
    last_probe = 0.0
    with SidecarClient(endpoint, heartbeat=False, timeout_s=60) as sched:
        t_start = time.monotonic()
        while time.monotonic() - t_start < seconds:
            # Waits for all 8 ranks: a step collected early would refuse a late rank's report.
            got = sched.collect("honest", step, timeout_s=30.0)
            assert not got.failed_workers, got.failed_workers
            for rid in got.output.finished_sending or ():
                finished[rid] += 1
            step += 1
            if time.monotonic() - last_probe >= 2.0:
                last_probe = time.monotonic()
                health[http_status(port)] += 1
        alive = sched.status().uptime_s > 0
    return {"steps": step, "health": health, "alive": alive}


def test_mixed_attack(tmp_path: Path) -> None:
    # A peer endpoint: the endpoint-spelling flooder names it in its pulls.
    config = make_config(
        host_pool_bytes=256 << 20,
        lease_s=10.0,
        peer_endpoint=tcp_endpoint(),
        curve_secret_key=cluster_key(),
    )
    spec = {
        "endpoint": config.endpoint,
        "engine": "honest",
        "tp_size": RANKS,
        "blocks": 64,
        "layers": 4,
        "verify": True,
        "batch": 8,
        "report": True,
        "pause_s": 0.005,
        "timeout_s": 30.0,
    }
    finished: Counter[str] = Counter()
    with daemon_process(config) as d:
        workers = [FaultWorker({**spec, "tp_rank": r}) for r in range(RANKS)]
        try:
            for w in workers:
                w.wait_ready(180)
            with SidecarClient(config.endpoint, heartbeat=False) as c:
                port = c.daemon.metrics_port
            calm_start = time.time()
            calm = _schedule(config.endpoint, port, finished, 0, BASELINE_S)
            rss_before = rss_mib(d.proc.pid)
            attack_start = time.time()
            attackers = _attackers(config.endpoint, config.fd_socket, config.peer_endpoint)
            try:
                run = _schedule(config.endpoint, port, finished, calm["steps"], DURATION_S)
                rss_peak = rss_mib(d.proc.pid)
            finally:
                attack_end = time.time()
                results = {a.spec["attack"]: a.finish() for a in attackers}
            for w in workers:
                w.stop()
            reached = min(
                sum(1 for x in w.outcomes() if "step" in x and "report_code" not in x)
                for w in workers
            )
        finally:
            for w in workers:
                w.stop()
        daemon_alive = d.proc.poll() is None
        lags = [float(m) for m in re.findall(r"event loop lagged ([0-9.]+)s", d.log())]
    figures = {
        "attack": _figures(workers, attack_start, attack_end, run),
        "baseline": _figures(workers, calm_start, attack_start, calm),
        "daemon_rss_mib": [round(rss_before), round(rss_peak)],
        "loop_lags_over_1s": lags,
        "shrinker": SHRINKER,
        "attackers": results,
    }
    (tmp_path / "mixed_attack.json").write_text(json.dumps(figures, indent=2, default=str))
    print(f"\nmixed attack ({tmp_path / 'mixed_attack.json'}):\n{json.dumps(figures, default=str)}")
    _check(workers, finished, reached, run, daemon_alive)
    pinner = results["pin_and_store"]
    assert pinner["pinned"]["hits"] == PINNED_SLOTS, pinner  # the attack ran as meant
    assert pinner["stores"] > 0 and set(pinner["replies"]) == {"cache_stored"}, pinner


def _check(
    workers: list[FaultWorker],
    finished: Counter[str],
    reached: int,
    run: dict[str, Any],
    daemon_alive: bool,
) -> None:
    assert daemon_alive and run["alive"], "the daemon died"
    for w in workers:
        done = [x for x in w.lines if "done" in x]
        assert done, "a worker did not finish its log"
        assert [x["i"] for x in w.outcomes()] == list(range(done[0]["done"])), "a lost command"
    outcomes = [x for w in workers for x in w.outcomes()]
    errors = Counter(x.get("code") or x.get("report_code") for x in outcomes if "ok" not in x)
    errors.update(x["report_code"] for x in outcomes if "report_code" in x)
    assert not errors, f"honest commands failed: {errors}"
    bad = sum(x.get("bad", 0) for x in outcomes)
    assert bad == 0, f"{bad} elements differ from what the workers wrote"
    expected = {f"req{s}" for s in range(min(reached, run["steps"]))}
    lost = expected - set(finished)
    dup = {k: n for k, n in finished.items() if n > 1}
    assert not lost, f"{len(lost)} requests never finished, e.g. {sorted(lost)[:5]}"
    assert not dup, f"duplicated completions: {dup}"
    assert len(expected) > 10, f"only {len(expected)} steps completed"
    # /healthz is reported, not asserted here: with 14 busy processes on 2 cores the OS alone can
    # hold the daemon off a core for a second (tests/hostile/test_starvation.py asserts it per
    # attack).


def _figures(
    workers: list[FaultWorker], start: float, end: float, run: dict[str, Any]
) -> dict[str, Any]:
    during = [x for w in workers for x in w.outcomes() if start <= x["t"] <= end]
    trips = [x[k] for x in during for k in ("s", "s2", "report_s") if k in x]
    moves = [x[k] for x in during for k in ("s", "s2") if k in x]
    return {
        "duration_s": round(end - start, 1),
        "honest_round_trips": len(trips),
        "round_trip_p50_ms": round(_pct(trips, 0.5) * 1e3, 2),
        "round_trip_p99_ms": round(_pct(trips, 0.99) * 1e3, 2),
        "move_p99_ms": round(_pct(moves, 0.99) * 1e3, 2),
        "elements_checked_rounds": sum(1 for x in during if "bad" in x),
        "steps_collected_up_to": run["steps"],
        "healthz": dict(run["health"]),
    }
