"""Packed read replies on the ZMQ plane (kvsidecar/peer/zmq_plane.py `pack`, the peer service).

A producer daemon answers a read of many small ranges (single blocks) with one packed frame,
and a read of a few long ranges with a frame per range, each checked byte by byte against the
source tensors indexed by hand; a consumer that does not read its replies gets unpacked ones
once the packed copies held for it reach `PACKED_REPLY_BYTES`; and a pull of random block ids
between two daemons (packed replies, unpacked on the consumer's data streams) lands element by
element. This process is the engine worker of both daemons.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.peer.messages import PeerReply, ReadBlocks, ReadData
from kvsidecar.peer.service import PACKED_REPLY_BYTES
from kvsidecar.wire.curve import load_keypair
from tests.support.daemons import DaemonProcess, cluster_key, peer_daemon

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS = 2, 64
SHAPE = (2, BLOCKS, 16, 8, 128)  # kv_first: K blocks, then V blocks, of 32 KiB each
ROW = 16 * 8 * 128 * 2
_ids = itertools.count(1)


@dataclass
class Pair:
    prod: DaemonProcess
    cons: DaemonProcess
    pc: SidecarClient
    cc: SidecarClient
    src: list[torch.Tensor]
    dst: list[torch.Tensor]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    src = allocate_kv_caches(LAYERS, SHAPE, torch.float16)
    dst = allocate_kv_caches(LAYERS, SHAPE, torch.float16)
    rng = np.random.default_rng(3)
    for t in src:
        t.view(torch.int16).copy_(
            torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, t.shape, dtype=np.int16))
        )
    with (
        peer_daemon() as prod,
        peer_daemon(peer_endpoint="") as cons,
        SidecarClient(prod.config.endpoint, timeout_s=30, name="packing-p") as pc,
        SidecarClient(cons.config.endpoint, timeout_s=30, name="packing-c") as cc,
    ):
        pc.register_kv_caches({f"l{i}": t for i, t in enumerate(src)}, engine_id="p")
        cc.register_kv_caches({f"l{i}": t for i, t in enumerate(dst)}, engine_id="c")
        yield Pair(prod, cons, pc, cc, src, dst)


class PeerSocket:
    """A DEALER on the producer's peer endpoint with the cluster key (another daemon's seat)."""

    def __init__(self, endpoint: str, **options: int) -> None:
        keys = load_keypair(cluster_key())
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(PeerReply)

    def send(self, request_id: str, ranges: list[tuple[int, int, int]]) -> None:
        msg = ReadBlocks(
            id=next(_ids),
            engine_id="p",
            tp_rank=0,
            pp_rank=0,
            request_id=request_id,
            layers=[f"l{i}" for i in range(LAYERS)],
        )
        frame = np.array(ranges, dtype="<i8").reshape(-1, 3).tobytes()
        self.sock.send_multipart([msgspec.msgpack.encode(msg), frame])

    def receive(self) -> tuple[PeerReply, list[bytes]]:
        assert self.sock.poll(20_000), "no peer reply"
        header, *data = self.sock.recv_multipart()
        return self.decoder.decode(header), data

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _publish(pair: Pair, blocks: list[int]) -> str:
    request_id = f"r{next(_ids)}"
    pair.pc.publish("p", request_id, blocks)
    return request_id


def _expected(pair: Pair, ranges: list[tuple[int, int, int]]) -> bytes:
    """The ranges' bytes, read from the source tensors by hand."""
    flats = [t.view(-1).view(torch.uint8).numpy() for t in pair.src]
    return b"".join(flats[layer][off : off + n].tobytes() for layer, off, n in ranges)


def _single_blocks(rng: np.random.Generator, n: int) -> list[tuple[int, int, int]]:
    """``n`` single-block ranges (K or V, random layers and blocks, in random order)."""
    rows = rng.choice(2 * BLOCKS, n, replace=False)
    return [(int(rng.integers(0, LAYERS)), int(r) * ROW, ROW) for r in rows]


def test_many_small_ranges_come_packed_and_few_long_ones_as_frames(pair: Pair) -> None:
    peer = PeerSocket(pair.prod.config.peer_endpoint)
    try:
        rid = _publish(pair, list(range(BLOCKS)))
        small = _single_blocks(np.random.default_rng(0), 48)
        peer.send(rid, small)
        reply, data = peer.receive()
        assert isinstance(reply, ReadData) and reply.packed and reply.nbytes == 48 * ROW
        assert len(data) == 1 and data[0] == _expected(pair, small)

        halves = [(1, 0, BLOCKS * ROW), (0, BLOCKS * ROW, BLOCKS * ROW)]  # l1's K, l0's V
        peer.send(rid, halves)
        reply, data = peer.receive()
        assert isinstance(reply, ReadData) and not reply.packed
        assert len(data) == 2 and b"".join(data) == _expected(pair, halves)
    finally:
        peer.close()


def test_a_consumer_that_does_not_read_holds_a_bounded_amount_of_packed_copies(
    pair: Pair,
) -> None:
    # Queues of one message and a small kernel buffer here: the replies wait in the producer.
    peer = PeerSocket(pair.prod.config.peer_endpoint, RCVHWM=1, RCVBUF=1 << 16)
    try:
        rid = _publish(pair, list(range(BLOCKS)))
        reads = [_single_blocks(np.random.default_rng(i), 128) for i in range(40)]
        assert len(reads) * 128 * ROW > 2 * PACKED_REPLY_BYTES
        for ranges in reads:
            peer.send(rid, ranges)
        time.sleep(1.0)  # every read served: the packed budget is spent
        packed = 0
        for ranges in reads:
            reply, data = peer.receive()
            assert isinstance(reply, ReadData) and reply.nbytes == 128 * ROW
            assert b"".join(data) == _expected(pair, ranges)
            packed += reply.packed
        # 4 MiB per packed reply: the budget holds 16 of them, the kernel buffers a few more.
        assert 16 <= packed < len(reads), packed
        peer.send(rid, reads[0])  # drained: packed again
        reply, data = peer.receive()
        assert isinstance(reply, ReadData) and reply.packed
    finally:
        peer.close()


def test_a_pull_of_random_block_ids_lands_element_by_element(pair: Pair) -> None:
    rng = np.random.default_rng(5)
    remote = rng.choice(BLOCKS, 40, replace=False).tolist()
    local = rng.choice(BLOCKS, 40, replace=False).tolist()
    for t in pair.dst:
        t.view(torch.int16).fill_(7)
    rid = _publish(pair, remote)
    pulled = pair.cc.pull(
        "c",
        pair.prod.config.peer_endpoint,
        "p",
        {"req": (remote, local)},
        remote_request_ids={"req": rid},
        plane="zmq",
    )
    assert not pulled.failed and pulled.nbytes == LAYERS * 2 * 40 * ROW
    others = sorted(set(range(BLOCKS)) - set(local))
    for s, d in zip(pair.src, pair.dst, strict=True):
        for r, loc in zip(remote, local, strict=True):
            assert torch.equal(d.view(torch.int16)[:, loc], s.view(torch.int16)[:, r])
        assert (d.view(torch.int16)[:, others] == 7).all()
