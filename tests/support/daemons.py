"""Daemons for tests: in this event loop (`run_daemon`) or as processes (`daemon_process`, and
`daemon_processes` behind the ``daemon_factory`` fixtures of tests/conftest.py).

Both always stop the daemon and remove its runtime dir. Both take a `Config`, or a function that
makes one (`ConfigSource`): a function is called again, for fresh ports, when the daemon could not
bind a TCP port because someone took it between `tests.support.ports.reserve_port` and the bind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.server import Daemon
from kvsidecar.node.config import Config
from kvsidecar.node.settings import SETTINGS
from kvsidecar.wire.errors import SidecarError
from tests.support import ROOT, python_env
from tests.support.ports import is_port_clash, port_taken, reserve_port

ConfigSource = Config | Callable[[], Config]
"""A config, or a function that makes one with fresh ports (called again after a port clash)."""

START_ATTEMPTS = 4
"""Starts tried, each with a fresh config, before a port clash counts as a failure."""
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 15.0


def make_config(**overrides: Any) -> Config:
    """A config in a fresh short temp dir (Unix socket paths must stay < 108 bytes)."""
    runtime = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    values: dict[str, Any] = {
        "runtime_dir": runtime,
        "host_pool_bytes": 64 << 20,
        "lease_s": 2.0,
        "drain_timeout_s": 3.0,
        "fd_wait_s": 2.0,
        # Ephemeral: daemons of concurrent test runs must not fight over the default 9464.
        "metrics_port": 0,
    }
    values.update(overrides)
    return Config(**values)


def open_to_every_uid(config: Config) -> None:
    """Let every uid reach a started daemon's sockets through the filesystem.

    The runtime directory (0700) and the sockets are the first layer of access control; tests
    of the layers behind it (allowed uids, limits and quotas per user) remove it on purpose.
    """
    os.chmod(config.runtime_dir, 0o711)
    os.chmod(config.ipc_path or "", 0o666)
    os.chmod(config.fd_socket, 0o666)


def config_env(config: Config) -> dict[str, str]:
    """The environment that gives a daemon process exactly ``config`` (UCX kept on loopback)."""
    env = python_env()
    for s in SETTINGS:
        env[s.env_var] = str(getattr(config, s.name))
    env.setdefault("UCX_NET_DEVICES", "lo")
    return env


def tcp_ports(config: Config) -> list[int]:
    """The fixed TCP ports ``config`` makes a daemon bind: control and peer endpoints, metrics."""
    ports = [
        urlsplit(endpoint).port or 0
        for endpoint in (config.endpoint, config.peer_endpoint)
        if endpoint.startswith("tcp://")
    ]
    ports.append(config.metrics_port)
    return [p for p in ports if p > 0]


def _attempts(source: ConfigSource) -> Iterator[tuple[Config, AbstractContextManager[None]]]:
    """The configs to start with, each with a guard that lets a port clash through to the next
    try (a fixed `Config` gets one try, a function `START_ATTEMPTS`)."""
    tries = 1 if isinstance(source, Config) else START_ATTEMPTS
    for n in range(tries):
        config = source if isinstance(source, Config) else source()
        yield config, _clash_retried(config, last=n == tries - 1)


@contextlib.contextmanager
def _clash_retried(config: Config, *, last: bool) -> Iterator[None]:
    """Swallow a start's failure when one of its ports was taken, unless it is the last try."""
    try:
        yield
    except Exception as exc:
        # The failed daemon is stopped by now: a port still taken is someone else's.
        clashed = is_port_clash(exc) or any(port_taken(p) for p in tcp_ports(config))
        if last or not clashed:
            raise


# --------------------------------------------------------------------------------------------
# In this event loop


@contextlib.asynccontextmanager
async def run_daemon(source: ConfigSource) -> AsyncIterator[Daemon]:
    """Serve a daemon in this event loop; always shut it down and remove its runtime dir."""
    for config, clash_retried in _attempts(source):
        with clash_retried:
            daemon, task = await _start_in_loop(config)
            break
    try:
        yield daemon
    finally:
        daemon.request_exit()
        try:
            await asyncio.wait_for(task, STOP_TIMEOUT_S)
        finally:
            shutil.rmtree(daemon.config.runtime_dir, ignore_errors=True)


async def _start_in_loop(config: Config) -> tuple[Daemon, asyncio.Task[None]]:
    """Start serving; on failure stop it again and raise what `Daemon.serve` raised."""
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.serve())
    started = asyncio.create_task(daemon.started.wait())
    done, _ = await asyncio.wait(
        {task, started}, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    started.cancel()
    if started in done and not task.done():
        return daemon, task
    daemon.request_exit()
    await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
    shutil.rmtree(config.runtime_dir, ignore_errors=True)
    if task.done():
        task.result()  # the startup failure (a port clash among them)
        raise RuntimeError("daemon stopped before it started")
    raise TimeoutError(f"daemon did not start within {START_TIMEOUT_S:.0f} s")


# --------------------------------------------------------------------------------------------
# As a process


class DaemonProcess:
    """A ``python -m kvsidecar.daemon`` child with its config and log file.

    ``run_as``: a uid (and gid) the child takes before it starts, as a container's runAsUser
    would, via ``setpriv``; the log then goes to ``log_path`` (default: in the runtime dir, which
    must then not be the daemon's to create).
    """

    def __init__(
        self,
        config: Config,
        env: dict[str, str] | None = None,
        *,
        run_as: int | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path or Path(config.runtime_dir) / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "kvsidecar.daemon"]
        if run_as is not None:
            ids = [f"--reuid={run_as}", f"--regid={run_as}", "--clear-groups"]
            argv = ["setpriv", *ids, *argv]
        self.proc = subprocess.Popen(
            argv,
            env={**config_env(config), **(env or {})},
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once it answers a hello; RuntimeError if it exits, TimeoutError if it is mute."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                SidecarClient(self.config.endpoint, timeout_s=0.5, heartbeat=False).close()
                return
            except SidecarError:
                time.sleep(0.05)
        raise TimeoutError(f"daemon not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """Everything it logged so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def daemon_process(
    source: ConfigSource | None = None, env: dict[str, str] | None = None
) -> Iterator[DaemonProcess]:
    """A ready daemon process (default: `make_config()`; ``env``: extra variables); stopped,
    its runtime dir removed."""
    for config, clash_retried in _attempts(source or make_config):
        with clash_retried:
            daemon = _start_process(config, env)
            break
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(daemon.config.runtime_dir, ignore_errors=True)


StartDaemon = Callable[..., DaemonProcess]
"""``start(**overrides)``: a ready daemon process of `make_config` with ``overrides``."""


@contextlib.contextmanager
def daemon_processes() -> Iterator[StartDaemon]:
    """Start daemon processes on demand (fresh ports on each try); all are stopped on exit."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> DaemonProcess:
            return stack.enter_context(daemon_process(lambda: make_config(**overrides)))

        yield start


def _start_process(config: Config, env: dict[str, str] | None = None) -> DaemonProcess:
    """A ready daemon process; on failure it is stopped and its runtime dir removed."""
    daemon = DaemonProcess(config, env)
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
        raise
    return daemon


# --------------------------------------------------------------------------------------------
# Peer daemons (node-to-node pulls)

_CLUSTER_KEY: list[str] = []


def cluster_key() -> str:
    """One CurveZMQ key pair for every test daemon (the cluster-key deployment)."""
    if not _CLUSTER_KEY:
        import atexit

        from kvsidecar.wire.curve import keygen

        keys = tempfile.mkdtemp(prefix="kvs-keys-")
        atexit.register(shutil.rmtree, keys, ignore_errors=True)
        _, secret = keygen(keys, "cluster")
        _CLUSTER_KEY.append(str(secret))
    return _CLUSTER_KEY[0]


def peer_config(**overrides: Any) -> Config:
    """A daemon config with a loopback peer endpoint (CURVE, cluster key) and short bounds."""
    values: dict[str, Any] = {
        "peer_endpoint": f"tcp://127.0.0.1:{reserve_port()}",
        "curve_secret_key": cluster_key(),
        "peer_data_plane": "zmq",
        "peer_pull_timeout_s": 10.0,
        "peer_handshake_timeout_s": 2.0,
        "host_pool_bytes": 0,
        "lease_s": 5.0,
    }
    values.update(overrides)
    return make_config(**values)


def peer_daemon(**overrides: Any) -> contextlib.AbstractContextManager[DaemonProcess]:
    """A daemon process with `peer_config` (fresh ports on each try)."""
    return daemon_process(lambda: peer_config(**overrides))
