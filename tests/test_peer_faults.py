"""A producer daemon SIGKILLed in the middle of a pull: the request fails, in bounded time.

Its own pair of daemons (the producer dies), ZMQ plane over three data streams, small chunks
and few in flight so that the pull of two requests of 128 MiB is certainly still running when
the producer is killed; both requests fail.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from tests.peer_harness import daemon, peer_config, peer_workers

pytestmark = pytest.mark.timeout(120)

BIG = {"layers": 8, "blocks": 512, "block_size": 16, "heads": 8, "head_size": 128}


def test_producer_killed_mid_transfer() -> None:
    prod_cfg = peer_config(peer_max_in_flight=1, peer_chunk_bytes=1 << 20)
    cons_cfg = peer_config(
        peer_endpoint="",
        peer_max_in_flight=3,
        peer_streams=3,
        peer_chunk_bytes=16 << 10,  # thousands of chunk round trips: seconds, not milliseconds
        peer_pull_timeout_s=20,
    )
    p = {**BIG, "engine": "p", "seed": 1, "tp_size": 1, "fill": False}
    c = {**BIG, "engine": "c", "seed": 2, "tp_size": 1, "fill": False}
    with (
        daemon(prod_cfg) as prod,
        daemon(cons_cfg) as cons,
        peer_workers({"endpoints": [prod.config.endpoint], "engines": [p]}),
        peer_workers({"endpoints": [cons.config.endpoint], "engines": [c]}),
        SidecarClient(cons.config.endpoint, timeout_s=30) as cc,
    ):
        ids = list(range(512))
        halves = {"big": (ids[:256], ids[:256]), "big2": (ids[256:], ids[256:])}
        result: dict[str, Any] = {}

        def pull() -> None:
            start = time.monotonic()
            result["pulled"] = cc.pull("c", prod.config.peer_endpoint, "p", halves)
            result["took"] = time.monotonic() - start

        with SidecarClient(prod.config.endpoint) as pc:
            pc.publish("p", "big", ids[:256])
            pc.publish("p", "big2", ids[256:])
            # Wait until the producer is serving reads, then kill it.
            thread = threading.Thread(target=pull)
            thread.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.02)
                if pc.status().engines and thread.is_alive():
                    break
        time.sleep(0.1)
        assert thread.is_alive(), "the pull finished before the producer could be killed"
        prod.proc.kill()
        thread.join(30)
        pulled = result["pulled"]
        assert sorted(pulled.failed) == ["big", "big2"] and pulled.finished == []
        assert pulled.error_code == "peer_unavailable"
        assert len(pulled.invalid_block_ids) == 512
        # Disconnect detection fails it long before the 20 s pull timeout.
        assert result["took"] < 10, result
        (event,) = cc.take_peer_events("c")
        assert event.failed_recving == {"big", "big2"} and len(event.invalid_block_ids) == 512
        # The consumer keeps serving, and a new pull to the dead endpoint fails cleanly.
        assert cc.status().engines[0].engine_id == "c"
        again = cc.pull("c", prod.config.peer_endpoint, "p", {"again": ([1], [1])})
        assert again.failed == ["again"]
