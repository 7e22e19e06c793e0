"""Probe: CPU per request, thread by thread, of the daemon and of a blocking echo server.

A raw blocking DEALER (no client library) sends the frames of a 1-block, 1-layer move request,
first to the blocking pyzmq echo server of ``bench latency`` (`kvsidecar.bench.procs`), then to
a daemon (engines A and B registered by this process), ``--requests`` round trips each, for
``--rounds`` rounds. For each it prints the wall time per round trip and, per thread name of the
server process, the CPU time and the voluntary context switches per request, read from
``/proc/PID/task/*/schedstat`` and ``status`` before and after. Threads that did no work are left
out. It prints both servers' pids first, for a profiler (``perf record -g -t PID``: the daemon's
pid is its event loop's thread). docs/benchmarks.md (rounds 8 and 9) compares the daemon's event
loop with the echo's thread.

    .venv/bin/python benchmarks/probe_loop_cpu.py [--requests 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench import procs
from kvsidecar.bench.common import Options
from kvsidecar.bench.local import engines
from kvsidecar.client import SidecarClient


def thread_usage(pid: int) -> dict[str, tuple[int, int]]:
    """CPU nanoseconds and voluntary context switches of ``pid``'s threads, summed by name."""
    out: dict[str, tuple[int, int]] = collections.defaultdict(lambda: (0, 0))
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        cpu, vol = out[name]
        out[name] = (cpu + ns, vol + switches)
    return out


def measure(sock: zmq.Socket[Any], frames: list[bytes], pid: int, n: int) -> str:
    """Time ``n`` round trips of ``frames`` on ``sock``; one line of per-request figures."""
    for _ in range(200):  # settle in
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)
    before = thread_usage(pid)
    start = time.perf_counter()
    for _ in range(n):
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)
    wall = (time.perf_counter() - start) / n * 1e6
    after = thread_usage(pid)
    cells = []
    total = 0.0
    for name in sorted(after):
        cpu0, vol0 = before.get(name, (0, 0))
        cpu = (after[name][0] - cpu0) / n / 1e3
        if cpu < 0.1:
            continue
        total += cpu
        cells.append(f"{name} {cpu:.1f} us ({(after[name][1] - vol0) / n:.2f} sw)")
    return f"wall {wall:6.1f} us | cpu {total:5.1f} us: " + ", ".join(cells)


def main() -> None:
    """Start the echo server and a daemon, measure both in turns, print a line per round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kvsl-", dir="/tmp")
    echo_ep = f"ipc://{runtime}/echo.sock"
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with (
            procs.echo_server(echo_ep, blocking=True) as echo_pid,
            procs.daemon() as (endpoint, daemon),
            engines(endpoint, Options(), num_blocks=64) as eng,
        ):
            with SidecarClient(endpoint, timeout_s=10, name="probe", heartbeat=False) as client:
                one = np.array([3], dtype="<i4")
                call = client._requests.move(eng.a_dev, eng.b_dev, one, one, ["layer0"])
                frames = [
                    client._session.codec.encoder.encode(call.req),
                    *(bytes(d) for d in call.data),
                ]
            print(f"pids: echo {echo_pid}, daemon {daemon.pid}", flush=True)
            socks = []
            for ep in (echo_ep, endpoint):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(ep)
                socks.append(sock)
            for r in range(args.rounds):
                for name, sock, pid in (
                    ("echo", socks[0], echo_pid),
                    ("daemon", socks[1], daemon.pid),
                ):
                    print(f"{r} {name:6s} {measure(sock, frames, pid, args.requests)}", flush=True)
            for sock in socks:
                sock.close(linger=0)
    finally:
        ctx.term()
        Path(runtime, "echo.sock").unlink(missing_ok=True)
        Path(runtime).rmdir()


if __name__ == "__main__":
    main()
