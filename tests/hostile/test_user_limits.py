"""A user who forks gets no more than a user who does not: limits are counted per uid.

A real daemon serves root and ``nobody``. The attacker is a `tests.procs.forker` process of
``nobody`` that forks eight processes, each taking everything one process may take: control
connections, fd-channel connections, copy jobs in flight. Counted per process, eight processes
would get eight times every per-process bound and fill the daemon's totals; counted per uid,
``nobody`` holds at most its share (the total divided by the two allowed uids), and root's new
connections and moves are served throughout.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvsidecar.node.config import Config
from kvsidecar.wire.protocol import Error, Move, Moved, Status, StatusReply
from kvsidecar.wire.types import BufferSetRef, WorkerRef
from tests.support.children import LineChild
from tests.support.daemons import DaemonProcess, daemon_process, make_config, open_to_every_uid
from tests.support.raw import Raw, ids, register_fd, sealed_memfd

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

NOBODY = 65534
CHILDREN = 8
PER_PROCESS = 16
TOTAL = 64
SHARE = TOTAL // 2
"""What ``nobody`` may hold of each total: two uids are allowed."""


class Forker(LineChild):
    """The `tests.procs.forker` process of ``nobody``; one JSON command per line."""

    def __init__(self, config: Config) -> None:
        spec = {
            "uid": NOBODY,
            "endpoint": config.endpoint,
            "fd_socket": config.fd_socket,
            "children": CHILDREN,
        }
        super().__init__("forker", json.dumps(spec), name="forker")
        self.wait_ready(60)

    def ask(self, timeout: float = 120.0, **cmd: Any) -> dict[str, Any]:
        self.send_line(json.dumps(cmd))
        out: dict[str, Any] = json.loads(self.line(timeout))
        return out


def _config() -> Config:
    return make_config(
        allowed_uids=f"{os.geteuid()},{NOBODY}",
        max_connections=TOTAL,
        max_connections_per_peer=PER_PROCESS,
        max_moves_total=TOTAL,
        max_moves_per_worker=PER_PROCESS,
        max_reply_bytes=1 << 20,
        fd_unclaimed_s=60.0,  # idle fd connections stay for the test's length
        lease_s=60.0,
        host_pool_bytes=8 << 20,
    )


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process(_config) as d:
        open_to_every_uid(d.config)
        yield d


def _served(config: Config) -> bool:
    with Raw(config.endpoint) as raw:
        try:
            return isinstance(raw.call(Status(id=1), timeout=3), StatusReply)
        except TimeoutError:
            return False


def _fd_channel_keeps(config: Config) -> bool:
    """Whether a fresh fd-channel connection of root's stays open (not refused at accept)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(config.fd_socket)
        s.settimeout(0.5)
        try:
            return s.recv(1) != b""
        except TimeoutError:
            return True


def test_forked_processes_share_their_users_connections(daemon: DaemonProcess) -> None:
    """Eight processes of ``nobody`` each open what one process may (16 DEALERs, 16 fd
    connections): ``nobody`` holds at most its share of either socket's total, and root's new
    connections on both are served."""
    forker = Forker(daemon.config)
    try:
        took = forker.ask(op="connect", zmq=PER_PROCESS, fd=PER_PROCESS)
        time.sleep(1.0)  # the daemon's connection counts follow its monitor, a little behind
        took = forker.ask(op="count")
        assert took["served"] <= SHARE, took
        assert took["fd_open"] <= SHARE, took
        assert took["served"] >= PER_PROCESS and took["fd_open"] >= PER_PROCESS, took  # not 0
        assert _served(daemon.config), "root's new control connection was refused"
        assert _fd_channel_keeps(daemon.config), "root's new fd connection was refused"
        # More of the same changes nothing: nobody stays within its share.
        more = forker.ask(op="connect", zmq=4, fd=4)
        assert more["served"] <= SHARE and more["fd_open"] <= SHARE, more
        assert _served(daemon.config)
    finally:
        forker.stop()


def test_forked_processes_share_their_users_moves_in_flight(daemon: DaemonProcess) -> None:
    """Eight processes of ``nobody``, an engine each, keep 16 slow moves in flight each (the
    per-worker bound): ``nobody`` gets at most its share of ``max_moves_total``, and root's own
    moves are admitted throughout, never ``busy``."""
    config = daemon.config
    memory = sealed_memfd(256 * 16, fill=0x33)  # `kv_descriptor` of 16 blocks: 256 bytes each
    root = Raw(config.endpoint)
    forker: Forker | None = None
    try:
        reply, conn = register_fd(root, config.fd_socket, "honest", memory)
        assert type(reply).__name__ == "Registered", reply
        forker = Forker(config)
        started = forker.ask(op="flood", depth=PER_PROCESS, blocks=64)
        assert started["registered"] == CHILDREN, started
        time.sleep(1.0)  # every attacker's moves are queued now
        ref = BufferSetRef(WorkerRef("honest"))
        outcomes = []
        for i in range(20):
            # Checksummed: never the short path on the loop, always admitted as a job.
            move = Move(id=100 + i, src=ref, dst=ref, checksum=True)
            out = root.call(move, ids(1), ids(2 + i % 8), timeout=30)
            outcomes.append(type(out).__name__ if isinstance(out, Moved) else out.code)  # type: ignore[attr-defined]
            time.sleep(0.05)
        flood = forker.ask(op="stop")
        assert flood["moved"] > 0, flood  # the attack ran
        assert outcomes == ["Moved"] * 20, (outcomes, flood)
        conn.close()
    finally:
        if forker is not None:
            forker.stop()
        root.close()
        os.close(memory)


def _engine_id_answered_in(nbytes: int) -> int:
    """The length of an engine id whose ``unknown_engine`` error is ``nbytes`` long: so many of
    them fill a reply budget of a multiple of ``nbytes`` to the byte."""
    for length in range(nbytes - 100, nbytes):
        message = f"no engine {'x' * length!r} is registered"
        reply = Error(id=9, code="unknown_engine", message=message)
        if len(msgspec.msgpack.encode(reply)) == nbytes:
            return length
    raise AssertionError(f"no engine id gives an error of {nbytes} bytes")


def test_forked_processes_that_never_read_take_only_their_users_share_of_reply_room(
    daemon: DaemonProcess,
) -> None:
    """Eight processes of ``nobody`` each ask for 200 replies of 64 KiB and never read them:
    they fill ``nobody``'s share of ``max_reply_bytes`` (1 MiB here), exactly, not root's, whose
    ``status`` (refused ``busy`` while no room is left) is answered."""
    forker = Forker(daemon.config)
    try:
        sent = forker.ask(op="unread", count=200, size=_engine_id_answered_in(1 << 16))
        assert sent["sent"] == CHILDREN * 200, sent
        time.sleep(2.0)  # the daemon has read and answered them: its replies wait, unread
        with Raw(daemon.config.endpoint) as root:
            outs = [root.call(Status(id=10 + i), timeout=10) for i in range(5)]
        assert all(isinstance(out, StatusReply) for out in outs), outs
    finally:
        forker.stop()
