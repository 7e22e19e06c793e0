"""Every data plane serves exactly the published blocks of a request, within its lease.

Attacked from outside the project's client: a raw CURVE DEALER on the producer's peer endpoint
(what another node's daemon, or anyone holding the cluster key, can send), raw ``Pull`` requests
on the control socket from an engine of the same node (the local plane), and a hostile peer
daemon with a NIXL agent of its own (`tests.procs.attacker` ``nixl_read``). The producer's layer
holds a known pattern, so every byte that leaves is compared with what it must be.

- ZMQ plane: reads of a request never published, of blocks beside the published ones, of another
  request's blocks under a published id, and after the lease ended are refused; a read of the
  published blocks gets their bytes and nothing else.
- Local plane: the same four pulls fail and write nothing into the consumer's blocks; the honest
  one lands the published bytes.
- NIXL: UCX lets a peer that holds an agent's metadata read any of the agent's memory (and on
  TCP or CMA, memory that was never registered, or was deregistered: docs/reliability.md), so a
  daemon offers NIXL only with ``peer_nixl_trusted``. By default (``auto`` with a peer endpoint)
  the hostile peer gets no metadata and reads nothing; the control, a daemon set to trust its
  peers, shows that the same attacker then reads the whole layer, unpublished blocks included.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvsidecar.peer.messages import PeerError, PeerReply, ReadBlocks, ReadData
from kvsidecar.peer.nixl_plane import nixl_available
from kvsidecar.wire.curve import load_keypair, secure_client_socket
from kvsidecar.wire.protocol import Heartbeat, Ok
from kvsidecar.wire.pulls import Publish, Pull, Pulled, PullItem
from kvsidecar.wire.types import WorkerRef
from tests.support.attack import Attacker
from tests.support.daemons import DaemonProcess, cluster_key, peer_daemon
from tests.support.raw import Raw, ids, kv_descriptor, register_fd, sealed_memfd

pytestmark = pytest.mark.timeout(120)

DESC, NBYTES = kv_descriptor(16)  # kv_first, 16 blocks; one block's K (or V): 128 bytes
ROW = NBYTES // 2 // 16
PATTERN = bytes((i * 7 + 3) % 251 for i in range(NBYTES))
DIGEST = "d" * 64


def _rows(block: int) -> list[tuple[int, int, int]]:
    """The K and V rows of ``block`` in layer 0: ``(layer, offset, length)``."""
    return [(0, block * ROW, ROW), (0, NBYTES // 2 + block * ROW, ROW)]


class Node:
    """A producer engine ``p`` (the pattern) and a consumer ``c`` (zeros), registered raw."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.raw = Raw(daemon.config.endpoint)
        self.fds = {"p": sealed_memfd(NBYTES), "c": sealed_memfd(NBYTES)}
        os.pwrite(self.fds["p"], PATTERN, 0)
        self.conns: list[socket.socket] = []
        for engine, fd in self.fds.items():
            reply, conn = register_fd(self.raw, daemon.config.fd_socket, engine, fd)
            assert not hasattr(reply, "code"), reply
            self.conns.append(conn)

    def call(self, msg: Any, *frames: bytes) -> Any:
        """One request, after a heartbeat that keeps both raw workers' leases."""
        beat = Heartbeat(id=self.raw.next_id(), workers=[WorkerRef("p"), WorkerRef("c")])
        self.raw.call(beat)
        return self.raw.call(msg, *frames)

    def publish(self, request: str, blocks: list[int], lease_s: float = 0.0) -> None:
        msg = Publish(
            id=self.raw.next_id(),
            engine_id="p",
            request_id=request,
            lease_s=lease_s,
            prompt_digest=DIGEST,
        )
        assert isinstance(self.call(msg, ids(*blocks)), Ok)

    def consumer_bytes(self) -> bytes:
        return os.pread(self.fds["c"], NBYTES, 0)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for fd in self.fds.values():
            os.close(fd)
        self.raw.close()


@pytest.fixture
def node() -> Iterator[Node]:
    with peer_daemon(peer_lease_s=30.0, lease_s=60.0) as daemon:
        n = Node(daemon)
        try:
            yield n
        finally:
            n.close()


class PeerSocket:
    """A raw CURVE DEALER on a producer's peer endpoint, holding the cluster key."""

    def __init__(self, endpoint: str) -> None:
        keys = load_keypair(cluster_key())
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client_socket(self.sock, server_public=keys.public, keys=keys)
        self.sock.connect(endpoint)
        self._next = 0

    def read(self, request: str, ranges: list[tuple[int, int, int]]) -> tuple[Any, list[bytes]]:
        self._next += 1
        msg = ReadBlocks(
            id=self._next, engine_id="p", tp_rank=0, pp_rank=0, request_id=request, layers=["l0"]
        )
        frame = np.array(ranges, dtype="<i8").reshape(-1, 3).tobytes()
        self.sock.send_multipart([msgspec.msgpack.encode(msg), frame])
        assert self.sock.poll(10_000), "no reply to a read"
        header, *data = self.sock.recv_multipart()
        return msgspec.msgpack.decode(header, type=PeerReply), data

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_the_zmq_plane_serves_the_published_blocks_and_nothing_else(node: Node) -> None:
    node.publish("A", [2, 3], lease_s=30.0)
    node.publish("B", [7], lease_s=30.0)
    node.publish("short", [5], lease_s=1.0)
    peer = PeerSocket(node.daemon.config.peer_endpoint)
    try:
        reply, data = peer.read("A", _rows(2) + _rows(3))
        assert isinstance(reply, ReadData), reply
        want = [PATTERN[o : o + n] for _, o, n in _rows(2) + _rows(3)]
        got = [data[0]] if reply.packed else data
        assert b"".join(got) == b"".join(want)
        attacks = {
            "never published": ("Z", _rows(2)),
            "a block beside the published ones": ("A", _rows(4)),
            "a published block and one more": ("A", [(0, 2 * ROW, 3 * ROW)]),
            "another request's block": ("A", _rows(7)),
            "the whole layer": ("A", [(0, 0, NBYTES)]),
        }
        time.sleep(1.3)  # "short" is past its lease now
        attacks["past its lease"] = ("short", _rows(5))
        for what, (request, ranges) in attacks.items():
            reply, data = peer.read(request, ranges)
            assert isinstance(reply, PeerError), (what, reply)
            assert reply.code in ("out_of_range", "expired"), (what, reply)
            assert data == [], what
    finally:
        peer.close()


def _local_pull(node: Node, request: str, remote: list[int], local: list[int]) -> Pulled:
    msg = Pull(
        id=node.raw.next_id(),
        engine_id="c",
        remote_endpoint="",
        remote_engine_id="p",
        items=[PullItem("x", len(remote), len(local), request, DIGEST)],
        tp_rank=0,
    )
    reply = node.call(msg, ids(*remote), ids(*local))
    assert isinstance(reply, Pulled), reply
    return reply


def test_the_local_plane_serves_the_published_blocks_and_nothing_else(node: Node) -> None:
    node.publish("A", [2, 3], lease_s=30.0)
    node.publish("B", [7], lease_s=30.0)
    node.publish("short", [5], lease_s=1.0)
    time.sleep(1.3)
    for what, (request, remote) in {
        "never published": ("Z", [2]),
        "a block beside the published ones": ("A", [4]),
        "published blocks and one more": ("A", [2, 3, 4]),
        "another request's block": ("A", [7]),
        "past its lease": ("short", [5]),
    }.items():
        local = list(range(8, 8 + len(remote)))
        out = _local_pull(node, request, remote, local)
        assert out.failed == ["x"] and out.nbytes == 0, (what, out)
        assert node.consumer_bytes() == bytes(NBYTES), f"{what}: bytes landed"
    out = _local_pull(node, "A", [3, 2], [9, 10])
    assert out.finished == ["x"], out
    got = node.consumer_bytes()
    for src, dst in ((3, 9), (2, 10)):
        for (_, so, n), (_, do, _) in zip(_rows(src), _rows(dst), strict=True):
            assert got[do : do + n] == PATTERN[so : so + n]
    others = [b for b in range(16) if b not in (9, 10)]
    assert all(got[o : o + n] == bytes(n) for b in others for _, o, n in _rows(b))


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
@pytest.mark.parametrize(
    ("trusted", "reads"),
    [(False, False), (True, True)],
    ids=["default: no NIXL for peers", "control: a daemon that trusts its peers"],
)
def test_a_hostile_peer_reads_nothing_over_nixl_by_default(trusted: bool, reads: bool) -> None:
    # The default data plane (auto) with a peer endpoint: before, this daemon made a NIXL agent
    # with every layer registered and handed its metadata to any peer that asked.
    settings: dict[str, Any] = {"peer_data_plane": "auto", "peer_lease_s": 30.0, "lease_s": 60.0}
    if trusted:
        settings["peer_nixl_trusted"] = True
    with peer_daemon(**settings) as daemon:
        node = Node(daemon)
        try:
            node.publish("A", [1], lease_s=30.0)
            attacker = Attacker(
                {
                    "attack": "nixl_read",
                    "key": cluster_key(),
                    "peer_endpoint": daemon.config.peer_endpoint,
                    "engine": "p",
                }
            )
            result = attacker.finish()
        finally:
            node.close()
    if reads:
        assert "nixl" in result["planes"] and result["metadata_bytes"] > 0, result
        assert bytes.fromhex(result["read"]) == PATTERN, "the control's attacker read nothing"
    else:
        assert "nixl" not in result["planes"], result
        assert result["metadata_bytes"] == 0 and result["read"] is None, result
