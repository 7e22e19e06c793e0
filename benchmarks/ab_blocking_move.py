"""A/B: the blocking client's 1-block move through two checkouts' daemons, in turns.

A change to the command path moves the round trip by a few percent, less than the spread
between two ``bench latency`` runs on a shared 2-vCPU VM. This runs the daemon of checkout A
and the daemon of checkout B side by side, with the raw blocking echo of ``bench latency``,
and times batches of 100 round trips of each in turns (echo, A, B), so that all three share
the load. It prints each one's median p50 over the rounds, both ratios to the echo, and the
median over rounds of B's p50 over A's (below 1: B is faster).

Run it from a checkout; the client side is that checkout's. Give the same tree twice for an
A/A control: its B/A shows the bias of B's place in the turn (about 0.98-1.0 here).

    git worktree add /tmp/a <commit-a>; git worktree add /tmp/b <commit-b>
    .venv/bin/python benchmarks/ab_blocking_move.py /tmp/a /tmp/b [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.bench import procs
from kvsidecar.bench.common import Options
from kvsidecar.bench.local import engines
from kvsidecar.client import SidecarClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    runtime = tempfile.TemporaryDirectory(prefix="kvsab-echo-", dir="/tmp")  # gone on failure too
    echo_ep = f"ipc://{runtime.name}/echo.sock"
    opts = Options()
    one = np.array([3], dtype="<i4")
    with (
        runtime,
        procs.echo_server(echo_ep, blocking=True),
        procs.daemon(checkout=args.tree_a) as (ep_a, _),
        procs.daemon(checkout=args.tree_b) as (ep_b, _),
        engines(ep_a, opts, num_blocks=64, layers=4) as eng_a,
        engines(ep_b, opts, num_blocks=64, layers=4) as eng_b,
        SidecarClient(ep_a, timeout_s=10, name="ab-a", heartbeat=False) as client_a,
        SidecarClient(ep_b, timeout_s=10, name="ab-b", heartbeat=False) as client_b,
    ):
        # The echo carries the very frames a move request carries (as `bench latency`'s).
        call = client_a._requests.move(eng_a.a_dev, eng_a.b_dev, one, one, ["layer0"])
        frames = [client_a._session.codec.encoder.encode(call.req), *(bytes(d) for d in call.data)]
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(echo_ep)

        def echo() -> None:
            sock.send_multipart(frames, copy=False)
            sock.recv_multipart(copy=False)

        def move_a() -> None:
            client_a.move(eng_a.a_dev, eng_a.b_dev, one, one, layers=["layer0"])

        def move_b() -> None:
            client_b.move(eng_b.a_dev, eng_b.b_dev, one, one, layers=["layer0"])

        methods: dict[str, Callable[[], None]] = {"echo": echo, "A": move_a, "B": move_b}
        try:
            p50 = _rounds(methods, args.rounds)
        finally:
            sock.close()
            ctx.term()
    med = {k: statistics.median(v) for k, v in p50.items()}
    ratio_a = statistics.median(a / e for a, e in zip(p50["A"], p50["echo"], strict=True))
    ratio_b = statistics.median(b / e for b, e in zip(p50["B"], p50["echo"], strict=True))
    b_over_a = statistics.median(b / a for a, b in zip(p50["A"], p50["B"], strict=True))
    print(
        f"p50 µs: echo {med['echo']:.1f}, A {med['A']:.1f}, B {med['B']:.1f} | "
        f"A/echo {ratio_a:.3f}, B/echo {ratio_b:.3f} | B/A per round {b_over_a:.3f}"
    )


def _rounds(methods: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Each method's p50 (µs) per round of 100 round trips, the methods in turns."""
    for fn in methods.values():  # warm-up: connections, first touches of the mappings
        for _ in range(200):
            fn()
    out: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            times = []
            for _ in range(100):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[name].append(statistics.median(times) * 1e6)
    return out


if __name__ == "__main__":
    main()
