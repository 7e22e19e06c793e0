"""`MoveBatch` (kvsidecar/wire/batch.py, kvsidecar/node/batch.py) through a real daemon process.

Two engines in shared memory, both clients. A batch's items run in order as one job, each is
checked on its own (a bad item gets its typed error, the others run), and each item's engine
requests are credited as a move's would be. The bytes are compared element by element with the
same moves applied by plain torch indexing, in order, to copies of the caches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvsidecar.client import (
    AsyncSidecarClient,
    BatchMove,
    BufferSetRef,
    SidecarClient,
    SidecarError,
)
from tests.support.caches import random_caches
from tests.support.daemons import daemon_process, make_config

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, SHAPE = 3, 32, (32, 16, 4, 32)


def _caches(seed: int) -> list[torch.Tensor]:
    return random_caches(LAYERS, SHAPE, seed)


def _apply(
    want: dict[str, list[torch.Tensor]], moves: list[tuple[str, str, list[int], list[int], Any]]
) -> None:
    """The reference: each move as plain indexing, in order (``layers`` None: every layer)."""
    for src, dst, s, d, layers in moves:
        for i in range(LAYERS) if layers is None else layers:
            want[dst][i][d] = want[src][i][s].clone()


def _register(client: SidecarClient, caches: list[torch.Tensor], engine: str) -> None:
    client.register_kv_caches(
        {f"l{i}": t for i, t in enumerate(caches)}, engine_id=engine, arrangement="split"
    )


def test_batch_items_run_in_order_each_checked_on_its_own() -> None:
    ca, cb = _caches(1), _caches(2)
    want = {"A": [t.clone() for t in ca], "B": [t.clone() for t in cb]}
    with (
        daemon_process(make_config(lease_s=60.0)) as daemon,
        SidecarClient(daemon.config.endpoint, heartbeat=False) as a,
        SidecarClient(daemon.config.endpoint, heartbeat=False) as b,
    ):
        _register(a, ca, "A")
        _register(b, cb, "B")
        b.grant("A", read=True, write=True)
        A, B = BufferSetRef(a.worker), BufferSetRef(b.worker)
        rng = np.random.default_rng(3)
        s1, d1 = rng.choice(BLOCKS, 6, replace=False), rng.choice(BLOCKS, 6, replace=False)
        d2 = rng.choice(BLOCKS, 6, replace=False)
        s4, d4 = [5, 6, 7], [29, 30, 31]
        moves = [
            BatchMove(A, B, s1, d1, request_ids=["r1"]),
            # Reads the blocks the first item wrote: the batch runs in order.
            BatchMove(B, A, d1, d2, request_ids=["r2"]),
            BatchMove(A, B, [0, 1], [2, BLOCKS], request_ids=["bad"]),  # out of range
            BatchMove(A, B, s4, d4, layers=["l1"], request_ids=["r4"]),
            BatchMove(A, B, [1, 2], [3], request_ids=["short"]),  # lengths disagree
        ]
        before = a.status().moves_total
        reply = a.move_batch(moves)
        _apply(
            want,
            [
                ("A", "B", s1.tolist(), d1.tolist(), None),
                ("B", "A", d1.tolist(), d2.tolist(), None),
                ("A", "B", s4, d4, [1]),
            ],
        )
        codes = [r.error_code for r in reply.results]
        assert codes == ["", "", "out_of_range", "", "length_mismatch"]
        assert [r.blocks for r in reply.results] == [6, 6, 0, 3, 0]
        block_bytes = 2 * torch.Size(SHAPE[1:]).numel()
        assert reply.results[0].nbytes == 6 * LAYERS * block_bytes
        assert reply.results[3].nbytes == 3 * block_bytes
        assert "outside" in reply.results[2].error
        for name, caches in (("A", ca), ("B", cb)):
            for i, t in enumerate(caches):
                assert torch.equal(t.view(torch.int16), want[name][i].view(torch.int16)), (name, i)
        assert a.status().moves_total == before + 3
        # Each item's requests credited like a move's; the refused ones not at all.
        got_b = b.collect("B", step=0, timeout_s=0.0).output
        got_a = a.collect("A", step=0, timeout_s=0.0).output
        assert got_b.finished_recving == {"r1", "r4"}
        assert got_a.finished_recving == {"r2"}
        assert got_a.finished_sending == {"r1", "r4"}


async def test_async_client_batch_and_whole_batch_errors() -> None:
    ca, cb = _caches(4), _caches(5)
    with daemon_process(make_config(lease_s=60.0)) as daemon:
        async with (
            AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as a,
            AsyncSidecarClient(daemon.config.endpoint, heartbeat=False) as b,
        ):
            for client, caches, engine in ((a, ca, "A"), (b, cb, "B")):
                await client.register_kv_caches(
                    {f"l{i}": t for i, t in enumerate(caches)},
                    engine_id=engine,
                    arrangement="split",
                )
            await b.grant("A", read=False, write=True)
            A, B = BufferSetRef(a.worker), BufferSetRef(b.worker)
            ids = list(range(BLOCKS))
            reply = await a.move_batch(
                [BatchMove(A, B, ids[:16], ids[16:]), BatchMove(A, B, ids[16:], ids[:16])]
            )
            assert [r.error_code for r in reply.results] == ["", ""]
            for i in range(LAYERS):
                assert torch.equal(cb[i][16:].view(torch.int16), ca[i][:16].view(torch.int16))
                assert torch.equal(cb[i][:16].view(torch.int16), ca[i][16:].view(torch.int16))
            # Whole-batch errors: no right to write A from B's client, an empty batch is fine.
            with pytest.raises(SidecarError) as err:
                await b.move_batch([BatchMove(B, A, [0], [0])])
            assert err.value.code == "forbidden"
            empty = await a.move_batch([])
            assert empty.results == []
            assert (await a.status()).engines  # the daemon still serves
