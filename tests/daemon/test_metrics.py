"""Tests of the daemon's metrics, state gauges and endpoint against real parts: sockets, a real
Prometheus, promtool (kvsidecar.daemon.metrics.families, .metrics_state, .metrics_server)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvsidecar.daemon.metrics.families import LAYOUT_FIX_KINDS, MOVE_KINDS, DaemonMetrics
from kvsidecar.daemon.metrics.server import MetricsServer, Readiness
from kvsidecar.daemon.metrics.state import StateSnapshot
from tests.support.prometheus import find_binary, prometheus_running

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30
MiB = 1 << 20


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The value of one sample on ``registry``; None when it has no such sample."""
    return registry.get_sample_value(name, labels)


# --------------------------------------------------------------------------------------------------
# Harness: a stand-in for the daemon's state (plain object), the server, a raw HTTP client
# --------------------------------------------------------------------------------------------------


STARTING = Readiness(sockets_bound=False, host_pool_allocated=False, draining=False)


@dataclass
class FakeDaemonState:
    """Implements StateProvider and HealthProvider as the daemon does; tests replace the facts."""

    snapshot: StateSnapshot = field(default_factory=StateSnapshot)
    ready: Readiness = STARTING
    fail: bool = False

    def metrics_state(self) -> StateSnapshot:
        if self.fail:
            raise RuntimeError("provider bug")
        return self.snapshot

    def readiness(self) -> Readiness:
        return self.ready


@dataclass
class Harness:
    registry: CollectorRegistry
    metrics: DaemonMetrics
    state: FakeDaemonState
    server: MetricsServer


@contextlib.asynccontextmanager
async def serving(**server_kwargs: Any) -> AsyncIterator[Harness]:
    registry = CollectorRegistry()
    state = FakeDaemonState()
    metrics = DaemonMetrics(registry, state=state)
    server = MetricsServer(
        registry=registry,
        health=state,
        port=0,
        on_loop_lag=metrics.observe_loop_lag,
        **server_kwargs,
    )
    async with server:
        yield Harness(registry, metrics, state, server)


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes


async def http_raw(port: int, request: bytes, *, timeout_s: float = 5.0) -> HttpResponse:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout_s)  # server closes after replying
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert int(headers["content-length"]) == len(body) or request.startswith(b"HEAD")
    return HttpResponse(status, headers, body)


async def http_get(
    port: int, path: str, *, method: str = "GET", headers: Mapping[str, str] | None = None
) -> HttpResponse:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return await http_raw(port, ("\r\n".join(lines) + "\r\n\r\n").encode())


@dataclass(frozen=True)
class Move:
    kind: str
    engine: str
    nbytes: int
    seconds: float


WORKLOAD = [
    Move(kind, engine, (i + 1) * scale * 4 * MiB + 4096 * i, 0.0005 * (i + 1) * scale)
    for i, kind in enumerate(MOVE_KINDS)
    for engine, scale in (("engine-a", 1), ("engine-b", 3))
]
"""Moves of every kind for two engines, of different sizes and speeds."""


def record_workload(metrics: DaemonMetrics) -> tuple[int, float]:
    """Record `WORKLOAD`; returns (total bytes, total seconds)."""
    for move in WORKLOAD:
        metrics.record_move(move.kind, move.engine, move.nbytes, move.seconds)  # type: ignore[arg-type]
    return sum(m.nbytes for m in WORKLOAD), sum(m.seconds for m in WORKLOAD)


# --------------------------------------------------------------------------------------------------
# (1) A real Prometheus scrapes the endpoint during a workload
# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_real_prometheus_sees_bytes_moved_and_byte_weighted_throughput() -> None:
    async with serving() as h:
        for engine in ("engine-a", "engine-b"):
            h.metrics.add_engine(engine)  # every series starts at 0, scraped before any move
        target = f"127.0.0.1:{h.server.port}"
        async with prometheus_running([target], scrape_interval_s=0.5) as prom:
            await prom.await_targets_up()
            assert await prom.await_value(
                "sum(kvsidecar_moved_bytes_total)", lambda v: v == 0.0
            ) == pytest.approx(0.0)

            # First half of the workload, seen by a scrape; then the second half.
            bytes_1, seconds_1 = record_workload(h.metrics)
            await prom.await_value("sum(kvsidecar_moved_bytes_total)", lambda v: v == bytes_1)
            bytes_2, seconds_2 = record_workload(h.metrics)
            total_bytes, total_seconds = bytes_1 + bytes_2, seconds_1 + seconds_2
            assert sample(
                h.registry, "kvsidecar_moves_total", kind="local", engine="engine-a"
            ) == pytest.approx(2.0)

            value = await prom.await_value(
                "sum(kvsidecar_moved_bytes_total)", lambda v: v == total_bytes
            )
            assert value == total_bytes

            per_kind = await prom.aquery_value('sum(kvsidecar_moved_bytes_total{kind="peer_recv"})')
            assert per_kind == 2 * sum(m.nbytes for m in WORKLOAD if m.kind == "peer_recv")

            # Byte-weighted throughput over the window: both series were first scraped at 0 and
            # share scrape timestamps, so rate()'s extrapolation cancels in the quotient.
            expected = total_bytes / total_seconds
            for expr in (
                "sum(rate(kvsidecar_moved_bytes_total[1m]))"
                " / sum(rate(kvsidecar_move_duration_seconds_sum[1m]))",
                "sum(rate(kvsidecar_moved_bytes_total[1m]))"
                " / sum(rate(kvsidecar_move_seconds_total[1m]))",
            ):
                assert await prom.aquery_value(expr) == pytest.approx(expected, rel=1e-9)
            # Per engine needs the engine-labelled seconds counter.
            a_bytes = await prom.aquery_value(
                'sum(rate(kvsidecar_moved_bytes_total{engine="engine-a"}[1m]))'
                ' / sum(rate(kvsidecar_move_seconds_total{engine="engine-a"}[1m]))'
            )
            moves_a = [m for m in WORKLOAD if m.engine == "engine-a"]
            expected_a = sum(m.nbytes for m in moves_a) / sum(m.seconds for m in moves_a)
            assert a_bytes == pytest.approx(expected_a, rel=1e-9)

            assert await prom.aquery_value('kvsidecar_build_info{version!=""}') == pytest.approx(
                1.0
            )


# --------------------------------------------------------------------------------------------------
# (2) promtool lints the exposition; content negotiation
# --------------------------------------------------------------------------------------------------


async def test_promtool_check_metrics_reports_no_problem() -> None:
    promtool = find_binary("promtool")
    async with serving() as h:
        h.state.snapshot = StateSnapshot(
            registered_workers={"engine-a": 2, "engine-b": 1},
            registered_buffer_bytes={"engine-a": 4 * GiB, "engine-b": GiB},
            aggregator_pending_requests={"engine-a": 3, "engine-b": 0},
            host_pool_capacity_bytes=8 * GiB,
            host_pool_used_bytes=GiB,
            inflight_moves=5,
            host_blocks_capacity={"engine-a": 4096, "engine-b": 0},
            host_blocks_used={"engine-a": 1000, "engine-b": 0},
        )
        record_workload(h.metrics)
        h.metrics.record_move_failure("peer_recv", "peer_timeout")
        for kind in LAYOUT_FIX_KINDS:
            h.metrics.record_layout_fix(kind)
        h.metrics.record_command("register", "ok", 0.00008)
        h.metrics.record_command("move", "bad_block_id", 0.00002)
        h.metrics.record_lease_expiry("engine-b")
        h.metrics.set_insecure_transport(True)

        response = await http_get(h.server.port, "/metrics")
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        body = response.body

    proc = await asyncio.create_subprocess_exec(
        promtool,
        "check",
        "metrics",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(body), 30)
    assert proc.returncode == 0, out.decode()
    assert out.decode().strip() == "", out.decode()

    text = body.decode()
    for name in (
        "kvsidecar_moved_bytes_total",
        "kvsidecar_moves_total",
        "kvsidecar_move_seconds_total",
        "kvsidecar_move_duration_seconds_bucket",
        "kvsidecar_move_failures_total",
        "kvsidecar_layout_fixes_total",
        "kvsidecar_commands_total",
        "kvsidecar_command_duration_seconds_bucket",
        "kvsidecar_lease_expiries_total",
        "kvsidecar_registered_workers",
        "kvsidecar_registered_buffer_bytes",
        "kvsidecar_aggregator_pending_requests",
        "kvsidecar_host_pool_capacity_bytes",
        "kvsidecar_host_pool_used_bytes",
        "kvsidecar_inflight_moves",
        "kvsidecar_insecure_transport 1.0",
        "kvsidecar_build_info{",
        "kvsidecar_event_loop_lag_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    # Buckets span 100 us .. 10 s.
    assert 'kvsidecar_move_duration_seconds_bucket{kind="local",le="0.0001"}' in text
    assert 'kvsidecar_move_duration_seconds_bucket{kind="local",le="10.0"}' in text


async def test_openmetrics_on_request_and_head() -> None:
    async with serving() as h:
        h.metrics.record_move("offload", "engine-a", 4096, 0.001)
        response = await http_get(
            h.server.port,
            "/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"},
        )
        assert response.status == 200
        assert response.headers["content-type"].startswith("application/openmetrics-text")
        assert response.body.endswith(b"# EOF\n")
        text = response.body.decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}  # type: ignore[no-untyped-call]
        assert families["kvsidecar_moved_bytes"].type == "counter"

        head = await http_get(h.server.port, "/metrics", method="HEAD")
        assert head.status == 200 and head.body == b""
        assert int(head.headers["content-length"]) > 1000


# --------------------------------------------------------------------------------------------------
# (3) health, readiness, and the HTTP edge
# --------------------------------------------------------------------------------------------------


async def test_healthz_and_readyz_follow_daemon_lifecycle() -> None:
    async with serving() as h:
        port = h.server.port
        assert port > 0 and h.server.url == f"http://127.0.0.1:{port}"
        assert (await http_get(port, "/healthz")).status == 200

        starting = await http_get(port, "/readyz")
        assert starting.status == 503
        assert b"sockets not bound" in starting.body
        assert b"host pool not allocated" in starting.body

        h.state.ready = replace(h.state.ready, sockets_bound=True)
        half = await http_get(port, "/readyz")
        assert half.status == 503 and b"sockets" not in half.body

        h.state.ready = replace(h.state.ready, host_pool_allocated=True)
        ready = await http_get(port, "/readyz")
        assert (ready.status, ready.body) == (200, b"ready\n")

        h.state.ready = replace(h.state.ready, draining=True)
        draining = await http_get(port, "/readyz")
        assert draining.status == 503 and b"draining" in draining.body
        assert (await http_get(port, "/healthz")).status == 200  # alive while draining
        assert (await http_get(port, "/readyz?verbose=1")).status == 503

    with pytest.raises(OSError):  # stopped: nothing listens any more
        await http_get(port, "/healthz")


async def test_healthz_reports_a_stalled_event_loop() -> None:
    async with serving(watchdog_interval_s=0.02, max_loop_lag_s=0.15, stall_hold_s=0.6) as h:
        h.state.ready = Readiness(sockets_bound=True, host_pool_allocated=True, draining=False)
        await asyncio.sleep(0.1)
        assert (await http_get(h.server.port, "/healthz")).status == 200

        time.sleep(0.4)  # what a copy run on the loop by mistake would do
        stalled = await http_get(h.server.port, "/healthz")
        assert stalled.status == 503 and b"stalled" in stalled.body
        assert (await http_get(h.server.port, "/readyz")).status == 503

        deadline = time.monotonic() + 5
        while (await http_get(h.server.port, "/healthz")).status != 200:
            assert time.monotonic() < deadline, "healthz did not recover"
            await asyncio.sleep(0.05)
        assert (await http_get(h.server.port, "/readyz")).status == 200

        count = sample(h.registry, "kvsidecar_event_loop_lag_seconds_count")
        slow = sample(h.registry, "kvsidecar_event_loop_lag_seconds_bucket", le="0.25")
        assert count is not None and slow is not None
        assert count - slow >= 1  # the 0.4 s stall landed above the 0.25 s bucket


async def test_unknown_path_method_and_malformed_request() -> None:
    async with serving() as h:
        port = h.server.port
        assert (await http_get(port, "/nope")).status == 404
        assert (await http_get(port, "/metrics/")).status == 404
        post = await http_get(port, "/metrics", method="POST")
        assert post.status == 405 and post.headers["allow"] == "GET, HEAD"
        assert (await http_raw(port, b"hello\r\n\r\n")).status == 400
        assert (await http_raw(port, b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n")).status == 400
        assert (await http_get(port, "/healthz")).status == 200


async def test_oversize_request_head_is_refused() -> None:
    async with serving(max_request_bytes=4096) as h:
        pad = b"a" * 6000  # over the limit, under twice it: all of it is read before the answer
        response = await http_raw(
            h.server.port, b"GET /metrics HTTP/1.1\r\nX-Pad: " + pad + b"\r\n\r\n"
        )
        assert response.status == 431


async def test_endless_request_is_cut_off_and_server_keeps_serving() -> None:
    async with serving(max_request_bytes=4096) as h:
        reader, writer = await asyncio.open_connection("127.0.0.1", h.server.port)

        async def flood() -> None:
            with contextlib.suppress(ConnectionError):
                writer.write(b"GET /metrics HTTP/1.1\r\nX-Pad: ")
                for _ in range(64):
                    writer.write(b"a" * 65536)
                    await writer.drain()

        flooding = asyncio.create_task(flood())
        try:
            data = await asyncio.wait_for(reader.read(), 5)
            assert data == b"" or data.startswith(b"HTTP/1.1 431")
        except ConnectionError:
            pass  # reset because the flood was left unread: also a bounded outcome
        await asyncio.wait_for(flooding, 5)
        writer.close()
        assert (await http_get(h.server.port, "/healthz")).status == 200


async def test_incomplete_request_times_out() -> None:
    async with serving(request_timeout_s=0.2) as h:
        started = time.monotonic()
        response = await http_raw(h.server.port, b"GET /metrics HTTP/1.1\r\n")
        assert response.status == 408
        assert time.monotonic() - started < 2


async def test_close_aborts_idle_connections() -> None:
    h_cm = serving(request_timeout_s=30)
    h = await h_cm.__aenter__()
    reader, writer = await asyncio.open_connection("127.0.0.1", h.server.port)
    writer.write(b"GET /met")
    await writer.drain()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(h_cm.__aexit__(None, None, None), 2)  # does not wait 30 s
    assert await asyncio.wait_for(reader.read(), 2) == b""
    writer.close()


# --------------------------------------------------------------------------------------------------
# (4) engine lifecycle: label sets go away with the engine
# --------------------------------------------------------------------------------------------------


def _engine_samples(registry: CollectorRegistry, engine: str) -> list[str]:
    return [
        sample.name
        for family in registry.collect()
        for sample in family.samples
        if sample.labels.get("engine") == engine
    ]


async def test_remove_engine_removes_every_label_set() -> None:
    state = FakeDaemonState(StateSnapshot(registered_workers={"engine-a": 1, "engine-b": 1}))
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry, state=state)
    metrics.add_engine("engine-a")
    record_workload(metrics)
    metrics.record_lease_expiry("engine-a")
    metrics.record_lease_expiry("engine-b")
    metrics.record_move_failure("onboard", "engine_gone")

    labels_a = {"kind": "offload", "engine": "engine-a"}
    assert registry.get_sample_value("kvsidecar_moved_bytes_total", labels_a) == 4 * MiB
    assert sample(registry, "kvsidecar_lease_expiries_total", engine="engine-a") == 1

    metrics.remove_engine("engine-a")
    state.snapshot = StateSnapshot(registered_workers={"engine-b": 1})  # the daemon forgets it too

    for name in (
        "kvsidecar_moved_bytes_total",
        "kvsidecar_moves_total",
        "kvsidecar_move_seconds_total",
    ):
        for kind in MOVE_KINDS:
            assert registry.get_sample_value(name, {"kind": kind, "engine": "engine-a"}) is None
            assert registry.get_sample_value(name, {"kind": kind, "engine": "engine-b"}) is not None
    assert sample(registry, "kvsidecar_lease_expiries_total", engine="engine-a") is None
    assert _engine_samples(registry, "engine-a") == []
    assert sample(registry, "kvsidecar_lease_expiries_total", engine="engine-b") == 1
    # Not engine-labelled: kept.
    assert (
        sample(registry, "kvsidecar_move_failures_total", kind="onboard", code="engine_gone") == 1
    )
    assert sample(registry, "kvsidecar_move_duration_seconds_count", kind="offload") == 2

    # An engine that comes back starts from scratch (Prometheus reads it as a counter reset).
    metrics.record_move("offload", "engine-a", 100, 0.001)
    assert registry.get_sample_value("kvsidecar_moved_bytes_total", labels_a) == 100


async def test_remove_engine_after_grace_period_and_comeback_cancels_it() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    labels = {"engine": "engine-a"}
    metrics.record_lease_expiry("engine-a")

    metrics.remove_engine("engine-a", grace_s=0.1)
    assert registry.get_sample_value("kvsidecar_lease_expiries_total", labels) == 1  # still scraped
    await asyncio.sleep(0.2)
    assert registry.get_sample_value("kvsidecar_lease_expiries_total", labels) is None

    metrics.record_lease_expiry("engine-a")
    metrics.remove_engine("engine-a", grace_s=0.1)
    metrics.add_engine("engine-a")  # re-registered within the grace period
    await asyncio.sleep(0.2)
    assert registry.get_sample_value("kvsidecar_lease_expiries_total", labels) == 1


async def test_state_gauges_are_read_at_scrape_time() -> None:
    async with serving() as h:
        h.state.snapshot = StateSnapshot(
            registered_workers={"engine-a": 2, "engine-b": 4},
            registered_buffer_bytes={"engine-a": GiB, "engine-b": 2 * GiB},
            host_pool_capacity_bytes=4 * GiB,
            host_pool_used_bytes=3 * MiB,
            inflight_moves=7,
        )
        get = h.registry.get_sample_value
        assert get("kvsidecar_registered_workers", {"engine": "engine-b"}) == 4
        assert get("kvsidecar_registered_buffer_bytes", {"engine": "engine-a"}) == GiB
        assert get("kvsidecar_host_pool_capacity_bytes") == 4 * GiB
        assert get("kvsidecar_host_pool_used_bytes") == 3 * MiB
        assert get("kvsidecar_inflight_moves") == 7

        h.state.snapshot = replace(
            h.state.snapshot, registered_workers={"engine-a": 2}, inflight_moves=0
        )
        assert get("kvsidecar_registered_workers", {"engine": "engine-b"}) is None
        assert get("kvsidecar_inflight_moves") == 0

        # A failing provider costs its gauges, not the scrape.
        h.state.fail = True
        h.metrics.record_move("local", "engine-a", 10, 0.001)
        response = await http_get(h.server.port, "/metrics")
        assert response.status == 200
        assert b"kvsidecar_inflight_moves " not in response.body
        assert b'kvsidecar_moved_bytes_total{engine="engine-a",kind="local"} 10.0' in response.body

        h.metrics.attach_state(None)
        assert get("kvsidecar_inflight_moves") is None


# --------------------------------------------------------------------------------------------------
# (5) byte-weighted throughput, and the input rules that keep the counters usable
# --------------------------------------------------------------------------------------------------


def test_throughput_is_byte_weighted_not_mean_of_move_rates() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    metrics.add_engine("engine-a")

    def scrape() -> dict[str, float]:
        get = registry.get_sample_value
        return {
            "bytes": get("kvsidecar_moved_bytes_total", {"kind": "offload", "engine": "engine-a"})
            or 0.0,
            "sum": get("kvsidecar_move_duration_seconds_sum", {"kind": "offload"}) or 0.0,
            "seconds": get(
                "kvsidecar_move_seconds_total", {"kind": "offload", "engine": "engine-a"}
            )
            or 0.0,
        }

    before = scrape()
    moves = [(GiB, 0.5), (MiB, 0.01)]  # 2 GiB/s and 100 MiB/s
    for nbytes, seconds in moves:
        metrics.record_move("offload", "engine-a", nbytes, seconds)
    after = scrape()

    # rate(x[w]) = delta(x) / w for both series over the same window: w cancels in the quotient.
    window = 30.0
    rate = {key: (after[key] - before[key]) / window for key in after}
    byte_weighted = rate["bytes"] / rate["sum"]
    assert byte_weighted == pytest.approx((GiB + MiB) / 0.51)
    assert rate["bytes"] / rate["seconds"] == pytest.approx(byte_weighted)

    mean_of_rates = sum(n / s for n, s in moves) / len(moves)
    assert not math.isclose(byte_weighted, mean_of_rates, rel_tol=0.1)  # ~2.0 vs ~1.05 GiB/s


def test_record_rules() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    with pytest.raises(ValueError, match="move kind"):
        metrics.record_move("sideways", "engine-a", 1, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="move kind"):
        metrics.record_move_failure("sideways", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout fix kind"):
        metrics.record_layout_fix("transpose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        metrics.record_move("local", "engine-a", -1, 0.1)
    assert (
        sample(registry, "kvsidecar_moves_total", kind="local", engine="engine-a") == 0
    )  # nothing half-recorded

    # A negative or NaN duration must not make the histogram's _sum go down (a fake reset).
    metrics.record_move("local", "engine-a", 10, 0.25)
    metrics.record_move("local", "engine-a", 10, -1.0)
    metrics.record_move("local", "engine-a", 10, float("nan"))
    assert sample(registry, "kvsidecar_move_duration_seconds_sum", kind="local") == pytest.approx(
        0.25
    )
    assert sample(registry, "kvsidecar_move_duration_seconds_count", kind="local") == 3

    metrics.record_command("collect", "ok", 0.0001)
    metrics.record_command("collect", "stale_step", 0.00005)
    assert sample(registry, "kvsidecar_commands_total", command="collect", result="stale_step") == 1
    assert sample(registry, "kvsidecar_command_duration_seconds_count", command="collect") == 2


def test_metrics_live_only_on_the_injected_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    a = DaemonMetrics(first)
    DaemonMetrics(second, build_labels={"version": "9.9.9"})
    a.record_move("peer_send", "engine-a", 123, 0.01)
    assert sample(first, "kvsidecar_moved_bytes_total", kind="peer_send", engine="engine-a") == 123
    assert (
        sample(second, "kvsidecar_moved_bytes_total", kind="peer_send", engine="engine-a") is None
    )
    assert prometheus_client.REGISTRY.get_sample_value("kvsidecar_insecure_transport") is None
    info = [s for f in second.collect() if f.name == "kvsidecar_build" for s in f.samples]
    assert info[0].labels["version"] == "9.9.9" and info[0].labels["torch"]
    with pytest.raises(ValueError):  # a second set on one registry is a clash, not a silent merge
        DaemonMetrics(first)


# --------------------------------------------------------------------------------------------------
# (6) the hot-path tally: prometheus_client's own histogram as the reference
# --------------------------------------------------------------------------------------------------


def test_tally_matches_prometheus_client_buckets_and_sums() -> None:
    """Commands and move durations land in the buckets prometheus_client's Histogram picks.

    Values on a bound, between bounds, below the first, above the last, zero and negative
    (clamped to 0): the exported buckets, count and sum equal a reference `Histogram`'s.
    """
    from prometheus_client import Histogram

    from kvsidecar.daemon.metrics.families import COMMAND_DURATION_BUCKETS, MOVE_DURATION_BUCKETS

    values = [0.0, -1.0, 1e-9, 0.000025, 0.00003, 0.0001, 0.00025, 0.0049, 0.25, 0.3, 1.0, 99.0]
    values += list(COMMAND_DURATION_BUCKETS) + list(MOVE_DURATION_BUCKETS)
    registry, reference = CollectorRegistry(), CollectorRegistry()
    metrics = DaemonMetrics(registry)
    ref_cmd = Histogram("c", "c", buckets=COMMAND_DURATION_BUCKETS, registry=reference)
    ref_move = Histogram("m", "m", buckets=MOVE_DURATION_BUCKETS, registry=reference)
    for v in values:
        metrics.record_command("move", "ok", v)
        metrics.record_move("local", "engine-a", 1, v)
        ref_cmd.observe(max(v, 0.0))
        ref_move.observe(max(v, 0.0))
    for bounds, ours, ref, labels in (
        (COMMAND_DURATION_BUCKETS, "kvsidecar_command_duration_seconds", "c", {"command": "move"}),
        (MOVE_DURATION_BUCKETS, "kvsidecar_move_duration_seconds", "m", {"kind": "local"}),
    ):
        for le in [*(prometheus_client.utils.floatToGoString(b) for b in bounds), "+Inf"]:  # type: ignore[no-untyped-call]
            got = sample(registry, f"{ours}_bucket", **labels, le=le)
            want = reference.get_sample_value(f"{ref}_bucket", {"le": le})
            assert got == want, (ours, le)
        assert sample(registry, f"{ours}_count", **labels) == len(values)
        assert sample(registry, f"{ours}_sum", **labels) == pytest.approx(
            reference.get_sample_value(f"{ref}_sum")
        )
    assert sample(registry, "kvsidecar_commands_total", command="move", result="ok") == len(values)
    assert sample(registry, "kvsidecar_moves_total", kind="local", engine="engine-a") == len(values)


def test_tally_scrapes_while_threads_add_series() -> None:
    """A scrape while copy threads count commands (new series among them) sees a whole state.

    Replies sent from copy threads count their commands there, so a command's first series may
    be created while the loop builds the exposition: nothing may fail, nothing may be lost.
    """
    import sys
    import threading

    from prometheus_client import generate_latest

    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    per_thread, threads = 3_000, 2
    results = [f"code_{i}" for i in range(per_thread)]  # a new series per record

    def record() -> None:
        for result in results:
            metrics.record_command("move", result, 0.0001)

    workers = [threading.Thread(target=record) for _ in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, mid-scrape
    try:
        for t in workers:
            t.start()
        while any(t.is_alive() for t in workers):
            generate_latest(registry)
        for t in workers:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    for result in (results[0], results[-1]):
        assert sample(registry, "kvsidecar_commands_total", command="move", result=result) == 2
    total = per_thread * threads
    assert sample(registry, "kvsidecar_command_duration_seconds_count", command="move") == total
