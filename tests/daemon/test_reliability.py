"""Reliability inside one daemon: epochs, bounded queues, integrity checks, failed moves.

The process-killing fault tests are in tests/daemon/test_faults.py; the fuzzer in
tests/hostile/test_fuzz.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError, WorkerRef
from kvsidecar.core import integrity
from kvsidecar.daemon.limits.admission import Admission
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.wire.protocol import Moved
from tests.support.daemons import make_config, run_daemon

pytestmark = pytest.mark.timeout(60)


def _filled(shape: tuple[int, ...], seed: int, layers: int = 1) -> list[torch.Tensor]:
    caches = allocate_kv_caches(layers, shape, torch.float16)
    gen = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(shape, generator=gen).half())
    return caches


async def test_epochs_fence_stale_commands() -> None:
    config = make_config()
    mem = _filled((2, 8, 4, 2, 8), 1)
    async with run_daemon(config), AsyncSidecarClient(config.endpoint) as c:
        first = await c.register_kv_caches({"l0": mem[0]}, engine_id="e", host_blocks=4)
        assert first.epoch > 0
        stale = BufferSetRef(WorkerRef("e"), "device", first.epoch)
        await c.move(stale, BufferSetRef(WorkerRef("e"), "host"), [1], [0])  # current: fine
        await c.unregister()
        second = await c.register_kv_caches({"l0": mem[0]}, engine_id="e", host_blocks=4)
        assert second.epoch > first.epoch
        with pytest.raises(SidecarError) as info:
            await c.move(stale, BufferSetRef(WorkerRef("e"), "host"), [1], [0])
        assert info.value.code == "stale_epoch"
        # The client stamps its own current epoch: its own commands go through.
        await c.offload(c.worker, [2], [1])
        await c.heartbeat()


async def test_stale_heartbeat_and_unregister_are_refused() -> None:
    from kvsidecar.wire.protocol import Heartbeat, Unregister

    config = make_config()
    mem = _filled((2, 8, 4, 2, 8), 2)
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        reg = await c.register_kv_caches({"l0": mem[0]}, engine_id="e")
        ref = reg.worker
        for req in (
            Heartbeat(id=901, workers=[ref], epochs=[reg.epoch - 1]),
            Unregister(id=902, worker=ref, epoch=reg.epoch + 1),
        ):
            with pytest.raises(SidecarError) as info:
                await c._transport.call(req, Moved)
            assert info.value.code == "stale_epoch"
        assert ref in daemon.registry.workers  # nothing happened


def test_admission_limits() -> None:
    adm = Admission(max_per_worker=2, max_total=3)
    a, b, c = WorkerRef("a"), WorkerRef("b"), WorkerRef("c")
    t1, t2 = adm.admit([a]), adm.admit([a, b])
    with pytest.raises(SidecarError, match="per-worker") as info:
        adm.admit([a])
    assert info.value.code == "busy"
    t3 = adm.admit([c])
    with pytest.raises(SidecarError, match="on the daemon"):
        adm.admit([b])
    for t in (t1, t2, t3):
        adm.release(t)
    assert adm.total == 0 and adm.in_flight(a) == 0 and adm.refused == 2


async def test_overload_gets_busy_not_unbounded_queues() -> None:
    """300 pipelined moves on one worker with room for 4: typed replies only, every one."""
    config = make_config(max_moves_per_worker=4, max_moves_total=8, host_pool_bytes=128 << 20)
    mem = _filled((2, 64, 16, 8, 64), 3, layers=4)  # 64 blocks x 32 KiB x 4 layers = 8 MiB
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(mem)}, engine_id="hot", host_blocks=64
        )
        ids = list(range(64))
        results = await asyncio.gather(
            *(c.offload(c.worker, ids, ids) for _ in range(300)), return_exceptions=True
        )
        codes = [r.code if isinstance(r, SidecarError) else type(r).__name__ for r in results]
        assert set(codes) <= {"Moved", "busy"}, set(codes)
        assert codes.count("busy") > 0 and codes.count("Moved") >= 4
        # A status first: the loop settles every finished move (answered from its copy thread)
        # before it reads the next request, so the counts below are final, however loaded.
        assert (await c.status()).in_flight_moves == 0
        assert daemon.admission.total == 0 and daemon.admission.refused == codes.count("busy")


async def test_checksummed_move_is_verified() -> None:
    config = make_config(checksum=True)
    mem = _filled((2, 16, 4, 2, 8), 4, layers=2)
    async with run_daemon(config) as daemon, AsyncSidecarClient(config.endpoint) as c:
        await c.register_kv_caches({"a": mem[0], "b": mem[1]}, engine_id="e", host_blocks=16)
        moved = await c.offload(c.worker, [1, 5, 9], [0, 1, 2])
        assert moved.verified and moved.invalid_block_ids == []
        back = await c.onboard(c.worker, [0, 1, 2], [10, 11, 12])
        assert back.verified
        assert torch.equal(mem[1][:, [10, 11, 12]], mem[1][:, [1, 5, 9]])
        assert daemon.totals.integrity_failures == 0


def test_checksum_mismatch_marks_destination_blocks_invalid() -> None:
    """A copy that corrupts one sub-block: that destination block (and only it) is invalid."""
    src = torch.arange(8 * 32, dtype=torch.uint8).view(8, 32).clone()
    dst = torch.zeros(4, 64, dtype=torch.uint8)  # ratio 2: each dst block = 2 src blocks
    sub = dst.view(8, 32)
    src_ids = np.array([0, 1, 2, 3, 4, 5], dtype=np.int64)
    dst_sub = np.array([0, 1, 4, 5, 6, 7], dtype=np.int64)  # dst blocks 0, 2, 3

    def corrupting_copy() -> int:
        sub[torch.from_numpy(dst_sub)] = src[torch.from_numpy(src_ids)]
        sub[5, 3] ^= 0xFF  # dst block 2 (sub-block 5)
        return 6 * 32

    result = integrity.Verification()
    n = integrity.verified_copy(
        corrupting_copy,
        src_views=[src],
        src_ids=src_ids,
        dst_views=[sub],
        dst_ids=dst_sub,
        ratio=2,
        result=result,
    )
    assert n == 192 and result.verified and result.invalid_block_ids == [2]


async def test_release_fails_queued_moves_with_worker_lost() -> None:
    """Moves queued behind a long one when their worker goes: worker_lost, none dropped."""
    config = make_config(host_pool_bytes=600 << 20, copy_threads=1)
    mem = _filled((2, 256, 16, 8, 128), 5, layers=8)  # 8 x 16 MiB: ~256 MiB per full move
    async with (
        run_daemon(config),
        AsyncSidecarClient(config.endpoint) as owner,
        AsyncSidecarClient(config.endpoint, heartbeat=False) as admin,
    ):
        await owner.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(mem)}, engine_id="w", host_blocks=256
        )
        ids = list(range(256))
        # 24: a 128 MiB move takes ~8 ms here, so 6 could all end before the unregister comes.
        moves = [asyncio.ensure_future(admin.offload(WorkerRef("w"), ids, ids)) for _ in range(24)]
        await asyncio.sleep(0.05)
        await owner.unregister()
        results = await asyncio.wait_for(asyncio.gather(*moves, return_exceptions=True), 30)
        kinds = [r.code if isinstance(r, SidecarError) else type(r).__name__ for r in results]
        assert set(kinds) <= {"Moved", "worker_lost", "unknown_worker", "unknown_engine"}, kinds
        assert "worker_lost" in kinds, kinds
        status = await admin.status()
        assert status.in_flight_moves == 0 and status.host_pool_used_bytes == 0
