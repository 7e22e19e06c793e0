"""The asyncio client's transport, and the order of replies sent from copy threads.

Real daemon processes, real sockets: the client reads a plain pyzmq socket from a loop reader
callback and sends without blocking; the daemon answers a successful move from the copy thread
that ran it, and must still have settled that move before it handles the client's next request.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import numpy as np
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError
from kvsidecar.memory.shm import allocate_kv_caches
from tests.support.daemons import daemon_process, make_config

pytestmark = pytest.mark.timeout(120)


async def test_no_daemon_is_a_timeout_not_a_hang() -> None:
    """Nothing listens at the endpoint: the request waits in the socket and the call times out."""
    config = make_config()
    client = AsyncSidecarClient(config.endpoint, timeout_s=0.3, heartbeat=False)
    started = time.monotonic()
    try:
        with pytest.raises(SidecarError) as err:
            await client.start()
        assert err.value.code == "timeout"
        assert time.monotonic() - started < 2.0
    finally:
        await client.close()
        os.rmdir(config.runtime_dir)


async def test_stopped_daemon_times_out_every_call_then_serves_again() -> None:
    """More calls than the socket queue holds, to a SIGSTOPped daemon: each ends as a timeout
    within its bound; once the daemon runs again the stale replies are dropped and calls work.
    """
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, object]] = []  # e.g. "Future exception was never retrieved"
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    with daemon_process() as daemon:
        async with AsyncSidecarClient(daemon.config.endpoint, timeout_s=5, heartbeat=False) as c:
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                calls = [c.status(timeout=1.0) for _ in range(3000)]  # queue limit is 1000
                results = await asyncio.gather(*calls, return_exceptions=True)
                elapsed = time.monotonic() - started
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            codes = {r.code if isinstance(r, SidecarError) else type(r).__name__ for r in results}
            assert codes == {"timeout"}, codes
            assert elapsed < 5.0
            status = await c.status()
            assert status.draining is False
            # Nothing left waiting in the client for the stale replies.
            await asyncio.sleep(0.5)
            assert c._transport._pending == {}
    del results, calls
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert unhandled == []


async def test_a_move_is_settled_before_the_next_request_is_read() -> None:
    """Every move's reply comes from its copy thread; the status and collect sent right after
    it must already count and credit it, and see nothing in flight."""
    caches_a = allocate_kv_caches(2, (64, 16, 4, 32), torch.float16)
    caches_b = allocate_kv_caches(2, (64, 16, 4, 32), torch.float16)
    for t in caches_a:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.float16))
    # No heartbeats here (they would be requests between a move and its status): a lease longer
    # than the 600 round trips take on a loaded 2-core machine keeps both workers registered.
    with daemon_process(make_config(lease_s=60.0)) as daemon:
        endpoint = daemon.config.endpoint
        async with (
            AsyncSidecarClient(endpoint, heartbeat=False) as a,
            AsyncSidecarClient(endpoint, heartbeat=False) as b,
        ):
            await a.register_kv_caches(
                {f"l{i}": t for i, t in enumerate(caches_a)}, engine_id="A", arrangement="split"
            )
            await b.register_kv_caches(
                {f"l{i}": t for i, t in enumerate(caches_b)}, engine_id="B", arrangement="split"
            )
            await b.grant("A", read=False, write=True)
            src, dst = BufferSetRef(a.worker), BufferSetRef(b.worker)
            rng = np.random.default_rng(7)
            before = (await a.status()).moves_total
            for i in range(200):
                s, d = rng.choice(64, size=2, replace=False), rng.choice(64, size=2, replace=False)
                moved = await a.move(src, dst, s, d, request_ids=[f"r{i}"])
                status = await a.status()
                assert status.moves_total == before + i + 1
                assert status.in_flight_moves == 0
                collected = await b.collect("B", step=i, timeout_s=0.0)
                assert collected.output.finished_recving == {f"r{i}"}
                assert moved.blocks == 2
                for layer in range(2):
                    assert torch.equal(caches_b[layer][d], caches_a[layer][s])
