"""Probe: a blocking client's 1-block move and a blocking echo, by where the threads run.

On a small VM the round trip of the same call changes with the CPUs the scheduler gives the
client, the server and their libzmq I/O threads: unpinned, batches of 100 blocking 1-block moves
can switch between a fast and a slow mode. This probe times batches of the daemon's blocking
move (1 layer) and of a raw blocking echo of the same frames, in turns, four ways:

- ``free``: nothing pinned (the scheduler decides);
- ``servers``: the daemon and the echo server on the first CPU, this client anywhere (what an
  operator can do for the daemon alone: systemd ``CPUAffinity=``, a Kubernetes CPU set);
- ``split``: the daemon and the echo server on the first CPU, this client on the second
  (``kvsidecar bench latency --pin``);
- ``same``: all of them on the first CPU.

For each it prints the median of the batches' p50s, their ratio and the batches themselves.

    .venv/bin/python benchmarks/probes/probe_placement.py [--batches 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvsidecar.bench import procs
from kvsidecar.bench.common import Options
from kvsidecar.bench.local import engines
from kvsidecar.client import SidecarClient


def p50(fn: Callable[[], object], n: int = 100) -> float:
    """The median round trip of ``n`` calls of ``fn``, in µs."""
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def main() -> None:
    """Start a daemon and a blocking echo server, time the four placements, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("probe_placement needs two CPUs")
    runtime = tempfile.mkdtemp(prefix="kvsp-", dir="/tmp")
    echo_ep = f"ipc://{runtime}/echo.sock"
    try:
        with (
            procs.echo_server(echo_ep, blocking=True) as echo_pid,
            procs.daemon() as (endpoint, daemon),
            engines(endpoint, Options(), num_blocks=64) as eng,
        ):
            client = SidecarClient(endpoint, timeout_s=10, name="probe", heartbeat=False)
            ctx: zmq.Context[Any] = zmq.Context()
            echo = ctx.socket(zmq.DEALER)
            echo.setsockopt(zmq.LINGER, 0)
            echo.connect(echo_ep)
            one = np.array([3], dtype="<i4")
            call = client._requests.move(eng.a_dev, eng.b_dev, one, one, ["layer0"])
            frames = [
                client._session.codec.encoder.encode(call.req),
                *(bytes(d) for d in call.data),
            ]

            def move() -> None:
                client.move(eng.a_dev, eng.b_dev, one, one, layers=["layer0"])

            def echo_once() -> None:
                echo.send_multipart(frames, copy=False)
                echo.recv_multipart(copy=False)

            placements = {
                "free": (set(cpus), set(cpus)),
                "servers": ({cpus[0]}, set(cpus)),
                "split": ({cpus[0]}, {cpus[1]}),
                "same": ({cpus[0]}, {cpus[0]}),
            }
            print("| placement | move p50 µs | echo p50 µs | ratio | move batches |")
            print("| --- | ---: | ---: | ---: | --- |")
            try:
                for name, (servers, me) in placements.items():
                    for pid in (echo_pid, daemon.pid):
                        procs.pin(pid, servers)
                    procs.pin(os.getpid(), me)
                    for _ in range(300):  # settle in
                        move()
                        echo_once()
                    moves, echoes = [], []
                    for _ in range(args.batches):
                        moves.append(p50(move))
                        echoes.append(p50(echo_once))
                    m, e = statistics.median(moves), statistics.median(echoes)
                    batches = " ".join(f"{x:.0f}" for x in moves)
                    print(f"| {name} | {m:.0f} | {e:.0f} | {m / e:.2f} | {batches} |")
            finally:
                procs.pin(os.getpid(), set(cpus))
                client.close()
                echo.close(linger=0)
                ctx.term()
    finally:
        Path(runtime, "echo.sock").unlink(missing_ok=True)
        Path(runtime).rmdir()


if __name__ == "__main__":
    main()
