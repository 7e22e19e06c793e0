"""Moves and pulls between caches of different block sizes, for every dense arrangement.

Daemon processes, engines registered from this process over real shared memory. A source
engine with 4-token blocks is moved (``move``, and ``move_batch`` with checksums) and pulled
(a local pull through the same daemon) into engines with 4-, 8- and 16-token blocks, in every
memory-order pair; and pulled from another daemon over each data plane, across TP sizes.
Each destination block is compared, element by element, with the source blocks laid end to
end along the token dim of the logical tensors: plain indexing here, none of kvsidecar's
layout code. ``blocks_first`` holds K and V in one row per block; re-blocked moves once wrote
the source's K and V both into the destination's K half (the pulls were right).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch

from kvsidecar.client import BatchMove, BufferSetRef, SidecarClient, WorkerRef
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.peer.nixl_plane import nixl_available
from kvsidecar.wire.protocol import PROTOCOL_VERSION, Error, Move, Moved, Register
from kvsidecar.wire.types import BufferDescriptor, LayerSpec, ShmRef
from tests.support.daemons import (
    DaemonProcess,
    StartDaemon,
    peer_daemon,
)
from tests.support.raw import Raw, ids, sealed_memfd, send_fds_raw

pytestmark = pytest.mark.timeout(180)

HEADS, HEAD_SIZE, BLOCKS, SRC_TOKENS = 2, 4, 12, 4
ORDERS = [("NHD", "NHD"), ("HND", "HND"), ("HND", "NHD"), ("NHD", "HND")]
CASES = [(arr, *orders) for arr in ("kv_first", "blocks_first", "split") for orders in ORDERS]
CASES.append(("mla", "NHD", "NHD"))
_counter = iter(range(10_000))


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: StartDaemon) -> DaemonProcess:
    return module_daemon_factory(peer_lease_s=30.0)


def _memory_shape(arrangement: str, tokens: int, order: str, heads: int) -> list[int]:
    """The tensor as allocated: the logical shape with N and H swapped for HND."""
    if arrangement == "mla":
        return [BLOCKS, tokens, HEAD_SIZE]
    shape = {"kv_first": [2, BLOCKS], "blocks_first": [BLOCKS, 2]}.get(arrangement, [BLOCKS])
    shape += [heads, tokens, HEAD_SIZE] if order == "HND" else [tokens, heads, HEAD_SIZE]
    return shape


def _logical(cache: torch.Tensor, arrangement: str, order: str) -> torch.Tensor:
    """(..., N, H, C) whatever the memory order; mla as it is."""
    return cache.transpose(-3, -2) if arrangement != "mla" and order == "HND" else cache


def _block(logical: torch.Tensor, arrangement: str, b: int) -> torch.Tensor:
    """Block ``b``'s K and V (or latent) with tokens in dim 1: ``(2 or 1, N, ...)``."""
    if arrangement == "kv_first":
        return logical[:, b]
    if arrangement == "blocks_first":
        return logical[b]
    return logical[b].unsqueeze(0)


class _Engine:
    """A registered engine of ``tp`` workers (a client each), each with one layer."""

    def __init__(
        self,
        endpoint: str,
        arrangement: str,
        tokens: int,
        order: str,
        dtype: torch.dtype,
        tp: int = 1,
    ) -> None:
        index = next(_counter)
        self.name = f"e{index}"
        self.arrangement, self.order = arrangement, order
        heads = HEADS // tp if arrangement != "mla" else 1
        shape = _memory_shape(arrangement, tokens, order, heads)
        self.caches = allocate_kv_caches(tp, shape, dtype)
        gen = torch.Generator().manual_seed(index)  # every engine's values differ
        self.clients = []
        for rank, cache in enumerate(self.caches):
            cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
            client = SidecarClient(endpoint, name=f"{self.name}.{rank}")
            self.clients.append(client)
            client.register_kv_caches(
                {"layer0": cache},
                engine_id=self.name,
                tp_rank=rank,
                tp_size=tp,
                arrangement=arrangement,  # type: ignore[arg-type]
                memory_order=order,  # type: ignore[arg-type]
                shape_order="HN" if order == "HND" and arrangement != "mla" else "NH",
            )
        self.client = self.clients[0]
        self.ref = BufferSetRef(WorkerRef(self.name))

    def block(self, b: int) -> torch.Tensor:
        """Block ``b`` of the whole engine: its ranks' heads side by side."""
        parts = [
            _block(_logical(c, self.arrangement, self.order), self.arrangement, b)
            for c in self.caches
        ]
        return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits: compared exactly (a 0.0 where -0.0 was written would not pass)."""
    return t.contiguous().view(torch.int16)


def _check(src: _Engine, dst: _Engine, src_ids: list[int], dst_ids: list[int], how: str) -> None:
    ratio = len(src_ids) // len(dst_ids)
    for j, d in enumerate(dst_ids):
        want = torch.cat([src.block(s) for s in src_ids[j * ratio : (j + 1) * ratio]], dim=1)
        assert torch.equal(_bits(dst.block(d)), _bits(want)), (
            f"{how}: {src.arrangement} {src.order} -> {dst.order}, ratio {ratio}, block {d}"
        )


@pytest.mark.parametrize(("arrangement", "src_order", "dst_order"), CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reblocked_moves_and_pulls_lay_tokens_end_to_end(
    daemon: DaemonProcess, arrangement: str, src_order: str, dst_order: str, dtype: torch.dtype
) -> None:
    endpoint = daemon.config.endpoint
    src = _Engine(endpoint, arrangement, SRC_TOKENS, src_order, dtype)
    engines: list[_Engine] = [src]
    try:
        with SidecarClient(endpoint) as admin:
            for ratio in (1, 2, 4):
                src_ids = [9, 2, 3, 11, 0, 5, 7, 4][: 2 * ratio]  # two destination blocks' worth
                for how in ("move", "move_batch", "pull"):
                    dst = _Engine(endpoint, arrangement, SRC_TOKENS * ratio, dst_order, dtype)
                    engines.append(dst)
                    dst_ids = [6, 1]
                    if how == "move":
                        moved = admin.move(src.ref, dst.ref, src_ids, dst_ids)
                        assert moved.blocks == 2
                    elif how == "move_batch":
                        batch = admin.move_batch(
                            [BatchMove(src.ref, dst.ref, src_ids, dst_ids)], checksum=True
                        )
                        result = batch.results[0]
                        assert not result.error_code and not result.invalid_block_ids, result
                    else:
                        src.client.publish(src.name, f"r{dst.name}", src_ids)
                        pulled = dst.client.submit_pull(
                            dst.name, "", src.name, {f"r{dst.name}": (src_ids, dst_ids)}, tp_rank=0
                        ).result()
                        assert pulled.finished == [f"r{dst.name}"], pulled
                    _check(src, dst, src_ids, dst_ids, how)
    finally:
        for engine in engines:
            engine.close()


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    plane = "auto" if nixl_available() else "zmq"
    with (
        peer_daemon(peer_data_plane=plane, peer_nixl_trusted=True) as producer,
        peer_daemon(peer_data_plane=plane, peer_nixl_trusted=True, peer_endpoint="") as consumer,
    ):
        yield producer, consumer


PLANES = [
    "zmq",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]
# (arrangement, producer order, consumer order, producer TP, consumer TP, block-size ratio);
# heterogeneous TP needs an HND producer (NHD ones are refused, tests/peer/test_plan.py).
REMOTE = [
    (arr, *case)
    for arr in ("blocks_first", "split")
    for case in (
        ("NHD", "NHD", 1, 1, 2),
        ("NHD", "HND", 1, 1, 4),
        ("HND", "NHD", 2, 1, 2),
        ("HND", "HND", 1, 2, 2),
    )
]


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize(("arrangement", "p_order", "c_order", "p_tp", "c_tp", "ratio"), REMOTE)
def test_remote_pulls_lay_tokens_end_to_end(
    peers: tuple[DaemonProcess, DaemonProcess],
    plane: str,
    arrangement: str,
    p_order: str,
    c_order: str,
    p_tp: int,
    c_tp: int,
    ratio: int,
) -> None:
    """The same check on a pull between two daemons (tests/peer/test_pulls.py covers kv_first)."""
    producer, consumer = peers
    dtype = torch.bfloat16
    src = _Engine(producer.config.endpoint, arrangement, SRC_TOKENS, p_order, dtype, p_tp)
    dst = _Engine(consumer.config.endpoint, arrangement, SRC_TOKENS * ratio, c_order, dtype, c_tp)
    try:
        src_ids, dst_ids = [9, 2, 3, 11, 0, 5, 7, 4][: 2 * ratio], [6, 1]
        src.client.publish(src.name, f"r-{dst.name}", src_ids)
        pulled = dst.client.pull(
            dst.name,
            producer.config.peer_endpoint,
            src.name,
            {"r": (src_ids, dst_ids)},
            remote_request_ids={"r": f"r-{dst.name}"},
            plane=plane,  # type: ignore[arg-type]
        )
        assert pulled.finished == ["r"] and pulled.plane == plane, pulled
        _check(src, dst, src_ids, dst_ids, f"{plane} pull, TP {p_tp} -> {c_tp}")
    finally:
        src.close()
        dst.close()


def _register_mixed(
    raw: Raw, fd_socket: str, engine: str, block_size: int
) -> tuple[int, int, socket.socket]:
    """Register a worker whose layer ``a`` is blocks_first and ``b`` kv_first (raw protocol: the
    client library registers one arrangement per call). Returns its memfd, a layer's size and
    its fd-channel connection (closing it releases the worker)."""
    descs = [
        BufferDescriptor(arr, "NHD", "float16", BLOCKS, block_size, HEADS, HEAD_SIZE)
        for arr in ("blocks_first", "kv_first")
    ]
    nbytes = 2 * BLOCKS * block_size * HEADS * HEAD_SIZE * 2
    fd = sealed_memfd(2 * nbytes, fill=block_size)
    token = os.urandom(16)
    conn = send_fds_raw(fd_socket, token, [fd])
    reply = raw.call(
        Register(
            id=raw.next_id(),
            protocol_version=PROTOCOL_VERSION,
            worker=WorkerRef(engine),
            tp_size=1,
            layers=[
                LayerSpec(name, desc, ShmRef(0, 2 * nbytes, i * nbytes, nbytes))
                for i, (name, desc) in enumerate(zip("ab", descs, strict=True))
            ],
            fd_token=token,
        )
    )
    assert not isinstance(reply, Error), reply
    return fd, nbytes, conn


def test_a_reblocked_move_mixing_blocks_first_with_other_layers_is_refused(
    daemon: DaemonProcess,
) -> None:
    """blocks_first rows split in two before the ratio, other layers' do not: one move cannot
    plan both, so it is refused whole, nothing written; each arrangement alone moves."""
    with Raw(daemon.config.endpoint) as raw:
        src_fd, _, src_conn = _register_mixed(raw, daemon.config.fd_socket, "mixed-4", SRC_TOKENS)
        dst_fd, nbytes, dst_conn = _register_mixed(
            raw, daemon.config.fd_socket, "mixed-8", 2 * SRC_TOKENS
        )
        try:
            src, dst = BufferSetRef(WorkerRef("mixed-4")), BufferSetRef(WorkerRef("mixed-8"))
            before = os.pread(dst_fd, 2 * nbytes, 0)
            refused = raw.call(Move(id=raw.next_id(), src=src, dst=dst), ids(0, 1), ids(2))
            assert isinstance(refused, Error) and refused.code == "incompatible_buffers", refused
            assert os.pread(dst_fd, 2 * nbytes, 0) == before
            row = nbytes // BLOCKS  # one block's K and V
            for i, layer in enumerate("ab"):
                move = Move(id=raw.next_id(), src=src, dst=dst, layers=[layer])
                moved = raw.call(move, ids(0, 1), ids(2))
                assert isinstance(moved, Moved) and moved.blocks == 1, moved
                # The source is all 4s, the destination 8s: block 2 of this layer, and nothing
                # else, now holds 4s (K and V side by side in a blocks_first row; kv_first has
                # all K rows, then all V rows).
                want = bytearray(b"\x08" * nbytes)
                spans = (
                    [(2 * row, row)]
                    if layer == "a"
                    else [(row, row // 2), (nbytes // 2 + row, row // 2)]
                )
                for start, length in spans:
                    want[start : start + length] = b"\x04" * length
                assert os.pread(dst_fd, nbytes, i * nbytes) == bytes(want), layer
        finally:
            for conn in (src_conn, dst_conn):
                conn.close()
            os.close(src_fd)
            os.close(dst_fd)
