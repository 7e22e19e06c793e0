"""Probe: a blocking client's 1-block move after the daemon sat idle, against a blocking echo.

``bench latency`` runs its methods in turns, so the daemon sits idle for the length of the other
methods' batches before each batch of blocking moves. This probe times batches of 100 blocking
1-block moves (1 layer) and of 100 raw blocking echoes of the same frames, three ways:

- ``steady``: batch after batch against the same server, no pause;
- ``idle``: each batch after a 12 ms pause (a batch of another method in ``bench latency``);
- ``turns``: a batch of moves, then a batch of echoes, in turns (as ``bench latency`` does).

For each it prints the median of the batches' p50s and the moves' ratio to the echo.

    .venv/bin/python benchmarks/probe_idle_gaps.py [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench import procs
from kvsidecar.bench.common import Options
from kvsidecar.bench.local import engines
from kvsidecar.client import SidecarClient

PAUSE_S = 0.012


def p50(fn: Callable[[], object], n: int = 100) -> float:
    """The median round trip of ``n`` calls of ``fn``, in µs."""
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def main() -> None:
    """Start a daemon and a blocking echo server, time the three patterns, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kvsp-", dir="/tmp")
    echo_ep = f"ipc://{runtime}/echo.sock"
    try:
        with (
            procs.echo_server(echo_ep, blocking=True),
            procs.daemon() as (endpoint, _),
            engines(endpoint, Options(), num_blocks=64) as eng,
        ):
            client = SidecarClient(endpoint, timeout_s=10, name="probe", heartbeat=False)
            ctx: zmq.Context[Any] = zmq.Context()
            echo = ctx.socket(zmq.DEALER)
            echo.setsockopt(zmq.LINGER, 0)
            echo.connect(echo_ep)
            one = np.array([3], dtype="<i4")
            call = client._move(eng.a_dev, eng.b_dev, one, one, ["layer0"])
            frames = [client._codec.encoder.encode(call.req), *(bytes(d) for d in call.data)]

            def move() -> None:
                client.move(eng.a_dev, eng.b_dev, one, one, layers=["layer0"])

            def echo_once() -> None:
                echo.send_multipart(frames, copy=False)
                echo.recv_multipart(copy=False)

            for _ in range(300):  # warm-up
                move()
                echo_once()
            try:
                _report(move, echo_once, args.batches)
            finally:
                client.close()
                echo.close(linger=0)
                ctx.term()
    finally:
        Path(runtime, "echo.sock").unlink(missing_ok=True)
        Path(runtime).rmdir()


def _report(move: Callable[[], None], echo: Callable[[], None], batches: int) -> None:
    def paused(fn: Callable[[], None]) -> float:
        time.sleep(PAUSE_S)
        return p50(fn)

    steady = ([p50(move) for _ in range(batches)], [p50(echo) for _ in range(batches)])
    idle = ([paused(move) for _ in range(batches)], [paused(echo) for _ in range(batches)])
    turns: tuple[list[float], list[float]] = ([], [])
    for _ in range(batches):
        turns[0].append(p50(move))
        turns[1].append(p50(echo))
    print("| pattern | move p50 µs (min-max) | echo p50 µs | ratio |")
    print("| --- | --- | ---: | ---: |")
    for name, (moves, echoes) in (("steady", steady), ("idle", idle), ("turns", turns)):
        m, e = statistics.median(moves), statistics.median(echoes)
        print(f"| {name} | {m:.0f} ({min(moves):.0f}-{max(moves):.0f}) | {e:.0f} | {m / e:.2f} |")


if __name__ == "__main__":
    main()
