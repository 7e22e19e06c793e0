"""The notify protocol against a real NOTIFY_SOCKET: these tests play systemd's side.

A bound AF_UNIX datagram socket stands in for the service manager. A thread reads it, so the
receiver keeps running while the event loop under test is deliberately blocked. Timing questions
("no ping while the loop was blocked") are asked with marks: datagrams the test sends to the same
socket itself. One socket queues datagrams in the order they were sent, so what arrived between
two marks was sent between them, however late the receiving thread got to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.daemon.sdnotify import Notifier, watchdog_loop

pytestmark = pytest.mark.timeout(20)


class FakeSystemd:
    """The service manager's end of NOTIFY_SOCKET: records the payloads in arrival order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.address = "\0" + name[1:] if name.startswith("@") else name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.sock.settimeout(0.05)
        self.received: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.received.append(data.decode())

    def messages(self) -> list[str]:
        return list(self.received)

    def wait_for(self, count: int, timeout: float = 2.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.messages()

    def mark(self, label: str, timeout: float = 5.0) -> None:
        """Send ``MARK=<label>`` to the socket and wait until the receiver has read it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(f"MARK={label}".encode(), self.address)
        deadline = time.monotonic() + timeout
        while f"MARK={label}" not in self.messages():
            assert time.monotonic() < deadline, f"mark {label} not received in {timeout} s"
            time.sleep(0.005)

    def between(self, first: str, last: str) -> list[str]:
        """What arrived after mark ``first`` and before mark ``last``."""
        messages = self.messages()
        return messages[messages.index(f"MARK={first}") + 1 : messages.index(f"MARK={last}")]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def systemd_path() -> Iterator[FakeSystemd]:
    # mkdtemp under /tmp: pytest's tmp_path can exceed the 108-byte limit of sun_path.
    directory = tempfile.mkdtemp(prefix="kvs-notify-", dir="/tmp")
    fake = FakeSystemd(os.path.join(directory, "notify"))
    try:
        yield fake
    finally:
        fake.close()
        with contextlib.suppress(OSError):
            os.unlink(fake.name)
        os.rmdir(directory)


@pytest.fixture
def systemd_abstract() -> Iterator[FakeSystemd]:
    fake = FakeSystemd(f"@kvsidecar-test-{uuid.uuid4().hex}")
    try:
        yield fake
    finally:
        fake.close()


def test_lifecycle_messages_arrive(systemd_path: FakeSystemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": systemd_path.name})
    assert notifier.enabled
    assert notifier.ready()
    assert notifier.status("serving 2 engines")
    assert notifier.watchdog()
    assert notifier.stopping("draining\n3 moves")
    messages = systemd_path.wait_for(4)
    assert messages == [
        "READY=1",
        "STATUS=serving 2 engines",
        "WATCHDOG=1",
        # A newline would start a new assignment: the status is kept on one line.
        "STOPPING=1\nSTATUS=draining 3 moves",
    ]
    notifier.close()


def test_abstract_namespace_socket(systemd_abstract: FakeSystemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": systemd_abstract.name})
    assert notifier.ready("up")
    assert notifier.extend_timeout(1.5)
    assert systemd_abstract.wait_for(2) == ["READY=1\nSTATUS=up", "EXTEND_TIMEOUT_USEC=1500000"]
    notifier.close()


def test_no_notify_socket_is_a_noop() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.stopping()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    # No socket, so no watchdog either, even if systemd set WATCHDOG_USEC.
    assert Notifier.from_env({"WATCHDOG_USEC": "1000000"}).watchdog_interval() is None


def test_unsupported_or_missing_socket_does_not_raise(tmp_path: Path) -> None:
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    gone = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert gone.enabled
    assert not gone.ready()  # ENOENT: logged, not raised


def test_unset_environment(monkeypatch: pytest.MonkeyPatch, systemd_path: FakeSystemd) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", systemd_path.name)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_env(unset_environment=True)
    assert notifier.watchdog_interval() == 1.0
    assert "NOTIFY_SOCKET" not in os.environ
    assert "WATCHDOG_USEC" not in os.environ
    assert "WATCHDOG_PID" not in os.environ


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "3000000"}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "{pid}"}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "junk"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(
    systemd_path: FakeSystemd, env: dict[str, str], expected: float | None
) -> None:
    env = {k: v.format(pid=os.getpid()) for k, v in env.items()}
    notifier = Notifier.from_env({"NOTIFY_SOCKET": systemd_path.name, **env})
    assert notifier.watchdog_interval() == expected


async def test_watchdog_pings_at_cadence_and_stop_when_loop_blocks(
    systemd_path: FakeSystemd,
) -> None:
    interval = 0.05
    notifier = Notifier.from_env({"NOTIFY_SOCKET": systemd_path.name})
    task = asyncio.create_task(watchdog_loop(notifier, interval))
    try:
        systemd_path.mark("steady")
        await asyncio.sleep(0.5)
        systemd_path.mark("block")
        # Stall the event loop the way a copy run on it by mistake would: no ping can be sent.
        time.sleep(0.5)
        systemd_path.mark("unblock")
        # ... and the pings come back once the loop runs again (a generous bound: a busy box).
        deadline = time.monotonic() + 5
        while "WATCHDOG=1" not in systemd_path.messages()[-1:] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        notifier.close()

    steady = systemd_path.between("steady", "block")
    # About 10 in 0.5 s. A loaded machine may send fewer (liveness: a few), never many more.
    assert 2 <= steady.count("WATCHDOG=1") <= 12, steady
    assert systemd_path.between("block", "unblock") == []
    assert systemd_path.messages()[-1] == "WATCHDOG=1", systemd_path.messages()[-5:]


async def test_watchdog_withholds_pings_while_unhealthy(systemd_path: FakeSystemd) -> None:
    state = "ok"

    def check() -> bool:
        if state == "raise":
            raise RuntimeError("executor state unknown")
        return state == "ok"

    notifier = Notifier.from_env({"NOTIFY_SOCKET": systemd_path.name})
    task = asyncio.create_task(watchdog_loop(notifier, 0.02, healthy=check))
    try:
        systemd_path.mark("healthy")
        deadline = time.monotonic() + 5
        while systemd_path.messages().count("WATCHDOG=1") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # Set on the loop's own thread: from here on no tick of the loop sends a ping.
        state = "failing"
        systemd_path.mark("failing")
        await asyncio.sleep(0.2)  # ten intervals
        state = "raise"
        systemd_path.mark("raising")
        await asyncio.sleep(0.2)
        systemd_path.mark("end")
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        notifier.close()
    assert systemd_path.between("healthy", "failing").count("WATCHDOG=1") >= 2
    assert systemd_path.between("failing", "raising") == []
    assert systemd_path.between("raising", "end") == []


async def test_watchdog_loop_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        await watchdog_loop(Notifier(None), 0)
