"""Test harness: daemons (in-process or as a process) and worker processes that always stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.client import SidecarClient
from kvsidecar.daemon.config import SETTINGS, Config
from kvsidecar.daemon.server import Daemon
from kvsidecar.wire.errors import SidecarError

ROOT = Path(__file__).resolve().parent.parent


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


@contextlib.asynccontextmanager
async def run_daemon(config: Config) -> AsyncIterator[Daemon]:
    """Serve ``config`` in this event loop; always shut down and remove the runtime dir."""
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.serve())
    started = asyncio.create_task(daemon.started.wait())
    try:
        done, _ = await asyncio.wait(
            {task, started}, timeout=10, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            task.result()  # re-raise the startup failure
        if started not in done:
            raise TimeoutError("daemon did not start within 10 s")
        yield daemon
    finally:
        started.cancel()
        daemon.request_exit()
        try:
            await asyncio.wait_for(task, 15)
        finally:
            shutil.rmtree(config.runtime_dir, ignore_errors=True)


def config_env(config: Config) -> dict[str, str]:
    """The environment that gives a daemon process exactly ``config``."""
    env = dict(os.environ)
    for s in SETTINGS:
        env[s.env_var] = str(getattr(config, s.name))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class DaemonProcess:
    """A ``python -m kvsidecar.daemon`` child with its config and log file."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log_path = Path(config.runtime_dir) / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar.daemon"],
            env=config_env(config),
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
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
def daemon_process(config: Config | None = None) -> Iterator[DaemonProcess]:
    """A daemon process serving ``config``; stopped and its runtime dir removed at exit."""
    config = config or make_config()
    daemon = DaemonProcess(config)
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


class LineChild:
    """A ``tests.helpers.<module>`` child process, driven by text lines on stdin and stdout.

    The one place that starts such helpers and stops them: asked to exit with `exit_line`,
    killed if it does not within the timeout, its pipes always closed.
    """

    exit_line = "exit"

    def __init__(
        self,
        module: str,
        spec: dict[str, Any],
        *,
        name: str = "",
        python: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stderr: Any = None,
    ) -> None:
        """``python``: another interpreter (its own venv); ``env``: added variables. With
        ``python`` the child leads a process group of its own, and `stop` ends the whole group
        (such children start processes of their own: vLLM does)."""
        self.spec = spec
        self.name = name or module
        self._group = python is not None
        self.proc = subprocess.Popen(
            [str(python or sys.executable), "-m", f"tests.helpers.{module}", json.dumps(spec)],
            cwd=ROOT,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=self._group,
        )

    def line(self, timeout: float = 30.0) -> str:
        """The child's next output line (stripped); TimeoutError if it stays silent."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.name} silent for {timeout} s")
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait(5)}")
        return out.strip()

    def send_line(self, text: str) -> None:
        """Write one command line to the child."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def ask_exit(self) -> None:
        """Ask the child to exit without waiting (a child already gone is fine)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send_line(self.exit_line)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask it to exit, kill it if it does not in ``timeout`` s, close the pipes."""
        self._end_process(timeout)
        self._close_pipes()

    def _end_process(self, timeout: float) -> None:
        self.ask_exit()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self._group:  # what it started and left behind
            self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (a child started with ``python``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


class WorkerProcess(LineChild):
    """A ``tests.helpers.kv_worker`` child: registers KV caches, dumps them on request."""

    def __init__(self, spec: dict[str, Any], module: str = "kv_worker") -> None:
        super().__init__(module, spec, name=f"worker {spec.get('engine', module)}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        # Generous: ten processes importing torch at once on two busy cores take a while.
        assert self.line(timeout) == "ready"

    def dump(self, directory: Path, timeout: float = 30.0) -> list[np.ndarray]:
        """Each layer's logical (2, B, N, H, C) values as they are now."""
        self._ask_dump(directory, timeout)
        return [np.load(directory / f"layer{i}.npy") for i in range(self.spec["layers"])]

    def _ask_dump(self, directory: Path, timeout: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.send_line(f"dump {directory}")
        assert self.line(timeout) == "ok"


@contextlib.contextmanager
def workers(specs: list[dict[str, Any]]) -> Iterator[list[WorkerProcess]]:
    """Start every worker at once (separate processes), wait until all registered, stop all."""
    procs = [WorkerProcess(s) for s in specs]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        # Ask all to exit first, then wait: stopping them one by one costs a second each.
        for p in procs:
            p.ask_exit()
        for p in procs:
            p.stop()


def scrape(port: int, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Read a daemon's /metrics: ``{(sample name, sorted labels): value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
