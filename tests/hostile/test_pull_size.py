"""No pull's size makes other clients wait: its planning, checks and copies stay off the loop.

A local pull of a 1024-layer engine's 4096 blocks, in permuted order (no two ranges merge: about
8.4 million ranges), sent as a raw ``Pull`` while other connections send raw ``hello`` and
``status`` and a raw HTTP client asks ``/healthz``, as a kubelet would. Before, the event loop
held that pull's plan and range checks for seconds (12 s measured, and longer on a busy host),
and every other client waited. Now the plan is made on a thread, the checks and the copy run on a
copy thread in slices, and the loop answers the others throughout. A pull of more block-layers
than `kvsidecar.peer.pull.MAX_PULL_BLOCK_LAYERS` is refused ``too_large`` before anything is
planned. The figures (round trips, the loop's longest lag from its own histogram) are printed and
written to ``pull_size.json`` in the test's tmp dir (docs/reliability.md quotes them).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.peer.pull import MAX_PULL_BLOCK_LAYERS
from kvsidecar.wire.protocol import PROTOCOL_VERSION, Error, Hello, HelloReply, Status
from kvsidecar.wire.pulls import Pull, Pulled, PullItem
from tests.support.attack import PROBE_S, http_status
from tests.support.daemons import daemon_process, make_config
from tests.support.raw import Raw

pytestmark = pytest.mark.timeout(300)

LAYERS, BLOCKS = 1024, 4096


def _engine(endpoint: str, name: str, seed: int) -> tuple[SidecarClient, list[torch.Tensor]]:
    caches = allocate_kv_caches(LAYERS, (2, BLOCKS, 1, 1, 8), torch.float16)
    gen = torch.Generator().manual_seed(seed)
    for t in caches[:: LAYERS // 8]:  # a few layers hold values to compare; the rest zeros
        t.copy_(torch.randn(t.shape, generator=gen))
    client = SidecarClient(endpoint, name=name, timeout_s=120)
    client.register_kv_caches({f"l{i}": t for i, t in enumerate(caches)}, engine_id=name)
    return client, caches


def _lag_seconds(port: int) -> dict[str, float]:
    """The loop-lag histogram's buckets (``le`` -> count), from a raw scrape of /metrics."""
    with socket.create_connection(("127.0.0.1", port), timeout=PROBE_S) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    buckets = {}
    for line in data.decode().splitlines():
        if line.startswith("kvsidecar_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    return buckets


def _longest(before: dict[str, float], after: dict[str, float]) -> str:
    """The smallest bucket bound that holds every lag seen between the two scrapes."""
    total = after["+Inf"] - before["+Inf"]
    for le in sorted(after, key=float):
        if after[le] - before.get(le, 0.0) >= total:
            return le
    return "+Inf"


class _Probes:
    """Other clients, raw: hello and status on their own connections, and /healthz."""

    def __init__(self, endpoint: str, port: int) -> None:
        self.endpoint, self.port = endpoint, port
        self.trips: list[float] = []
        self.health: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._control, daemon=True),
            threading.Thread(target=self._http, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _control(self) -> None:
        with Raw(self.endpoint) as raw:
            while not self._stop.is_set():
                hello = Hello(id=raw.next_id(), protocol_version=PROTOCOL_VERSION)
                for msg in (hello, Status(id=raw.next_id())):
                    t = time.monotonic()
                    reply = raw.call(msg, timeout=60)
                    self.trips.append(time.monotonic() - t)
                    assert isinstance(reply, HelloReply) or not isinstance(reply, Error), reply
                time.sleep(0.02)

    def _http(self) -> None:
        while not self._stop.is_set():
            code = http_status(self.port)
            self.health[code] = self.health.get(code, 0) + 1
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def test_a_huge_local_pull_holds_no_other_client(tmp_path: Path) -> None:
    config = make_config(host_pool_bytes=0, lease_s=120.0, peer_lease_s=120.0)
    with daemon_process(config):
        producer, src = _engine(config.endpoint, "p", 1)
        consumer, dst = _engine(config.endpoint, "c", 2)
        try:
            port = producer.daemon.metrics_port
            remote = np.random.default_rng(3).permutation(BLOCKS)
            local = np.random.default_rng(4).permutation(BLOCKS)
            producer.publish("p", "huge", remote.tolist())
            lag_before = _lag_seconds(port)
            probes = _Probes(config.endpoint, port)
            time.sleep(1.0)  # calm round trips first
            with Raw(config.endpoint) as raw:
                started = time.monotonic()
                pull = Pull(
                    id=raw.next_id(),
                    engine_id="c",
                    remote_endpoint="",
                    remote_engine_id="p",
                    items=[PullItem("huge", BLOCKS, BLOCKS)],
                    tp_rank=0,
                    timeout_s=240.0,
                )
                reply = raw.call(pull, remote.tobytes(), local.tobytes(), timeout=250)
                pull_s = time.monotonic() - started
                # One block more than a pull may name per layer: refused before any planning.
                over = MAX_PULL_BLOCK_LAYERS // LAYERS + 1
                many = np.resize(remote, over)
                t = time.monotonic()
                refused = raw.call(
                    Pull(
                        id=raw.next_id(),
                        engine_id="c",
                        remote_endpoint="",
                        remote_engine_id="p",
                        items=[PullItem("over", over, BLOCKS)],
                        tp_rank=0,
                    ),
                    many.tobytes(),
                    local.tobytes(),
                )
                refused_s = time.monotonic() - t
            time.sleep(1.0)
            probes.stop()
            lag_after = _lag_seconds(port)
            for layer in range(0, LAYERS, LAYERS // 8):
                for s, d in list(zip(remote, local, strict=True))[:64]:
                    assert torch.equal(dst[layer][:, d], src[layer][:, s]), (layer, s, d)
        finally:
            producer.close()
            consumer.close()
    figures = {
        "pull_s": round(pull_s, 2),
        "ranges": 2 * LAYERS * BLOCKS,
        "round_trips": len(probes.trips),
        "longest_round_trip_s": round(max(probes.trips), 3),
        "p99_round_trip_ms": round(
            sorted(probes.trips)[int(0.99 * (len(probes.trips) - 1))] * 1e3, 1
        ),
        "longest_loop_lag_at_most_s": _longest(lag_before, lag_after),
        "healthz": probes.health,
        "too_large_refused_in_s": round(refused_s, 3),
    }
    (tmp_path / "pull_size.json").write_text(json.dumps(figures, indent=2))
    print(f"\nhuge local pull: {json.dumps(figures)}")
    assert isinstance(reply, Pulled) and reply.finished == ["huge"], reply
    assert isinstance(refused, Error) and refused.code == "too_large", refused
    assert refused_s < 2.0, figures
    assert max(probes.trips) < 2.0, figures  # 12 s and more before
    assert set(probes.health) == {"200"}, figures
