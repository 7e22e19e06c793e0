"""Processes a benchmark runs beside itself: a daemon, and a raw ZeroMQ echo server.

Every child gets SIGTERM when the benchmark dies (Linux ``PR_SET_PDEATHSIG``) and is stopped,
killed if need be, when its context manager exits, so an interrupted benchmark leaves nothing
running. The echo server is this module run as ``python -m kvsidecar.bench.procs echo ENDPOINT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kvsidecar

T = TypeVar("T")

_PACKAGE_PARENT = str(Path(kvsidecar.__file__).resolve().parent.parent)


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the parent dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return this environment with this very kvsidecar importable (checkout or installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    env["PYTHONPATH"] = _PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    # NIXL's UCX otherwise spreads over every interface; a same-host benchmark needs loopback.
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.update(extra or {})
    return env


def stop(proc: subprocess.Popen[Any], grace_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def daemon(
    *,
    host_pool_bytes: int = 0,
    peer_data_plane: str = "zmq",
    checkout: str | None = None,
    **settings: Any,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``kvsidecar serve`` in its own process and runtime dir; yields (control endpoint, process).

    ``settings`` become ``--flag value`` (``peer_endpoint="tcp://..."`` -> ``--peer-endpoint``;
    booleans ``--flag`` / ``--no-flag``).
    ``checkout``: serve the kvsidecar of that source tree instead of this process's own (an
    A/B of two commits, `benchmarks/ab_blocking_move.py`).
    The daemon's log is printed on stderr if it exits with an error.
    """
    runtime = tempfile.mkdtemp(prefix="kvsb-", dir="/tmp")  # short: ipc paths have a limit
    endpoint = f"ipc://{runtime}/control.sock"
    flags = {
        "runtime_dir": runtime,
        "host_pool_bytes": host_pool_bytes,
        "lease_s": 30,
        "log_level": "warning",
        "metrics_port": -1,
        "peer_data_plane": peer_data_plane,
        **settings,
    }
    argv = [sys.executable, "-m", "kvsidecar.cli", "serve"]
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):  # BooleanOptionalAction flags take no value
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    log_path = Path(runtime) / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            # ``-m`` puts the working directory first on the path: the runtime dir shadows no tree.
            env=child_env(
                None if checkout is None else {"PYTHONPATH": str(Path(checkout).resolve())}
            ),
            cwd=None if checkout is None else runtime,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl, safe before exec
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(endpoint, proc)
        yield endpoint, proc
    finally:
        stop(proc)
        if proc.returncode not in (0, None):
            print(f"daemon exited {proc.returncode}; log:", file=sys.stderr)
            print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        shutil.rmtree(runtime, ignore_errors=True)


def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    from kvsidecar.client import SidecarClient
    from kvsidecar.wire.errors import SidecarError

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode} before it was ready")
        try:
            SidecarClient(endpoint, timeout_s=0.5, heartbeat=False).close()
            return
        except SidecarError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon not ready in {timeout_s:.0f} s") from None


@contextlib.contextmanager
def echo_server(endpoint: str, *, blocking: bool = False) -> Iterator[int]:
    """Run a raw ROUTER echo in its own process: the latency baseline; yields its pid.

    zmq.asyncio on uvloop (the daemon's own pattern), or with ``blocking`` a plain blocking
    pyzmq receive/send loop (the fastest a Python server answers; the blocking client's match).
    """
    mode = "echo-blocking" if blocking else "echo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar.bench.procs", mode, endpoint],
        env=child_env(),
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl, safe before exec
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("echo server did not start")
        yield proc.pid
    finally:
        stop(proc, 10)


async def _echo(endpoint: str) -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    # Exactly what the daemon's socket edge does, minus decoding and work.
    while True:
        frames = await sock.recv_multipart(copy=False)
        await sock.send_multipart(frames, copy=False)


def pin(pid: int, cpus: set[int]) -> None:
    """Restrict every thread of process ``pid`` to ``cpus`` (threads it starts later inherit).

    ``sched_setaffinity`` of a pid applies to that one thread, so each task of the process is
    set; a thread that ended meanwhile is skipped.
    """
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


def run_echo_server(endpoint: str, *, blocking: bool = False) -> None:
    """Serve echoes until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if not blocking:
        run_async(_echo(endpoint))
        return
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop, as the daemon does (plain asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def idle_cpu(pid: int, seconds: float) -> float:
    """Fraction of one core a process uses over ``seconds`` (from /proc; NaN elsewhere)."""

    def ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    try:
        before = ticks()
        time.sleep(seconds)
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds
    except OSError:
        return float("nan")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("echo", "echo-blocking"):
        run_echo_server(sys.argv[2], blocking=sys.argv[1] == "echo-blocking")
    else:
        sys.exit("usage: python -m kvsidecar.bench.procs echo|echo-blocking ENDPOINT")
