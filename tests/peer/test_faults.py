"""A producer daemon SIGKILLed in the middle of a pull: its requests fail at once.

Its own pair of daemons (the producer dies), ZMQ plane, one chunk in flight so that the pull of
256 MiB is certainly still running when the producer is killed. The pull carries two requests:
when the producer dies, one has a chunk in flight and the other waits behind the stream's window;
both must fail at once (docs/reliability.md), not the waiting one at the pull's timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvsidecar.client import SidecarClient
from tests.support.children import peer_workers
from tests.support.daemons import peer_daemon

pytestmark = pytest.mark.timeout(120)

BIG = {"layers": 8, "blocks": 512, "block_size": 16, "heads": 8, "head_size": 128}


def test_producer_killed_mid_transfer() -> None:
    bounds = {"peer_max_in_flight": 1, "peer_chunk_bytes": 1 << 20}
    p = {**BIG, "engine": "p", "seed": 1, "tp_size": 1, "fill": False}
    c = {**BIG, "engine": "c", "seed": 2, "tp_size": 1, "fill": False}
    with (
        peer_daemon(**bounds) as prod,
        peer_daemon(**bounds, peer_endpoint="", peer_pull_timeout_s=20) as cons,
        peer_workers({"endpoints": [prod.config.endpoint], "engines": [p]}),
        peer_workers({"endpoints": [cons.config.endpoint], "engines": [c]}),
        SidecarClient(cons.config.endpoint, timeout_s=30) as cc,
    ):
        ids = list(range(512))
        items = {"first": (ids[:256], ids[:256]), "second": (ids[256:], ids[256:])}
        result: dict[str, Any] = {}

        def pull() -> None:
            start = time.monotonic()
            result["pulled"] = cc.pull("c", prod.config.peer_endpoint, "p", items)
            result["took"] = time.monotonic() - start

        with SidecarClient(prod.config.endpoint) as pc:
            for rid, (remote, _) in items.items():
                pc.publish("p", rid, remote)
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
        assert sorted(pulled.failed) == ["first", "second"] and pulled.finished == []
        assert pulled.error_code == "peer_unavailable"
        assert len(pulled.invalid_block_ids) == 512
        # Disconnect detection fails both long before the 20 s pull timeout.
        assert result["took"] < 10, result
        (event,) = cc.take_peer_events("c")
        assert event.failed_recving == {"first", "second"}
        assert len(event.invalid_block_ids) == 512
        # The consumer keeps serving, and a new pull to the dead endpoint fails cleanly.
        assert cc.status().engines[0].engine_id == "c"
        again = cc.pull("c", prod.config.peer_endpoint, "p", {"again": ([1], [1])})
        assert again.failed == ["again"]
