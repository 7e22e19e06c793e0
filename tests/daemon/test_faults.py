"""Faults with processes killed for real: a worker, the daemon, a client that stops reading.

Each test bounds every wait, checks that every command got an outcome (a reply, or a typed
error), that no ``/dev/shm`` entry is left behind and that the daemon's memory returns to its
baseline. The peer daemon killed mid-pull is covered by tests/peer/test_faults.py.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvsidecar.client import AsyncSidecarClient, SidecarClient, SidecarError, WorkerRef
from kvsidecar.wire.protocol import Status
from tests.support.children import FaultWorker, all_ready
from tests.support.daemons import DaemonProcess, daemon_process, make_config
from tests.support.procfs import rss_mib, shm_entries

pytestmark = pytest.mark.timeout(180)


def test_worker_sigkill_mid_move() -> None:
    """A worker dies with moves in flight (its own and another client's on its blocks)."""
    shm_before = shm_entries()
    config = make_config(host_pool_bytes=256 << 20, lease_s=5.0)
    with daemon_process(config) as d:
        baseline = rss_mib(d.proc.pid)
        spec = {
            "endpoint": config.endpoint,
            "engine": "victim",
            "blocks": 64,
            "layers": 16,
            "block_size": 16,
            "heads": 8,
            "head_size": 128,
            "batch": 64,
        }  # 128 MiB moves
        w = FaultWorker(spec)
        try:
            w.wait_ready()
            w.wait_for(lambda: len(w.outcomes()) >= 3, 60, "three moves")

            async def other_client() -> list[Any]:
                async with AsyncSidecarClient(config.endpoint, heartbeat=False) as c:
                    ids = list(range(64))
                    pending = [
                        asyncio.ensure_future(c.offload(WorkerRef("victim"), ids, ids))
                        for _ in range(8)
                    ]
                    await asyncio.sleep(0.02)
                    w.proc.send_signal(signal.SIGKILL)
                    t0 = time.monotonic()
                    out = await asyncio.wait_for(
                        asyncio.gather(*pending, return_exceptions=True), 30
                    )
                    out.append(time.monotonic() - t0)
                    return out

            *results, seconds = asyncio.run(other_client())
            w.proc.wait(5)
        finally:
            w.stop()
        kinds = {r.code if isinstance(r, SidecarError) else type(r).__name__ for r in results}
        assert kinds <= {"Moved", "worker_lost", "unknown_worker", "unknown_engine"}, kinds
        assert seconds < 15, f"the last of the other client's moves took {seconds:.1f} s"
        with SidecarClient(config.endpoint, heartbeat=False) as c:
            deadline = time.monotonic() + 5
            # Released at the fd channel's EOF; copies already on a thread run to their end.
            while time.monotonic() < deadline and (
                c.status().engines or c.status().in_flight_moves
            ):
                time.sleep(0.05)
            status = c.status()
            assert status.engines == [] and status.in_flight_moves == 0
            assert status.host_pool_used_bytes == 0
        grown = rss_mib(d.proc.pid) - baseline
        assert grown < 64, f"daemon RSS grew by {grown:.0f} MiB"
    assert not shm_entries() - shm_before, "segments left in /dev/shm"


def test_daemon_sigkill_mid_move_and_restart() -> None:
    """The daemon dies under a moving worker and comes back; the worker re-registers.

    Every move the worker issued has an outcome line (ok, or a typed error), the one in flight
    at the kill fails promptly with connection_lost, and moves succeed again after the restart.
    """
    shm_before = shm_entries()
    config = make_config(host_pool_bytes=64 << 20, lease_s=3.0)
    d1 = DaemonProcess(config)
    d2: DaemonProcess | None = None
    try:
        d1.wait_ready()
        spec = {
            "endpoint": config.endpoint,
            "engine": "survivor",
            "blocks": 64,
            "layers": 4,
            "block_size": 16,
            "heads": 8,
            "head_size": 64,
            "batch": 32,
            "timeout_s": 2.0,
        }
        with all_ready([FaultWorker(spec)]) as (w,):
            w.wait_for(lambda: len(w.outcomes()) >= 20, 60, "twenty moves")
            d1.proc.send_signal(signal.SIGKILL)
            d1.proc.wait(5)
            killed_at = len(w.outcomes())
            w.wait_for(
                lambda: any("code" in x for x in w.outcomes()[killed_at - 1 :]),
                10,
                "the in-flight move failing",
            )
            d2 = DaemonProcess(config)
            d2.wait_ready()
            ready_at = time.time()
            restarted_at = len(w.outcomes())
            w.wait_for(
                lambda: sum(1 for x in w.outcomes()[restarted_at:] if x.get("ok")) >= 10,
                60,
                "ten moves after the restart",
            )
            with SidecarClient(config.endpoint, heartbeat=False) as c:
                engines = [e.engine_id for e in c.status().engines]
            assert engines == ["survivor"]
            w.stop()
            done = [x for x in w.lines if "done" in x]
            assert done and done[0]["reconnects"] >= 1, w.lines[-3:]
            outcomes = w.outcomes()
            assert [x["i"] for x in outcomes] == list(range(done[0]["done"]))  # none missing
            codes = {x["code"] for x in outcomes if "code" in x}
            assert "connection_lost" in codes, codes
            assert codes <= {"connection_lost", "timeout", "unknown_worker", "stale_epoch"}, codes
            first_failure = next(x for x in outcomes if "code" in x)
            assert first_failure["s"] < 3.0, first_failure  # not a long silent hang
            back = next(x for x in outcomes[restarted_at:] if x.get("ok"))
            print(
                f"\ndaemon restart: in-flight move failed after {first_failure['s'] * 1e3:.0f} ms "
                f"({first_failure['code']}); first move after the restart "
                f"{max(0.0, back['t'] - ready_at) * 1e3:.0f} ms after the new daemon answered; "
                f"{len(outcomes)} moves, errors {sorted(codes)}"
            )
    finally:
        for d in (d1, d2):
            if d is not None:
                d.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
    assert not shm_entries() - shm_before, "segments left in /dev/shm"


def test_client_that_stops_reading() -> None:
    """A peer floods requests and never reads a reply: the daemon keeps serving others, its
    memory stays bounded (ROUTER drops replies past the peer's high-water mark)."""
    with daemon_process(make_config(host_pool_bytes=16 << 20)) as d:
        baseline = rss_mib(d.proc.pid)
        ctx = zmq.Context()
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVHWM, 10)
        flood.setsockopt(zmq.RCVBUF, 4096)
        flood.setsockopt(zmq.SNDTIMEO, 2000)
        flood.connect(d.config.endpoint)
        status = msgspec.msgpack.encode(Status(id=1))
        sent, latencies = 0, []
        with SidecarClient(d.config.endpoint, heartbeat=False) as probe:
            t_end = time.monotonic() + 15
            while time.monotonic() < t_end and sent < 200_000:
                for _ in range(1000):
                    try:
                        flood.send(status, zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        break
                t0 = time.perf_counter()
                probe.status(timeout=5)
                latencies.append(time.perf_counter() - t0)
            peak = rss_mib(d.proc.pid)
        flood.close()
        ctx.term()
        latencies.sort()
        p99 = latencies[int(0.99 * (len(latencies) - 1))]
        assert sent >= 20_000, f"only {sent} requests went out"
        assert p99 < 1.0, f"status p99 {p99:.3f} s while flooded"
        assert peak - baseline < 96, f"daemon RSS grew {peak - baseline:.0f} MiB under the flood"
        time.sleep(1.0)
        with SidecarClient(d.config.endpoint, heartbeat=False) as c:
            # Every flooded request was a valid status: unread replies are dropped, not errors.
            assert c.status().errors_total == 0
        print(
            f"flood: {sent} requests unread; status p99 {p99 * 1e3:.1f} ms; "
            f"RSS {baseline:.0f} -> {peak:.0f} MiB"
        )
