"""End to end: a daemon process, separately spawned worker processes, real shared memory.

Every move's bytes are checked against an expectation computed here with plain indexing from
the workers' seeds (`tests.procs.kv_worker.expected_layer`), not from the daemon's code.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarClient, WorkerRef
from kvsidecar.memory import allocate_kv_caches
from tests.procs.kv_worker import expected_layer
from tests.support.children import WorkerProcess, workers
from tests.support.clients import Client
from tests.support.daemons import daemon_process, make_config, run_daemon
from tests.support.procfs import memfd_mappings, shm_entries

pytestmark = pytest.mark.timeout(240)


def spec(endpoint: str, engine: str, seed: int, **kw: Any) -> dict[str, Any]:
    base = {
        "endpoint": endpoint,
        "engine": engine,
        "seed": seed,
        "layers": 3,
        "blocks": 32,
        "block_size": 4,
        "heads": 4,
        "head_size": 8,
        "order": "NHD",
    }
    base.update(kw)
    return base


def initial(s: dict[str, Any]) -> list[np.ndarray]:
    return [expected_layer(s, i).numpy() for i in range(s["layers"])]


class Cluster:
    """One daemon process and ten worker processes shared by the module's tests.

    Starting a torch process costs seconds on a small machine, so the processes are shared; each
    test applies its moves to ``expected`` (the independent model of every worker's memory) and
    compares every worker it touched, whole, against it.
    """

    def __init__(
        self,
        endpoint: str,
        daemon_pid: int,
        procs: list[WorkerProcess],
        specs: list[dict[str, Any]],
    ) -> None:
        self.endpoint = endpoint
        self.daemon_pid = daemon_pid
        self.procs = {
            (s["engine"], s.get("tp_rank", 0)): p for s, p in zip(specs, procs, strict=True)
        }
        self.expected = {k: initial(p.spec) for k, p in self.procs.items()}

    def check(self, tmp_path: Path, *keys: tuple[str, int]) -> None:
        for key in keys:
            got = self.procs[key].dump(tmp_path / f"{key[0]}{key[1]}")
            for layer, want in zip(got, self.expected[key], strict=True):
                np.testing.assert_array_equal(layer, want)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with daemon_process(make_config(host_pool_bytes=32 << 20, lease_s=5.0)) as d:
        endpoint = d.config.endpoint
        specs = [
            spec(endpoint, "eng", 10 + r, tp_rank=r, tp_size=8, host_blocks=32, layers=2)
            for r in range(8)
        ]
        specs.append(spec(endpoint, "prefill", 3, order="HND", blocks=40))
        specs.append(spec(endpoint, "decode", 4, order="NHD", block_size=8, blocks=24))
        with workers(specs) as procs:
            yield Cluster(endpoint, d.proc.pid, procs, specs)


@pytest.fixture
def endpoint(cluster: Cluster) -> str:
    """The cluster's daemon, for the `client` fixture (each kind of client in turn)."""
    return cluster.endpoint


def test_offload_onboard_roundtrip(cluster: Cluster, client: Client, tmp_path: Path) -> None:
    ids = client.host_alloc("eng", 5)
    assert len(set(ids.tolist())) == 5
    src, dst = [3, 4, 5, 10, 0], [20, 21, 22, 30, 31]
    for rank in (0, 1):
        moved = client.offload(WorkerRef("eng", rank), src, ids)
        assert moved.blocks == 5 and not moved.fixed
        client.onboard(WorkerRef("eng", rank), ids[::-1], dst[::-1])
        for layer in cluster.expected[("eng", rank)]:
            layer[:, dst] = layer[:, src]
    cluster.check(tmp_path, ("eng", 0), ("eng", 1))
    assert client.status().moves_failed_total == 0
    client.host_free("eng", ids)


def test_engine_to_engine_hnd_to_nhd_same_block_size(
    cluster: Cluster, client: Client, tmp_path: Path
) -> None:
    """Prefill (HND) -> prefill-shaped blocks of another engine: here decode has 8-token
    blocks, so the same-size case goes prefill -> eng (NHD, 4 tokens) on layers 0 and 1."""
    src, dst = [7, 1, 39], [25, 26, 27]
    moved = client.move(
        BufferSetRef(WorkerRef("prefill")),
        BufferSetRef(WorkerRef("eng", 7)),
        src,
        dst,
        layers=["layer0", "layer1"],
    )
    assert moved.fixed and moved.blocks == 3
    for exp_d, exp_p in zip(
        cluster.expected[("eng", 7)], cluster.expected[("prefill", 0)][:2], strict=True
    ):
        exp_d[:, dst] = exp_p[:, src]
    cluster.check(tmp_path, ("eng", 7), ("prefill", 0))


def test_engine_to_engine_hnd_to_nhd_block_ratio_2(
    cluster: Cluster, client: Client, tmp_path: Path
) -> None:
    """Prefill (HND, 4 tokens) -> decode (NHD, 8 tokens): decode block j = 2 prefill blocks."""
    src, dst = [12, 13, 2, 30, 5, 6], [4, 0, 17]
    moved = client.move(
        BufferSetRef(WorkerRef("prefill")), BufferSetRef(WorkerRef("decode")), src, dst
    )
    assert moved.fixed and moved.blocks == 3
    for exp_d, exp_p in zip(
        cluster.expected[("decode", 0)], cluster.expected[("prefill", 0)], strict=True
    ):
        for j, block in enumerate(dst):
            # tokens in order: the first source block holds tokens 0..3 of the destination
            exp_d[:, block] = np.concatenate(
                [exp_p[:, src[2 * j]], exp_p[:, src[2 * j + 1]]], axis=1
            )
    cluster.check(tmp_path, ("decode", 0))


def test_fix_layout_in_place(cluster: Cluster, client: Client, tmp_path: Path) -> None:
    """Blocks of an HND worker that hold NHD-ordered bytes read right after fix_layout."""
    client.fix_layout(
        WorkerRef("prefill"), [20, 21], remote_memory_order="NHD", remote_block_size=4
    )
    exp = cluster.expected[("prefill", 0)]
    for layer in exp:
        # The HND bytes of blocks 20, 21, re-read as if an NHD sender had written them.
        raw = np.ascontiguousarray(layer[:, [20, 21]].transpose(0, 1, 3, 2, 4))
        layer[:, [20, 21]] = raw.reshape(layer[:, [20, 21]].shape)
    cluster.check(tmp_path, ("prefill", 0))


def test_concurrent_moves_from_eight_workers(cluster: Cluster, tmp_path: Path) -> None:
    async def drive() -> None:
        async with AsyncSidecarClient(cluster.endpoint) as c:
            ids = await c.host_alloc("eng", 8)
            refs = [WorkerRef("eng", r) for r in range(8)]
            await asyncio.gather(*(c.offload(ref, list(range(8)), ids) for ref in refs))
            # Same host blocks, issued right after: ordering makes them read the new bytes.
            await asyncio.gather(*(c.onboard(ref, ids, list(range(8, 16))) for ref in refs))
            await c.host_free("eng", ids)

    asyncio.run(drive())
    for r in range(8):
        for layer in cluster.expected[("eng", r)]:
            layer[:, 8:16] = layer[:, 0:8]
    cluster.check(tmp_path, *[("eng", r) for r in range(8)])


def test_same_destination_moves_apply_in_arrival_order(cluster: Cluster, tmp_path: Path) -> None:
    """Pipelined moves into the same blocks (no wait between them): the last one wins."""

    async def drive() -> None:
        async with AsyncSidecarClient(cluster.endpoint) as c:
            dst = BufferSetRef(WorkerRef("eng", 2))
            moves = [
                c.move(BufferSetRef(WorkerRef("eng", r)), dst, [1, 2, 3], [28, 29, 30])
                for r in (3, 4, 5, 6)
            ]
            await asyncio.gather(*moves)

    asyncio.run(drive())
    for exp, src in zip(cluster.expected[("eng", 2)], cluster.expected[("eng", 6)], strict=True):
        exp[:, [28, 29, 30]] = src[:, [1, 2, 3]]
    cluster.check(tmp_path, ("eng", 2))


def test_sigkill_worker_releases_mappings(cluster: Cluster) -> None:
    before = shm_entries()
    s = spec(cluster.endpoint, "doomed", 7)
    with workers([s]) as (w,), SidecarClient(cluster.endpoint) as c:
        engines = {e.engine_id: e for e in c.status().engines}
        assert engines["doomed"].workers[0].nbytes > 0
        daemon_pid = cluster.daemon_pid
        maps_before = memfd_mappings(daemon_pid)
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait(5)
        lease = c.daemon.lease_s if c.daemon else 1.0
        deadline = time.monotonic() + lease + 1.0
        while time.monotonic() < deadline and "doomed" in {e.engine_id for e in c.status().engines}:
            time.sleep(0.05)
        assert "doomed" not in {e.engine_id for e in c.status().engines}
        assert memfd_mappings(daemon_pid) < maps_before  # its memfd mapping is gone
    assert not shm_entries() - before, "segments left in /dev/shm"


def test_sigterm_exits_cleanly_with_registered_worker() -> None:
    with daemon_process() as d, workers([spec(d.config.endpoint, "e", 8)]):
        assert d.stop() == 0
        assert not Path(d.config.ipc_path or "").exists()


async def test_status_is_answered_while_a_1gib_move_runs() -> None:
    """In-process daemon: a 1 GiB offload runs on the copy executor while status round-trips.

    A copy run on the event loop would hold every status until it ended, so each answer would
    see no move in flight. Liveness only, with generous bounds: how fast the answers come is a
    benchmark's figure (`kvsidecar bench`), not a test's on a shared two-core machine.
    """
    config = make_config(host_pool_bytes=(1 << 30) + (1 << 20), copy_threads=2)
    blocks = 512
    shape = (2, blocks, 16, 8, 128)  # 64 MiB of K+V per layer
    layers = (1 << 30) // (2 * blocks * 16 * 8 * 128 * 2)
    caches = await asyncio.to_thread(allocate_kv_caches, layers, shape, torch.float16)
    async with run_daemon(config), AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(caches)}, engine_id="big", host_blocks=blocks
        )
        ids = await c.host_alloc("big", blocks)
        move = asyncio.create_task(c.offload(c.worker, list(range(blocks)), ids))
        answered_mid_move = 0
        while not move.done():
            st = await asyncio.wait_for(c.status(), 10)
            if st.in_flight_moves > 0 and not move.done():
                answered_mid_move += 1
        moved = await move
        assert moved.nbytes == 1 << 30
        assert answered_mid_move >= 2, "status was not answered while the move ran"
        # Spot-check the bytes of a few blocks.
        host = await c.move(
            BufferSetRef(c.worker, "host"),
            BufferSetRef(c.worker),
            ids[:2],
            [blocks - 2, blocks - 1],
        )
        assert host.blocks == 2
        assert torch.equal(caches[3][:, blocks - 2 :], caches[3][:, :2])


async def test_short_move_on_blocks_of_a_running_move_applies_after_it() -> None:
    """A 1-block move (short enough to run on the loop) waits for a running move it conflicts with.

    The large offload writes host block ``last`` late in its copy (last layer, last block); a
    1-block move into that very block, sent right behind it, must apply after it (arrival
    order), so the host block ends with the short move's bytes in its layer and the offload's in
    the others. Run at once on the loop, the short move would be overwritten by the offload.
    A short move on blocks nobody touches runs meanwhile and is right too. The short move's pair
    plan is cached first, so that it meets the in-flight job on the short road
    (`kvsidecar.daemon.short_moves`), which must leave it to the general path, and there.
    """
    blocks, layers = 256, 16
    shape = (2, blocks, 16, 8, 128)  # 64 KiB of K+V per block and layer: 256 MiB in all
    config = make_config(host_pool_bytes=(256 << 20) + (1 << 20), copy_threads=2)
    caches = await asyncio.to_thread(allocate_kv_caches, layers, shape, torch.float16)
    for i, layer in enumerate(caches):  # every block of every layer tells itself apart
        layer.copy_(torch.arange(blocks, dtype=torch.float16).view(1, blocks, 1, 1, 1) + 300 * i)
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(caches)}, engine_id="e", host_blocks=blocks + 1
        )
        host_ids = np.asarray(await c.host_alloc("e", blocks + 1))
        ids, spare = host_ids[:blocks], host_ids[blocks:]
        device, host = BufferSetRef(c.worker), BufferSetRef(c.worker, "host")
        last, other = int(ids[-1]), layers - 1
        for block in (7, 8):  # the first caches the pair's plan, the second takes the short road
            await c.move(device, host, [block], spare, layers=[f"l{other}"])
        assert daemon.totals.short_moves == 1
        big = asyncio.ensure_future(c.offload(c.worker, list(range(blocks)), ids))
        short = asyncio.ensure_future(
            c.move(device, host, [5], [last], layers=[f"l{other}"])  # block 5 into the last
        )
        disjoint = await c.move(device, host, [9], spare, layers=["l0"])
        assert disjoint.blocks == 1
        await asyncio.gather(big, short)
        # Read the host blocks back into device blocks 0 and 1.
        await c.move(host, device, [last, int(spare[0])], [0, 1])
    for i, layer in enumerate(caches):
        want = (5 if i == other else blocks - 1) + 300 * i
        assert torch.all(layer[:, 0] == want), f"layer {i}: the short move lost to the offload"
    assert torch.all(caches[0][:, 1] == 9)


async def test_silent_worker_loses_its_lease() -> None:
    """A live worker that stops heartbeating is released after the lease, fd channel open."""
    config = make_config(lease_s=0.5)
    caches = allocate_kv_caches(1, (2, 8, 4, 2, 8), torch.float16)
    async with (
        run_daemon(config),
        AsyncSidecarClient(config.endpoint, heartbeat=False) as silent,
        AsyncSidecarClient(config.endpoint) as observer,
    ):
        await silent.register_kv_caches({"l0": caches[0]}, engine_id="quiet", host_blocks=4)
        assert (await observer.status()).host_pool_used_bytes > 0
        await asyncio.sleep(0.5 + 1.5)
        status = await observer.status()
        assert status.engines == [] and status.host_pool_used_bytes == 0
