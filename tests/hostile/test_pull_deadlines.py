"""A pull reported failed never writes its destination again.

A local pull (two engines of one daemon process) of more than its timeout can copy fails at the
timeout with every local block invalid: vLLM then hands those blocks to the recompute. The test
plays the engine: as soon as the failure arrives it writes its own bytes into the blocks, waits,
and checks that nothing of the producer's landed over them afterwards.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from tests.support.daemons import StartDaemon

pytestmark = pytest.mark.timeout(180)

LAYERS, BLOCKS = 16, 2048
SHAPE = (2, BLOCKS, 16, 8, 64)  # kv_first bfloat16: 64 MiB per layer, 1 GiB per engine


def _engine(endpoint: str, name: str, fill: float) -> tuple[SidecarClient, list[torch.Tensor]]:
    caches = allocate_kv_caches(LAYERS, SHAPE, torch.bfloat16)
    for t in caches:
        t.fill_(fill)
    client = SidecarClient(endpoint, name=name, timeout_s=60)
    client.register_kv_caches({f"layer{i}": t for i, t in enumerate(caches)}, engine_id=name)
    return client, caches


def test_a_local_pull_that_timed_out_writes_nothing_after_its_failure(
    daemon_factory: StartDaemon,
) -> None:
    daemon = daemon_factory(host_pool_bytes=8 << 20, peer_lease_s=30.0)
    prod, _src = _engine(daemon.config.endpoint, "prod", 1.0)
    cons, dst = _engine(daemon.config.endpoint, "cons", 0.0)
    blocks = list(range(BLOCKS))
    last = dst[-1]  # the copy goes layer by layer: the last layer is written last
    try:
        seen_failure = False
        for n, timeout_s in enumerate((0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4)):  # some: mid-copy
            for t in dst:
                t.fill_(0.0)
            prod.publish("prod", f"big{n}", blocks)
            out = cons.submit_pull(
                "cons", "", "prod", {f"big{n}": (blocks, blocks)}, tp_rank=0, timeout_s=timeout_s
            ).result()
            if out.finished:
                continue
            assert out.failed == [f"big{n}"] and out.invalid_block_ids == blocks
            last.fill_(7.0)  # the engine recomputes into blocks it was told are invalid
            time.sleep(1.0)
            assert bool((last == 7.0).all()), (timeout_s, "written after the failure")
            seen_failure = seen_failure or bool((dst[0] != 0).any())
        # At least one timeout fell inside the copy (the first layer had landed before it).
        assert seen_failure
    finally:
        cons.close()
        prod.close()
