"""Sizes from the wire are checked against limits before anything is allocated.

Raw requests to a real daemon process: a registration asking for millions of host blocks or
thousands of layers must be refused at once with a typed error (not allocate first and stall
the loop, or die of ``MemoryError``); one user's engines cannot take more of the host pool than
its quota; and a client that asks for large replies and never reads them cannot make the
daemon buffer more than ``max_reply_bytes`` of them across all connections.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import msgspec
import pytest

from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    HelloReply,
    Register,
    Registered,
    Status,
    StatusReply,
)
from kvsidecar.wire.types import LayerSpec, ShmRef, WorkerRef
from tests.support.daemons import DaemonProcess, StartDaemon, daemon_process, make_config
from tests.support.procfs import rss_mib
from tests.support.raw import Raw, kv_descriptor, register_fd, sealed_memfd, send_fds_raw

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def daemon(daemon_factory: StartDaemon) -> DaemonProcess:
    return daemon_factory(host_pool_bytes=16 << 20, lease_s=60.0)


def _serving(d: DaemonProcess) -> float:
    """Seconds a fresh client waits for a status reply (the daemon must be alive)."""
    assert d.proc.poll() is None, d.log()[-3000:]
    with Raw(d.config.endpoint) as raw:
        t0 = time.monotonic()
        assert isinstance(raw.call(Status(id=1), timeout=30), StatusReply)
        return time.monotonic() - t0


@pytest.mark.parametrize("host_blocks", [1 << 25, 1 << 40, (1 << 63) - 1])
def test_huge_host_block_counts_are_refused_before_any_allocation(
    daemon: DaemonProcess, host_blocks: int
) -> None:
    before = rss_mib(daemon.proc.pid, "VmHWM")
    fd = sealed_memfd(kv_descriptor()[1])
    try:
        with Raw(daemon.config.endpoint) as raw:
            t0 = time.monotonic()
            reply, conn = register_fd(
                raw, daemon.config.fd_socket, "greedy", fd, host_blocks=host_blocks
            )
            took = time.monotonic() - t0
            conn.close()
    finally:
        os.close(fd)
    assert isinstance(reply, Error) and reply.code in ("too_large", "pool_exhausted"), reply
    grown = rss_mib(daemon.proc.pid, "VmHWM") - before
    assert grown < 32, f"the daemon's peak grew {grown:.0f} MiB refusing it"
    assert took < 5, f"{took:.1f} s to refuse it"
    _serving(daemon)


def test_thousands_of_layers_are_refused_at_once(daemon: DaemonProcess) -> None:
    n = 5000  # a header of ~600 KB: under max_header_bytes, over max_layers
    desc = kv_descriptor(blocks=1, block_size=1, heads=1, head_size=1)[0]  # 4 bytes a layer
    fd = sealed_memfd(4 * n)
    token = os.urandom(16)
    conn = send_fds_raw(daemon.config.fd_socket, token, [fd])
    layers = [LayerSpec(f"l{i}", desc, ShmRef(0, 4 * n, 4 * i, 4)) for i in range(n)]
    msg = Register(
        id=2,
        protocol_version=PROTOCOL_VERSION,
        worker=WorkerRef("wide"),
        layers=layers,
        fd_token=token,
    )
    try:
        with Raw(daemon.config.endpoint) as raw:
            reply = raw.call(msg, timeout=60)
    finally:
        conn.close()
        os.close(fd)
    assert isinstance(reply, Error) and reply.code == "too_large", type(reply).__name__
    assert "layers" in reply.message
    _serving(daemon)


def test_one_users_engines_stay_within_its_host_pool_quota() -> None:
    quota = 64 << 10
    config = make_config(host_pool_bytes=16 << 20, host_pool_user_bytes=quota, lease_s=60.0)
    _, nbytes = kv_descriptor()
    per_block = nbytes // 16
    with daemon_process(config) as d, Raw(d.config.endpoint) as raw:
        fds = [sealed_memfd(nbytes) for _ in range(3)]
        conns = []
        try:
            replies = []
            for i, blocks in enumerate((quota // per_block, 1, 1)):
                reply, conn = register_fd(
                    raw, d.config.fd_socket, f"e{i}", fds[i], host_blocks=blocks
                )
                replies.append(reply)
                conns.append(conn)
            assert isinstance(replies[0], Registered), replies[0]  # exactly the quota
            assert isinstance(replies[1], Error) and replies[1].code == "pool_exhausted"
            assert "quota" in replies[1].message
            status = raw.call(Status(id=raw.next_id()))
            assert isinstance(status, StatusReply) and status.host_pool_used_bytes <= quota
        finally:
            for c in conns:
                c.close()
            for fd in fds:
                os.close(fd)


def _statuses_answered(metrics_url: str) -> float:
    """Status requests the daemon has answered (by any result), from its own /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('kvsidecar_commands_total{command="status"')
    )


def _register_wide(d: DaemonProcess, raw: Raw, n: int, name_len: int) -> socket.socket:
    """Register ``n`` tiny layers with long names: the daemon's status reply becomes large."""
    desc = kv_descriptor(blocks=1, block_size=1, heads=1, head_size=1)[0]  # 4 bytes a layer
    fd = sealed_memfd(4 * n)
    token = os.urandom(16)
    conn = send_fds_raw(d.config.fd_socket, token, [fd])
    os.close(fd)
    names = [f"{i:05d}".rjust(name_len, "L") for i in range(n)]
    layers = [LayerSpec(nm, desc, ShmRef(0, 4 * n, 4 * i, 4)) for i, nm in enumerate(names)]
    msg = Register(
        id=raw.next_id(),
        protocol_version=PROTOCOL_VERSION,
        worker=WorkerRef("wide"),
        layers=layers,
        fd_token=token,
    )
    assert isinstance(raw.call(msg, timeout=60), Registered)
    return conn


def test_replies_buffered_for_slow_readers_are_bounded_across_connections() -> None:
    """Clients that ask for 500 KB replies and never read them: the daemon holds only so many."""
    limit = 32 << 20
    with (
        daemon_process(make_config(max_reply_bytes=limit, lease_s=60.0)) as d,
        Raw(d.config.endpoint) as raw,
    ):
        conn = _register_wide(d, raw, 1000, 480)  # a status reply of about 500 KB
        status = raw.call(Status(id=raw.next_id()))
        assert isinstance(status, StatusReply)
        assert len(msgspec.msgpack.encode(status)) > 400_000
        metrics = f"http://127.0.0.1:{status.metrics_port}/metrics"
        answered = _statuses_answered(metrics)
        before = rss_mib(d.proc.pid)
        silent = [Raw(d.config.endpoint, slow_reader=True) for _ in range(4)]
        try:
            for i in range(400):  # 200 MB of replies asked for; nobody reads them
                silent[i % 4].send(Status(id=i + 10))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _statuses_answered(metrics) < answered + 400:
                time.sleep(0.2)
            grown = rss_mib(d.proc.pid) - before
            # Meanwhile others are answered: small replies at once, large ones `busy` (typed).
            with Raw(d.config.endpoint) as other:
                hello = other.call(Hello(id=1, protocol_version=PROTOCOL_VERSION), timeout=5)
                busy = other.call(Status(id=2), timeout=5)
        finally:
            for s in silent:
                s.close()
        assert grown < (limit >> 20) + 24, f"{grown:.0f} MiB held for readers that never read"
        assert isinstance(hello, HelloReply), hello
        assert isinstance(busy, Error) and busy.code == "busy", busy
        # The silent clients gone, their replies are dropped and the room comes back.
        deadline = time.monotonic() + 10
        while not isinstance(raw.call(Status(id=raw.next_id())), StatusReply):
            assert time.monotonic() < deadline, "the reply budget never came back"
            time.sleep(0.1)
        conn.close()
