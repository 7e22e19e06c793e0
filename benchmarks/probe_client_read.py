"""Probe: how a client reads its socket, measured on one daemon's ``status`` round trips.

Why `AsyncSidecarClient` reads a plain pyzmq socket from an event-loop reader callback: four ways
of doing one ``status`` round trip against the same daemon, in turns of ``--batch`` for
``--rounds`` rounds (so they share the machine's state), from one uvloop process:

- ``zmq.asyncio, awaited``: ``await send_multipart``; ``await recv_multipart`` (the echo
  baseline's pattern);
- ``zmq.asyncio, read by a task``: a reader task resolves a future per request (the client's
  pattern before 2026-11-29);
- ``reader callback``: a plain socket, ``loop.add_reader`` on its ZMQ_FD (the pattern now used);
- ``AsyncSidecarClient.status()``: the client itself (its request building and checks included).

Prints the median over rounds of each round's p50, and the ratio to the first method.

    .venv/bin/python benchmarks/probe_client_read.py [--rounds 20] [--batch 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq
import zmq.asyncio

from kvsidecar.bench import procs
from kvsidecar.client import AsyncSidecarClient
from kvsidecar.wire import zmqio
from kvsidecar.wire.protocol import Status


async def _probe(endpoint: str, rounds: int, batch: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    ctx = zmq.asyncio.Context()
    client = AsyncSidecarClient(endpoint, heartbeat=False, context=ctx)
    await client.start()
    request = [
        client._session.codec.encoder.encode(Status(id=1))
    ]  # the very bytes the client sends
    awaited, tasked = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    plain: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)
    for sock in (awaited, tasked, plain):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
    waiting: list[asyncio.Future[object]] = []

    async def reader() -> None:
        while True:
            frames = await tasked.recv_multipart(copy=False)
            if waiting:
                waiting.pop().set_result(frames)

    def on_readable() -> None:
        while (frames := zmqio.try_recv(plain)) is not None:
            if waiting:
                waiting.pop().set_result(frames)

    async def via_await() -> None:
        await awaited.send_multipart(request)
        await awaited.recv_multipart(copy=False)

    async def via_task() -> None:
        fut = loop.create_future()
        waiting.append(fut)
        await tasked.send_multipart(request)
        await fut

    async def via_callback() -> None:
        fut = loop.create_future()
        waiting.append(fut)
        zmqio.send_frames(plain, request, copy=True)
        on_readable()  # the send may have taken the fd's edge
        await fut

    async def via_client() -> None:
        await client.status()

    methods: dict[str, Callable[[], Awaitable[None]]] = {
        "zmq.asyncio, awaited": via_await,
        "zmq.asyncio, read by a task": via_task,
        "reader callback": via_callback,
        "AsyncSidecarClient.status()": via_client,
    }
    task = asyncio.create_task(reader())
    fd = int(plain.getsockopt(zmq.FD))
    loop.add_reader(fd, on_readable)
    try:
        for fn in methods.values():
            for _ in range(50):
                await fn()
        p50s: dict[str, list[float]] = {name: [] for name in methods}
        for r in range(rounds):
            order = list(methods.items())
            for name, fn in order if r % 2 == 0 else reversed(order):
                times = []
                for _ in range(batch):
                    start = time.perf_counter()
                    await fn()
                    times.append((time.perf_counter() - start) * 1e6)
                p50s[name].append(statistics.median(times))
        return {name: statistics.median(values) for name, values in p50s.items()}
    finally:
        loop.remove_reader(fd)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        for sock in (awaited, tasked, plain):
            sock.close(linger=0)
        ctx.term()


def main() -> int:
    """Start a daemon, run the probe, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=20)
    args = parser.parse_args()
    with procs.daemon(peer_data_plane="zmq") as (endpoint, _):
        results = procs.run_async(_probe(endpoint, args.rounds, args.batch))
    first = next(iter(results.values()))
    print("| method | status p50 µs | vs first |\n| --- | ---: | ---: |")
    for name, value in results.items():
        print(f"| {name} | {value:.0f} | {value / first:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
