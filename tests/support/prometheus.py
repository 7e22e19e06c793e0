"""A real Prometheus server for tests: start it against some targets, query it, always stop it.

Used by the metrics tests and meant for end-to-end tests of a running daemon::

    with start_prometheus(["127.0.0.1:9400"]) as prom:
        prom.wait_for_targets_up()
        assert prom.query_value("sum(kvsidecar_moved_bytes_total)") == 4096

From an async test whose event loop serves the scraped endpoint, never block that loop: use
``async with prometheus_running(...)`` and the ``a*`` methods, which run the blocking parts in a
thread so that scrapes keep being answered.

The binary comes from ``$PROMETHEUS_BIN``, else ``PATH``, else ``/usr/bin/prometheus`` (Debian's
``prometheus`` package, installed by ``scripts/install-system-tools``). Missing, it is an error,
not a skip: the test set-up installs it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support.ports import is_port_clash, reserve_port

__all__ = [
    "Prometheus",
    "find_binary",
    "prometheus_running",
    "start_prometheus",
]


def find_binary(name: str) -> str:
    """Path of a Prometheus tool (``prometheus``, ``promtool``); RuntimeError if it is missing."""
    env = os.environ.get(f"{name.upper()}_BIN")
    for candidate in (env, shutil.which(name), f"/usr/bin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        f"{name} not found (set ${name.upper()}_BIN or run scripts/install-system-tools, "
        "which installs Debian's prometheus package)"
    )


_live: set[subprocess.Popen[bytes]] = set()
"""Processes not yet stopped: killed at interpreter exit should a test be torn down abruptly."""


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        process.kill()


class Prometheus:
    """A Prometheus process scraping fixed targets; see `start_prometheus`."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        workdir: Path,
        job: str = "kvsidecar",
        scrape_interval_s: float = 1.0,
        metrics_path: str = "/metrics",
    ) -> None:
        self.targets = list(targets)
        self.job = job
        self.workdir = workdir
        self.scrape_interval_s = scrape_interval_s
        self.metrics_path = metrics_path
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        """Base URL of Prometheus's HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    # ---- process ---------------------------------------------------------------------------

    def start(self, *, timeout_s: float = 30.0, attempts: int = 3) -> None:
        """Start the process and wait until it reports ready; retried on a port race."""
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        config = {  # JSON is YAML: no quoting surprises in target strings
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "metrics_path": self.metrics_path,
                    "static_configs": [{"targets": self.targets}],
                }
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=2))
        binary = find_binary("prometheus")
        last_error = ""
        for _ in range(attempts):
            self.port = reserve_port()
            storage = Path(tempfile.mkdtemp(prefix="tsdb-", dir=self.workdir))
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config_path}",
                        f"--storage.tsdb.path={storage}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            _live.add(self.process)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    last_error = f"prometheus exited with {self.process.returncode}"
                    break
                if self._ready():
                    return
                time.sleep(0.05)
            else:
                last_error = f"prometheus not ready within {timeout_s}s"
            self.stop()
            if not is_port_clash(self._log_tail()):
                break
        raise RuntimeError(f"{last_error}; log tail:\n{self._log_tail()}")

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop the process: SIGTERM, then SIGKILL after ``timeout_s``. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
        _live.discard(process)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    # ---- API ---------------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``; RuntimeError unless status is success."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5.0) as response:
            payload = json.load(response)
        if payload.get("status") != "success":
            raise RuntimeError(f"prometheus API {path} failed: {payload}")
        return payload["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (a scalar comes back as one unlabelled sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_value(self, expr: str) -> float | None:
        """Value of an instant query that yields at most one sample; None when it yields none."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise RuntimeError(f"{expr!r} returned {len(result)} samples, expected one")
        return float(result[0]["value"][1])

    def targets_up(self) -> bool:
        """Whether every target has been scraped successfully at least once."""
        active = self.api("targets", state="active")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait_until(
        self, check: Callable[[], bool], *, timeout_s: float = 20.0, what: str = "condition"
    ) -> None:
        """Poll ``check`` (every 100 ms) until true; TimeoutError with ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus: {what} not reached within {timeout_s}s")
            time.sleep(0.1)

    def wait_for_targets_up(self, *, timeout_s: float = 20.0) -> None:
        """Wait until every target has been scraped successfully."""
        self.wait_until(self.targets_up, timeout_s=timeout_s, what="all targets up")

    def wait_for_value(
        self,
        expr: str,
        predicate: Callable[[float | None], bool],
        *,
        timeout_s: float = 20.0,
    ) -> float | None:
        """Poll ``expr`` until ``predicate(value)`` holds; return that value."""
        last: list[float | None] = [None]

        def check() -> bool:
            last[0] = self.query_value(expr)
            return predicate(last[0])

        try:
            self.wait_until(check, timeout_s=timeout_s, what=f"predicate on {expr!r}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; last value {last[0]!r}") from None
        return last[0]

    # ---- async wrappers: the blocking calls in a thread, so the test's loop keeps serving ----

    async def aquery_value(self, expr: str) -> float | None:
        """`query_value` without blocking the event loop."""
        return await asyncio.to_thread(self.query_value, expr)

    async def await_targets_up(self, *, timeout_s: float = 20.0) -> None:
        """`wait_for_targets_up` without blocking the event loop."""
        await asyncio.to_thread(self.wait_for_targets_up, timeout_s=timeout_s)

    async def await_value(
        self,
        expr: str,
        predicate: Callable[[float | None], bool],
        *,
        timeout_s: float = 20.0,
    ) -> float | None:
        """`wait_for_value` without blocking the event loop."""
        return await asyncio.to_thread(self.wait_for_value, expr, predicate, timeout_s=timeout_s)


@contextlib.contextmanager
def start_prometheus(
    targets: Sequence[str],
    *,
    job: str = "kvsidecar",
    scrape_interval_s: float = 1.0,
    startup_timeout_s: float = 30.0,
) -> Iterator[Prometheus]:
    """Run Prometheus scraping ``targets`` (``host:port``) from a temporary directory; stop it."""
    with tempfile.TemporaryDirectory(prefix="kvsidecar-prom-") as workdir:
        prom = Prometheus(
            targets, workdir=Path(workdir), job=job, scrape_interval_s=scrape_interval_s
        )
        try:
            prom.start(timeout_s=startup_timeout_s)
            yield prom
        finally:
            prom.stop()


@contextlib.asynccontextmanager
async def prometheus_running(
    targets: Sequence[str],
    *,
    job: str = "kvsidecar",
    scrape_interval_s: float = 1.0,
    startup_timeout_s: float = 30.0,
) -> AsyncIterator[Prometheus]:
    """`start_prometheus` for async tests: start and stop run in a thread."""
    stack = contextlib.ExitStack()
    prom = await asyncio.to_thread(
        stack.enter_context,
        start_prometheus(
            targets,
            job=job,
            scrape_interval_s=scrape_interval_s,
            startup_timeout_s=startup_timeout_s,
        ),
    )
    try:
        yield prom
    finally:
        # Shielded: a cancelled test (timeout) must still not leave the process behind.
        await asyncio.shield(asyncio.to_thread(stack.close))


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
