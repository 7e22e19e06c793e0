"""The daemon's metrics endpoint, end to end: Prometheus, promtool, the dashboard, the probes.

- A real Prometheus scrapes a daemon process while worker processes move blocks; its HTTP API
  must report exactly the bytes the workload moved, and ``promtool check metrics`` must find no
  problem in the daemon's ``/metrics``; the Grafana dashboard must find every metric it queries.
- ``/healthz`` and ``/readyz`` follow the daemon's life: refused before it starts, ready once it
  serves, "draining" while SIGTERM waits for an in-flight move, refused once it stopped.
- The series of an engine whose workers all left are removed after the grace period.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, SidecarClient, SidecarError
from kvsidecar.memory import allocate_kv_caches
from tests.procs.report_worker import CACHE_SHAPE
from tests.support.children import ReportWorker, all_ready
from tests.support.daemons import DaemonProcess, daemon_process, make_config, run_daemon
from tests.support.ports import reserve_port
from tests.support.prometheus import find_binary, start_prometheus
from tests.support.promql import dashboard_metrics_missing_from_scrape

pytestmark = pytest.mark.timeout(90)


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url``: (status, body); status 0 when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0, ""


def test_prometheus_sees_exactly_the_bytes_moved(tmp_path: Path) -> None:
    # With a disk tier: the dashboard's panels of the cache tiers query its series too.
    config = make_config(
        host_pool_bytes=16 << 20, cache_dir=str(tmp_path / "cache"), cache_disk_bytes=1 << 20
    )
    layers = 2
    kv, _, tokens, heads, head_size = CACHE_SHAPE
    # What one block of a worker is, counted here from its shape (float16), not by the daemon.
    block_bytes = layers * kv * tokens * heads * head_size * 2
    with daemon_process(config):
        with SidecarClient(config.endpoint, timeout_s=10, heartbeat=False) as c:
            port = c.status().metrics_port
            assert port > 0 and c.daemon is not None and c.daemon.metrics_port == port
        base = f"http://127.0.0.1:{port}"
        assert _get(f"{base}/readyz")[0] == 200
        assert _get(f"{base}/healthz")[0] == 200
        spec = {"endpoint": config.endpoint, "engine": "prom", "tp_size": 2, "host_blocks": 8}
        ranks = [{**spec, "tp_rank": r, "layers": layers} for r in range(2)]
        with (
            all_ready([ReportWorker(s) for s in ranks]) as procs,
            start_prometheus([f"127.0.0.1:{port}"], scrape_interval_s=0.5) as prom,
        ):
            prom.wait_for_targets_up()
            moved = {"offload": 0, "onboard": 0}
            moves = 0
            # Interleaved with scrapes: rounds of moves from both worker processes.
            for round_ in range(6):
                for p in procs:
                    ids = [round_ % 8, (round_ + 3) % 8]
                    kind = "offload" if round_ % 2 == 0 else "onboard"
                    assert p.call({"move": kind, "ids": ids})["nbytes"] == len(ids) * block_bytes
                    moved[kind] += len(ids) * block_bytes
                    moves += 1
                time.sleep(0.3)
            total = sum(moved.values())
            got = prom.wait_for_value(
                'sum(kvsidecar_moved_bytes_total{engine="prom"})', lambda v: v == total
            )
            assert got == total
            for kind, nbytes in moved.items():
                expr = f'sum(kvsidecar_moved_bytes_total{{kind="{kind}"}})'
                assert prom.wait_for_value(expr, lambda v, n=nbytes: v == n) == nbytes
            assert prom.query_value('sum(kvsidecar_moves_total{engine="prom"})') == moves
            assert prom.query_value('kvsidecar_registered_workers{engine="prom"}') == 2
            ok = 'sum(kvsidecar_commands_total{command="move",result="ok"})'
            assert prom.wait_for_value(ok, lambda v: v == moves) == moves
            status, exposition = _get(f"{base}/metrics")
        assert status == 200
        # The exposition as promtool sees it: no lint problem at all.
        check = subprocess.run(
            [find_binary("promtool"), "check", "metrics"],
            input=exposition,
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0 and check.stdout + check.stderr == "", (
            check.stdout + check.stderr
        )
        # The operators' dashboard finds every metric it queries on a live daemon.
        assert dashboard_metrics_missing_from_scrape(exposition) == set()
        # `python -m kvsidecar.daemon` turns the `_created` series off, process-wide.
        assert "_created" not in exposition


def test_health_and_readiness_follow_start_and_stop() -> None:
    # Started by hand, not by `daemon_process`, to watch the port before the daemon binds it.
    port = reserve_port()
    config = make_config(metrics_port=port)
    base = f"http://127.0.0.1:{port}"
    daemon = DaemonProcess(config)
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = _get(f"{base}/readyz", timeout=0.5)[0]
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == 200:
                break
            time.sleep(0.02)
        # Nothing listens until the daemon binds the endpoint, which it does after its sockets.
        assert seen[0] == 0 and seen[-1] == 200, seen
        assert _get(f"{base}/healthz")[0] == 200
        assert daemon.stop() == 0
        assert _get(f"{base}/readyz")[0] == 0
        assert _get(f"{base}/healthz")[0] == 0
    finally:
        daemon.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


async def _aget(url: str) -> tuple[int, str]:
    return await asyncio.to_thread(_get, url)


async def test_readyz_reports_the_drain() -> None:
    config = make_config(metrics_port=0, drain_timeout_s=10.0)
    release = threading.Event()
    async with run_daemon(config) as daemon:
        base = f"http://127.0.0.1:{daemon.observability.port}"
        assert (await _aget(f"{base}/readyz"))[0] == 200
        executor = daemon.executor
        assert executor is not None
        # A move-sized job that runs until the test lets it go: shutdown must wait for it.
        held = asyncio.ensure_future(executor.submit(lambda: release.wait(10), reads={}, writes={}))
        daemon.request_exit()
        status, body = 0, ""
        for _ in range(100):
            status, body = await _aget(f"{base}/readyz")
            if status == 503:
                break
            await asyncio.sleep(0.02)
        assert (status, body) == (503, "not ready: draining\n")
        assert (await _aget(f"{base}/healthz"))[0] == 200  # alive while it drains
        release.set()
        await held
    assert (await _aget(f"{base}/readyz"))[0] == 0


async def test_departed_engine_series_are_removed() -> None:
    config = make_config(metrics_port=0, metrics_grace_s=0.3)
    caches = await asyncio.to_thread(allocate_kv_caches, 1, [2, 8, 4, 2, 16], torch.float16)
    async with run_daemon(config) as daemon:
        url = f"http://127.0.0.1:{daemon.observability.port}/metrics"
        async with AsyncSidecarClient(config.endpoint) as c:
            await c.register_kv_caches({"l0": caches[0]}, engine_id="gone", host_blocks=4)
            await c.offload(c.worker, [1, 2], [0, 1])
            text = (await _aget(url))[1]
            assert 'kvsidecar_moved_bytes_total{engine="gone",kind="offload"}' in text
            assert 'kvsidecar_registered_workers{engine="gone"} 1.0' in text
            await c.unregister()
            # Within the grace period the counters stay, so the last scrape sees their last value.
            assert 'kvsidecar_moved_bytes_total{engine="gone"' in (await _aget(url))[1]
            await asyncio.sleep(0.6)
            text = (await _aget(url))[1]
            assert 'engine="gone"' not in text, [ln for ln in text.splitlines() if "gone" in ln]


def _samples(text: str, name: str) -> dict[str, float]:
    """``{engine label (or ""): value}`` of one family in a ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels.get("engine", ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


async def test_host_block_gauges_show_what_host_alloc_runs_out_of() -> None:
    """The pool's bytes are all reserved by the engine's mirror the moment it registers, so
    ``host_pool_used_bytes`` reads 100% with no block in use (the alert's old false positive).
    The block gauges follow the allocator that ``host_alloc`` draws from, and reach their
    capacity exactly when it starts failing with ``pool_exhausted``."""
    blocks = 256
    caches = await asyncio.to_thread(allocate_kv_caches, 1, [2, 8, 4, 2, 16], torch.float16)
    row = caches[0].nbytes // caches[0].shape[1]  # one block of the layer, K and V
    mirror = -(-blocks * row // 4096) * 4096  # the registration's page-aligned reservation
    # One page more than the mirror: the arena is only 64-byte aligned, so a page-aligned
    # reservation of all of it may not fit.
    pool = mirror + 4096
    config = make_config(metrics_port=0, host_pool_bytes=pool)
    async with run_daemon(config) as daemon:
        url = f"http://127.0.0.1:{daemon.observability.port}/metrics"

        async def gauges() -> tuple[float, float, float, float]:
            text = (await _aget(url))[1]
            return (
                _samples(text, "kvsidecar_host_pool_used_bytes")[""],
                _samples(text, "kvsidecar_host_pool_capacity_bytes")[""],
                _samples(text, "kvsidecar_host_blocks_used")["e"],
                _samples(text, "kvsidecar_host_blocks_capacity")["e"],
            )

        async with AsyncSidecarClient(config.endpoint, heartbeat=False) as c:
            await c.register_kv_caches({"l0": caches[0]}, engine_id="e", host_blocks=blocks)
            used_bytes, capacity_bytes, used_blocks, capacity_blocks = await gauges()
            assert (used_bytes, capacity_bytes) == (mirror, pool)
            assert used_bytes / capacity_bytes > 0.9  # what the old alert fired on
            assert (used_blocks, capacity_blocks) == (0, blocks)
            held = list(await c.host_alloc("e", blocks - 1))
            assert (await gauges())[2:] == (blocks - 1, blocks)
            with pytest.raises(SidecarError) as failed:
                await c.host_alloc("e", 2)
            assert failed.value.code == "pool_exhausted"
            held += list(await c.host_alloc("e", 1))
            assert (await gauges())[2:] == (blocks, blocks)
            await c.host_free("e", held)
            assert await gauges() == (mirror, pool, 0, blocks)
            await c.unregister()
            text = (await _aget(url))[1]
            assert _samples(text, "kvsidecar_host_blocks_used") == {}
