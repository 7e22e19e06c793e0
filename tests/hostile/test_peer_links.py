"""Links to other daemons are bounded, keyed by who answers, and only to endpoints that pass.

A pull carries its producer's endpoint, and an engine's connector passes one on from an API
user's request, so whoever sends pulls chooses where the daemon connects. Attacked from outside
the project's client: the attacker process (`tests.procs.attacker` ``endpoint_flood``) registers
an engine of its own with raw messages and floods a consumer daemon with raw ``Pull`` requests,
each spelling one producer's endpoint another way (a source address before a ``;``, the other
addresses of the loopback net, which reach a producer bound to ``0.0.0.0``, host names in other
cases, ports with leading zeros) or naming a port where nothing listens.

Before, every spelling was a link kept forever: a few hundred of them used up the peer context's
sockets, and the daemon could reach no new or restarted peer. Now a spelling that fails the peer
endpoint rule is refused ``invalid_message`` (never ``internal``), a link that reaches a daemon
already linked serves its pull and is closed, and at most ``peer_max_links`` are open: the
consumer's descriptors stay bounded, and afterwards a restarted producer and a new one are
reached at once. The other tests: the ``peers`` setting, malformed endpoints one by one, and a
producer whose handshake reply is larger than the consumer accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvsidecar.peer.messages import PEER_PROTOCOL_VERSION, PeerWelcome
from kvsidecar.wire.curve import load_keypair
from kvsidecar.wire.protocol import Error, Heartbeat, Ok
from kvsidecar.wire.pulls import Publish, Pull, Pulled, PullItem
from kvsidecar.wire.types import WorkerRef
from tests.support.attack import Attacker
from tests.support.daemons import (
    DaemonProcess,
    cluster_key,
    daemon_process,
    peer_config,
    peer_daemon,
)
from tests.support.ports import reserve_port
from tests.support.procfs import fd_count
from tests.support.raw import Raw, ids, kv_descriptor, register_fd, sealed_memfd

pytestmark = pytest.mark.timeout(300)

_, NBYTES = kv_descriptor(16)
MAX_LINKS = 16


class Engine:
    """One raw-registered engine on a daemon (its worker kept alive by `call`)."""

    def __init__(self, daemon: DaemonProcess, name: str, fill: int) -> None:
        self.name = name
        self.raw = Raw(daemon.config.endpoint)
        self.fd = sealed_memfd(NBYTES, fill)
        reply, self.conn = register_fd(self.raw, daemon.config.fd_socket, name, self.fd)
        assert not isinstance(reply, Error), reply

    def call(self, msg: Any, *frames: bytes, timeout: float = 30.0) -> Any:
        self.raw.call(Heartbeat(id=self.raw.next_id(), workers=[WorkerRef(self.name)]))
        return self.raw.call(msg, *frames, timeout=timeout)

    def publish(self, request: str, blocks: list[int]) -> None:
        msg = Publish(id=self.raw.next_id(), engine_id=self.name, request_id=request)
        assert isinstance(self.call(msg, ids(*blocks)), Ok)

    def pull(
        self, endpoint: str, remote_engine: str, request: str, block: int, into: int = -1
    ) -> Any:
        """Pull remote ``block`` of ``request`` into local block ``into`` (default: the same)."""
        msg = Pull(
            id=self.raw.next_id(),
            engine_id=self.name,
            remote_endpoint=endpoint,
            remote_engine_id=remote_engine,
            items=[PullItem(request, 1, 1)],
            tp_rank=0,
            timeout_s=10.0,
        )
        return self.call(msg, ids(block), ids(block if into < 0 else into))

    def block(self, b: int) -> bytes:
        return os.pread(self.fd, 128, b * 128)

    def close(self) -> None:
        self.conn.close()
        os.close(self.fd)
        self.raw.close()


def _producer(port: int) -> Any:
    """A producer daemon bound to every address of this host: ``127.a.b.c`` all reach it."""
    return peer_daemon(peer_endpoint=f"tcp://0.0.0.0:{port}", lease_s=60.0, peer_lease_s=60.0)


@contextlib.contextmanager
def _restarted(port: int) -> Iterator[DaemonProcess]:
    """A producer started again on ``port`` as soon as it is free (a restart keeps its address;
    a connection of any process on this shared host may hold the port for a moment)."""
    for attempt in range(20):
        started = daemon_process(peer_config(peer_endpoint=f"tcp://0.0.0.0:{port}", lease_s=60.0))
        try:
            daemon = started.__enter__()
        except RuntimeError as exc:
            if "already in use" not in str(exc) or attempt == 19:
                raise
            time.sleep(0.5)
            continue
        break
    try:
        yield daemon
    finally:
        started.__exit__(None, None, None)


def _honest_pull(consumer: Engine, producer: DaemonProcess, port: int, fill: int) -> Pulled:
    p = Engine(producer, "p", fill)
    try:
        p.publish("honest", [3])
        reply = consumer.pull(f"tcp://127.0.0.1:{port}", "p", "honest", 3, into=5)
        if reply.finished:
            assert consumer.block(5) == bytes([fill]) * 128
    finally:
        p.close()
    assert isinstance(reply, Pulled), reply
    return reply


def _watch_fds(pid: int, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        try:
            seen.append(fd_count(pid))
        except FileNotFoundError:
            return
        time.sleep(0.1)


def test_an_endpoint_spelling_flood_is_bounded_and_peers_stay_reachable(tmp_path: Path) -> None:
    port = reserve_port()
    with peer_daemon(peer_endpoint="", lease_s=60.0, peer_max_links=MAX_LINKS) as cons:
        consumer = Engine(cons, "c", 0)
        try:
            with _producer(port) as prod:
                assert _honest_pull(consumer, prod, port, 7).finished == ["honest"]
                before = fd_count(cons.proc.pid)
                seen: list[int] = []
                stop = threading.Event()
                watcher = threading.Thread(target=_watch_fds, args=(cons.proc.pid, stop, seen))
                watcher.start()
                started = time.monotonic()
                flood = Attacker(
                    {
                        "attack": "endpoint_flood",
                        "endpoint": cons.config.endpoint,
                        "fd_socket": cons.config.fd_socket,
                        "peer_port": port,
                        "remote_engine": "nobody",
                        "count": 720,
                        "inflight": 48,
                        "timeout_s": 5.0,
                    }
                )
                try:
                    assert flood.line(240) == "flooded"  # every pull sent and answered
                finally:
                    result = flood.finish()
                    stop.set()
                    watcher.join()
                flood_s = time.monotonic() - started
            # A restarted producer (a new daemon id on the same endpoint) and a new one.
            with _restarted(port) as restarted:
                again = _honest_pull(consumer, restarted, port, 9)
            other = reserve_port()
            with _producer(other) as new:
                fresh = _honest_pull(consumer, new, other, 11)
            after = fd_count(cons.proc.pid)
        finally:
            consumer.close()
        log = cons.log()
    figures = {
        "flood_s": round(flood_s, 1),
        "pulls_sent": result["sent"],
        "outcomes": result["outcomes"],
        "consumer_fds": {"before": before, "peak": max(seen), "after": after},
    }
    (tmp_path / "endpoint_flood.json").write_text(json.dumps(figures, indent=2))
    print(f"\nendpoint flood: {json.dumps(figures)}")
    assert again.finished == ["honest"], (again, log[-3000:])
    assert fresh.finished == ["honest"], (fresh, log[-3000:])
    assert "internal" not in json.dumps(result["outcomes"]), result
    assert result["outcomes"].get("invalid_message", 0) > 100, result  # the source forms
    assert result["sent"] >= 500, result
    # Each open link holds a few descriptors (its connections, ZeroMQ's mailboxes): at most
    # MAX_LINKS of them, plus the passing ones of the pulls in flight, closing.
    assert max(seen) - before < 24 * MAX_LINKS, figures


@pytest.fixture
def consumer() -> Iterator[tuple[DaemonProcess, Engine]]:
    with peer_daemon(peer_endpoint="", lease_s=60.0) as cons:
        engine = Engine(cons, "c", 0)
        try:
            yield cons, engine
        finally:
            engine.close()


MALFORMED = [
    "tcp://",
    "tcp://:5555",
    "tcp://127.0.0.1",
    "tcp://127.0.0.1:",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:-1",
    "tcp://[::1:5555",
    "tcp://[zz]:5555",
    "tcp://*:5555",
    "tcp://0.0.0.0:5555",
    "tcp://127.0.0.1:1;127.0.0.1:5555",
    "tcp://127.0.0.1:5555;",
    "tcp://;:5555",
    "tcp://a b:5555",
    "tcp://h\x00st:5555",
    "tcp://" + "a" * 300 + ":5555",
    "udp://127.0.0.1:5555",
    "ipc:///tmp/x",
    "inproc://x",
    "pgm://eth0;239.192.1.1:5555",
    "127.0.0.1:5555",
]


def test_a_malformed_endpoint_is_refused_with_a_typed_error(
    consumer: tuple[DaemonProcess, Engine],
) -> None:
    _, engine = consumer
    for endpoint in MALFORMED:
        reply = engine.pull(endpoint, "p", "r", 1)
        assert isinstance(reply, Error) and reply.code == "invalid_message", (endpoint, reply)
    assert engine.block(1) == bytes(128)


def test_with_peers_set_only_those_endpoints_are_pulled_from() -> None:
    port = reserve_port()
    allowed = f"tcp://127.0.0.1:{port}"
    with (
        _producer(port) as prod,
        peer_daemon(peer_endpoint="", lease_s=60.0, peers=allowed) as cons,
    ):
        engine = Engine(cons, "c", 0)
        try:
            refused = engine.pull(f"tcp://127.0.0.2:{port}", "p", "honest", 5)
            assert isinstance(refused, Error) and refused.code == "forbidden", refused
            # The same endpoint spelled otherwise is the same peer.
            assert _honest_pull(engine, prod, port, 5).finished == ["honest"]
            # It reaches the producer (whose engine "p" has gone by now), not a refusal.
            reply = engine.pull(f"tcp://127.0.0.1:0{port}", "p", "again", 6)
            assert isinstance(reply, Error) and reply.code == "unknown_engine", reply
        finally:
            engine.close()


class _BigWelcomer:
    """A fake producer: a CURVE ROUTER with the cluster key that answers every handshake with a
    welcome of ``size`` bytes (no engine, a huge NIXL metadata blob)."""

    def __init__(self, port: int, size: int) -> None:
        keys = load_keypair(cluster_key())
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_server = True
        self.sock.curve_secretkey = keys.secret
        self.sock.curve_publickey = keys.public
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.size = size
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            ident, header, *_ = self.sock.recv_multipart()
            hello = msgspec.msgpack.decode(header)
            welcome = PeerWelcome(
                id=hello["id"],
                protocol_version=PEER_PROTOCOL_VERSION,
                daemon_id="big",
                engines=[],
                planes=["zmq"],
                nixl_metadata=b"\x00" * self.size,
            )
            self.sock.send_multipart([ident, msgspec.msgpack.encode(welcome)])
            self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


def test_a_peer_reply_larger_than_the_bound_is_not_taken() -> None:
    port = reserve_port()
    with peer_daemon(peer_endpoint="", lease_s=60.0, max_message_bytes=4 << 20) as cons:
        engine = Engine(cons, "c", 0)
        fake = _BigWelcomer(port, 32 << 20)
        try:
            reply = engine.pull(f"tcp://127.0.0.1:{port}", "p", "r", 1)
            # Taken, it would have been read as a welcome without the engine (unknown_engine).
            assert isinstance(reply, Pulled), reply
            assert reply.error_code == "peer_unavailable" and reply.failed == ["r"], reply
            assert fake.answered >= 1
            assert cons.proc.poll() is None
        finally:
            fake.close()
            engine.close()
