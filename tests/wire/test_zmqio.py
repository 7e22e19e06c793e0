"""Non-blocking multipart send/receive helpers (kvsidecar/zmqio.py) on real ipc sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvsidecar.wire import zmqio

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/s.sock"
    router.bind(endpoint)
    dealer.connect(endpoint)
    try:
        yield router, dealer
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def _wait_readable(sock: zmq.Socket[bytes]) -> None:
    deadline = time.monotonic() + 5
    while not zmqio.readable(sock):
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.001)


@pytest.mark.parametrize("copy", [True, False, None])
def test_multipart_round_trip_keeps_every_frame(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], copy: bool | None
) -> None:
    router, dealer = pair
    ids = np.arange(10_000, dtype="<i4")  # 40 KB: sent from the array's own buffer
    zmqio.send_frames(dealer, [b"header", ids, b""], copy=copy)
    _wait_readable(router)
    frames = zmqio.recv_frames(router)
    assert [f.bytes for f in frames[1:]] == [b"header", ids.tobytes(), b""]
    zmqio.send_frames(router, [frames[0], b"reply"], copy=True)  # routed back by identity
    _wait_readable(dealer)
    assert [f.bytes for f in zmqio.recv_frames(dealer)] == [b"reply"]
    assert not zmqio.readable(dealer)


def test_nothing_waiting_raises_again(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, _ = pair
    assert not zmqio.readable(router)
    with pytest.raises(zmq.Again):
        zmqio.recv_frames(router)
    assert zmqio.try_recv(router) is None


def test_try_recv_takes_whole_messages_then_none_also_once_closed(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{tmp_path}/t.sock")
        dealer.connect(f"ipc://{tmp_path}/t.sock")
        for i in range(3):
            zmqio.send_frames(dealer, [b"m%d" % i, b"x"], copy=True)
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            frames = zmqio.try_recv(router)
            if frames is not None:
                got.append([f.bytes for f in frames[1:]])
        assert got == [[b"m0", b"x"], [b"m1", b"x"], [b"m2", b"x"]]
        router.close(0)
        assert zmqio.try_recv(router) is None  # a closed socket reads as nothing waiting
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_full_queue_raises_again_instead_of_blocking(tmp_path: Path) -> None:
    """Nobody at the other end: messages queue up to the high-water mark, then Again."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 10)
    dealer.connect(f"ipc://{tmp_path}/nobody.sock")
    try:
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(1000):
                zmqio.send_frames(dealer, [b"a", b"b"], copy=True)
                sent += 1
        assert 1 <= sent <= 20
    finally:
        dealer.close(0)
        ctx.term()
