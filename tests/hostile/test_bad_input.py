"""Bad input, one test each: a typed error, the daemon keeps serving, no byte changed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch

from kvsidecar.client import AsyncSidecarClient, BufferSetRef, SidecarError, WorkerRef
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.node.config import Config
from kvsidecar.wire.protocol import PROTOCOL_VERSION, Error, Hello, Move
from tests.support.daemons import make_config, run_daemon
from tests.support.ids import id_frame
from tests.support.raw import raw_call

pytestmark = pytest.mark.timeout(30)

SHAPE = (2, 16, 4, 2, 8)  # kv_first NHD: 16 blocks of 4 tokens, 2 heads of 8


@dataclass
class Env:
    config: Config
    client: AsyncSidecarClient
    caches: dict[str, list[torch.Tensor]]
    snapshot: dict[str, list[torch.Tensor]]

    def assert_untouched(self) -> None:
        for name, tensors in self.caches.items():
            for now, before in zip(tensors, self.snapshot[name], strict=True):
                assert torch.equal(now, before), f"{name} changed"

    async def assert_still_serving(self) -> None:
        async with AsyncSidecarClient(self.config.endpoint, heartbeat=False) as other:
            status = await other.status()
        assert {e.engine_id for e in status.engines} == {"a", "b", "odd"}
        self.assert_untouched()


def _filled(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    caches = allocate_kv_caches(2, shape, torch.float16)
    gen = torch.Generator().manual_seed(seed)
    for t in caches:
        t.copy_(torch.randn(shape, generator=gen).half())
    return caches


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    config = make_config(
        max_message_bytes=256 << 10, max_header_bytes=64 << 10, max_ids_per_command=4096
    )
    caches = {"a": _filled(SHAPE, 1), "b": _filled(SHAPE, 2), "odd": _filled((2, 16, 4, 2, 16), 3)}
    async with run_daemon(config):
        clients = []
        try:
            for engine, tensors in caches.items():
                c = AsyncSidecarClient(config.endpoint)
                clients.append(c)
                await c.start()
                await c.register_kv_caches(
                    {"l0": tensors[0], "l1": tensors[1]}, engine_id=engine, host_blocks=8
                )
            for c in clients[1:]:  # cross-engine moves from "a" reach the checks they test
                await c.grant("a", read=True, write=True)
            snapshot = {k: [t.clone() for t in v] for k, v in caches.items()}
            yield Env(config, clients[0], caches, snapshot)
        finally:
            for c in clients:
                await c.close()


A, B, ODD = WorkerRef("a"), WorkerRef("b"), WorkerRef("odd")


async def expect(env: Env, code: str, coro: object) -> SidecarError:
    with pytest.raises(SidecarError) as info:
        await coro  # type: ignore[misc]
    assert info.value.code == code, info.value
    await env.assert_still_serving()
    return info.value


async def test_malformed_frame(env: Env) -> None:
    reply = await raw_call(env.config.endpoint, [b"\xc1 not msgpack"])
    assert isinstance(reply, Error) and reply.code == "bad_frame" and reply.id == 0
    await env.assert_still_serving()


async def test_wrong_number_of_data_frames(env: Env) -> None:
    move = Move(id=9, src=BufferSetRef(A), dst=BufferSetRef(B))
    reply = await raw_call(env.config.endpoint, [msgspec.msgpack.encode(move), id_frame(1)])
    assert isinstance(reply, Error) and reply.code == "bad_frame" and reply.id == 9
    await env.assert_still_serving()


async def test_id_frame_not_whole_elements(env: Env) -> None:
    move = Move(id=9, src=BufferSetRef(A), dst=BufferSetRef(B))
    reply = await raw_call(
        env.config.endpoint, [msgspec.msgpack.encode(move), b"\x01\x02\x03", id_frame(1)]
    )
    assert isinstance(reply, Error) and reply.code == "bad_frame"
    await env.assert_still_serving()


async def test_unknown_message_tag(env: Env) -> None:
    header = msgspec.msgpack.encode({"type": "format_disk", "id": 41})
    reply = await raw_call(env.config.endpoint, [header])
    assert isinstance(reply, Error) and reply.code == "unknown_message" and reply.id == 41
    await env.assert_still_serving()


async def test_invalid_field(env: Env) -> None:
    header = msgspec.msgpack.encode(
        {"type": "host_alloc", "id": 42, "engine_id": "a", "count": "x"}
    )
    reply = await raw_call(env.config.endpoint, [header])
    assert isinstance(reply, Error) and reply.code == "invalid_message" and reply.id == 42
    await env.assert_still_serving()


async def test_wrong_protocol_version(env: Env) -> None:
    hello = Hello(id=7, protocol_version=PROTOCOL_VERSION + 1)
    reply = await raw_call(env.config.endpoint, [msgspec.msgpack.encode(hello)])
    assert isinstance(reply, Error) and reply.code == "version_mismatch" and reply.id == 7
    await env.assert_still_serving()


async def test_unknown_engine(env: Env) -> None:
    await expect(
        env,
        "unknown_engine",
        env.client.move(BufferSetRef(WorkerRef("nope")), BufferSetRef(B), [1], [2]),
    )


async def test_unknown_worker(env: Env) -> None:
    await expect(
        env,
        "unknown_worker",
        env.client.move(BufferSetRef(WorkerRef("a", 1)), BufferSetRef(B), [1], [2]),
    )


async def test_out_of_range_ids(env: Env) -> None:
    await expect(
        env, "out_of_range", env.client.move(BufferSetRef(A), BufferSetRef(B), [1, 2], [3, 16])
    )
    await expect(
        env, "out_of_range", env.client.move(BufferSetRef(A), BufferSetRef(B), [-1, 2], [3, 4])
    )
    await expect(env, "out_of_range", env.client.offload(A, [1], [8]))


async def test_duplicate_destination_ids(env: Env) -> None:
    await expect(
        env,
        "duplicate_destination",
        env.client.move(BufferSetRef(A), BufferSetRef(B), [1, 2], [5, 5]),
    )


async def test_length_mismatch(env: Env) -> None:
    await expect(
        env, "length_mismatch", env.client.move(BufferSetRef(A), BufferSetRef(B), [1, 2, 3], [5, 6])
    )


async def test_incompatible_shapes(env: Env) -> None:
    err = await expect(
        env, "incompatible_buffers", env.client.move(BufferSetRef(A), BufferSetRef(ODD), [1], [2])
    )
    assert "head_size" in err.message


async def test_unknown_layer(env: Env) -> None:
    await expect(
        env,
        "unknown_layer",
        env.client.move(BufferSetRef(A), BufferSetRef(B), [1], [2], layers=["l9"]),
    )


async def test_oversize_message(env: Env) -> None:
    big = np.arange(40_000, dtype=np.int64)  # 320 KB per frame: over max_message_bytes
    await expect(env, "too_large", env.client.move(BufferSetRef(A), BufferSetRef(B), big, big))


async def test_too_many_ids(env: Env) -> None:
    many = np.arange(5000, dtype=np.int32)  # 20 KB, under the byte limit, over 4096 ids
    await expect(env, "too_large", env.client.move(BufferSetRef(A), BufferSetRef(B), many, many))


async def test_host_pool_errors(env: Env) -> None:
    await expect(env, "pool_exhausted", env.client.host_alloc("a", 9))
    await expect(env, "not_allocated", env.client.host_free("a", [3]))


async def test_register_twice(env: Env) -> None:
    tensors = env.caches["a"]
    await expect(
        env,
        "already_registered",
        env.client.register_kv_caches({"l0": tensors[0]}, engine_id="a", host_blocks=8),
    )
