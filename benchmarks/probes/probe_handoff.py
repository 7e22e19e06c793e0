"""Probe: the cost of handing a tiny job from the event loop to a thread and back.

Why `kvsidecar.node.executor.CopyExecutor` runs its own threads fed from a `SimpleQueue`: one
uvloop process hands a no-op job to another thread and awaits the result, ``--n`` times per
method, the methods taking turns in batches:

- ``ThreadPoolExecutor``: ``pool.submit`` plus ``call_soon_threadsafe`` back (the standard
  library's way);
- ``SimpleQueue thread``: a dedicated thread blocked on ``SimpleQueue.get``;
- ``CopyExecutor.submit``: the daemon's executor itself, hazard bookkeeping included;
- ``loop only``: a future resolved by ``call_soon``, the floor without any thread.

Prints each method's median and p90 in µs.

    .venv/bin/python benchmarks/probes/probe_handoff.py [--n 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import queue
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import uvloop

from kvsidecar.node.executor import CopyExecutor


def _noop() -> int:
    return 1


async def _probe(n: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    jobs: queue.SimpleQueue[asyncio.Future[int] | None] = queue.SimpleQueue()

    def serve() -> None:
        while (fut := jobs.get()) is not None:
            loop.call_soon_threadsafe(fut.set_result, _noop())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    executor = CopyExecutor(1)
    ids = np.array([3], dtype=np.int64)

    async def via_pool() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        pool.submit(lambda: loop.call_soon_threadsafe(fut.set_result, _noop()))
        await fut

    async def via_queue() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        jobs.put(fut)
        await fut

    async def via_executor() -> None:
        await executor.submit(_noop, reads={"a": ids}, writes={"b": ids})

    async def loop_only() -> None:
        fut: asyncio.Future[int] = loop.create_future()
        loop.call_soon(fut.set_result, 1)
        await fut

    methods: dict[str, Callable[[], Awaitable[None]]] = {
        "ThreadPoolExecutor": via_pool,
        "SimpleQueue thread": via_queue,
        "CopyExecutor.submit": via_executor,
        "loop only": loop_only,
    }
    samples: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for fn in methods.values():
            for _ in range(100):
                await fn()
        batch = 100
        for _ in range(max(1, n // batch)):
            for name, fn in methods.items():
                for _ in range(batch):
                    start = time.perf_counter()
                    await fn()
                    samples[name].append((time.perf_counter() - start) * 1e6)
        return samples
    finally:
        jobs.put(None)
        thread.join(5)
        pool.shutdown(wait=True)
        executor.shutdown(wait=True)


def main() -> int:
    """Run the probe and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="hand-offs per method")
    args = parser.parse_args()
    samples = uvloop.run(_probe(args.n))
    print("| method | p50 µs | p90 µs |\n| --- | ---: | ---: |")
    for name, values in samples.items():
        values.sort()
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"| {name} | {statistics.median(values):.1f} | {p90:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
