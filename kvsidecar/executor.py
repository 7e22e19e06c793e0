"""The copy executor: runs block copies on threads, in a safe order, never on the event loop.

torch copies release the GIL, so a copy on a worker thread leaves the event loop free to answer
status requests and heartbeats while gigabytes move.

Ordering: every job declares the blocks it reads and writes, per buffer set. A job starts only
after every earlier job it conflicts with (write/write, read-after-write, write-after-read on a
common block) has finished, so moves that touch the same destination blocks apply in arrival
order, and an onboard issued right after an offload of the same host blocks reads the new bytes.
Jobs on disjoint blocks run concurrently, up to the thread count.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")

BlockSets = Mapping[Hashable, npt.NDArray[np.signedinteger]]
"""Blocks a job touches: buffer-set key -> block ids (each id a whole destination block)."""


def _overlap(a: BlockSets, b: BlockSets) -> bool:
    for key, ids in a.items():
        other = b.get(key)
        if other is not None and np.intersect1d(ids, other, assume_unique=False).size:
            return True
    return False


@dataclass(eq=False)
class _Job:
    reads: BlockSets
    writes: BlockSets
    done: asyncio.Event = field(default_factory=asyncio.Event)


class CopyExecutor:
    """Thread pool for copies, with per-block hazard ordering in arrival order.

    Call `submit` from the event loop. The order of `submit` calls is the order of application
    for conflicting jobs: the conflict check happens synchronously inside `submit`, before it
    first awaits.
    """

    def __init__(self, threads: int, *, name: str = "kvsidecar-copy") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=name
        )
        self._active: list[_Job] = []
        self.busy_seconds = 0.0
        """Seconds spent copying, summed over threads (for status and metrics)."""

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished (waiting or running)."""
        return len(self._active)

    def in_flight_for(self, owner: Hashable) -> int:
        """Jobs in flight on a buffer set whose key is a tuple starting with ``owner``."""
        return sum(
            1
            for j in self._active
            if any(isinstance(k, tuple) and k[0] == owner for k in (*j.reads, *j.writes))
        )

    async def submit(self, fn: Callable[[], T], *, reads: BlockSets, writes: BlockSets) -> T:
        """Run ``fn`` on a copy thread once every earlier conflicting job has finished."""
        job = _Job(reads, writes)
        before = [
            j
            for j in self._active
            if _overlap(j.writes, writes) or _overlap(j.writes, reads) or _overlap(j.reads, writes)
        ]
        self._active.append(job)
        fut: asyncio.Future[T] | None = None
        try:
            for earlier in before:
                await earlier.done.wait()
            # Shielded: if the caller is cancelled (shutdown), the thread still runs to the end
            # and the job stays active until it does, so no later job overtakes it and no
            # mapping is released under a running copy.
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._timed, fn)
            return await asyncio.shield(fut)
        finally:
            self._finish_when_done(job, fut)

    def _timed(self, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _finish_when_done(self, job: _Job, fut: asyncio.Future[T] | None) -> None:
        def finish(_: object = None) -> None:
            if job in self._active:
                self._active.remove(job)
            job.done.set()

        if fut is None or fut.done():
            finish()
        else:
            fut.add_done_callback(finish)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is in flight; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._active:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._active[0].done.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    async def wait_for_keys(self, keys: set[Hashable], timeout: float) -> bool:
        """Wait until no in-flight job touches any of ``keys``; False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [j for j in self._active if keys & (set(j.reads) | set(j.writes))]
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(pending[0].done.wait(), left)
            except asyncio.TimeoutError:
                return False

    def shutdown(self, *, wait: bool) -> None:
        """Stop the threads; with ``wait=False`` a running copy is abandoned to process exit."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
