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
import contextlib
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")

BlockSets = Mapping[Hashable, npt.NDArray[np.signedinteger]]
"""Blocks a job touches: buffer-set key -> block ids (each id a whole destination block)."""


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    """Schedule ``callback`` on ``loop`` from any thread; a closed loop (exit) drops it."""
    with contextlib.suppress(RuntimeError):  # the loop closed under a running copy
        loop.call_soon_threadsafe(callback, *args)


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
    started: bool = False
    then: list[Callable[[], None]] = field(default_factory=list)
    """Called on the loop once the job has finished (later jobs that wait for it)."""


class CopyExecutor:
    """Thread pool for copies, with per-block hazard ordering in arrival order.

    Call `submit` from the event loop. The order of `submit` calls is the order of application
    for conflicting jobs: the conflict check happens synchronously inside `submit`.
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

    def submit(
        self, fn: Callable[[], T], *, reads: BlockSets, writes: BlockSets
    ) -> asyncio.Future[T]:
        """Run ``fn`` on a copy thread once every earlier conflicting job has finished.

        Returns a future for its result. Cancelling it before the job starts drops the job;
        once started, the thread runs to the end and the job stays in flight until it does, so
        no later job overtakes it and no mapping is released under a running copy.

        The hand-off is one ``call_soon_threadsafe`` back to the loop, with no task, wrapped
        future or shield on the way (each costs a loop iteration on a short command).
        """
        loop = asyncio.get_running_loop()
        job = _Job(reads, writes)
        before = [
            j
            for j in self._active
            if _overlap(j.writes, writes) or _overlap(j.writes, reads) or _overlap(j.reads, writes)
        ]
        self._active.append(job)
        result: asyncio.Future[T] = loop.create_future()
        if not before:
            self._start(loop, job, fn, result)
            return result
        waiting = len(before)

        def earlier_done() -> None:
            nonlocal waiting
            waiting -= 1
            if waiting == 0:
                self._start(loop, job, fn, result)

        def cancelled(fut: asyncio.Future[T]) -> None:
            if fut.cancelled() and not job.started:  # dropped before it started: nobody waits
                self._finish(job)

        for earlier in before:
            earlier.then.append(earlier_done)
        result.add_done_callback(cancelled)
        return result

    def _start(
        self,
        loop: asyncio.AbstractEventLoop,
        job: _Job,
        fn: Callable[[], T],
        result: asyncio.Future[T],
    ) -> None:
        if result.done():  # cancelled while it waited: it never runs
            self._finish(job)
            return
        job.started = True  # from here on it stays in flight until its thread is done

        def work() -> None:
            start = time.perf_counter()
            value: T | None = None
            error: BaseException | None = None
            try:
                value = fn()
            except BaseException as exc:  # handed to the awaiting side, like run_in_executor
                error = exc
            finally:
                self.busy_seconds += time.perf_counter() - start
            _call_soon(loop, self._settle, job, result, value, error)
            del error  # no cycle through this frame: it holds ``fn`` (the job's views)

        try:
            handle = self._pool.submit(work)
        except RuntimeError as exc:  # the pool is shut down
            self._settle(job, result, None, exc)
            return

        # Queued work dropped by `shutdown` never runs `work`: settle it as cancelled.
        def dropped(h: concurrent.futures.Future[None]) -> None:
            if h.cancelled():
                _call_soon(loop, self._drop, job, result)

        handle.add_done_callback(dropped)

    def _settle(
        self, job: _Job, result: asyncio.Future[T], value: T | None, error: BaseException | None
    ) -> None:
        self._finish(job)
        if result.done():
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)  # type: ignore[arg-type]

    def _drop(self, job: _Job, result: asyncio.Future[T]) -> None:
        self._finish(job)
        result.cancel()

    def _finish(self, job: _Job) -> None:
        if job.done.is_set():
            return
        if job in self._active:
            self._active.remove(job)
        job.done.set()
        then, job.then = job.then, []
        for callback in then:
            callback()

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

    def when_idle(self, keys: set[Hashable], callback: Callable[[], None]) -> None:
        """Call ``callback`` once no in-flight job touches any of ``keys``.

        At once if none does; otherwise from the finish of the last such job, in the very
        callback that takes it out of `in_flight` (so nothing can observe the gap between).
        Jobs submitted later are not waited for.
        """
        pending = [j for j in self._active if keys & (set(j.reads) | set(j.writes))]
        if not pending:
            callback()
            return
        left = len(pending)

        def one_done() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                callback()

        for job in pending:
            job.then.append(one_done)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the threads; with ``wait=False`` a running copy is abandoned to process exit."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
