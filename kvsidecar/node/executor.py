"""The copy executor: runs block copies on threads, in a safe order; says when one may run now.

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
import collections
import logging
import queue
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")

log = logging.getLogger("kvsidecar.executor")

BlockSets = Mapping[Hashable, npt.NDArray[np.signedinteger]]
"""Blocks a job touches: buffer-set key -> block ids (each id a whole destination block)."""


def call_soon_from_thread(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    """Schedule ``callback`` on ``loop`` from any thread; a closed loop (exit) drops it."""
    # Not contextlib.suppress: this runs on every copy's way back, where a context manager's
    # object and calls are a measurable part of a 1-block move.
    try:  # noqa: SIM105
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop closed under a running copy
        pass


def _overlap(a: BlockSets, b: BlockSets) -> bool:
    for key, ids in a.items():
        other = b.get(key)
        if other is not None and np.intersect1d(ids, other, assume_unique=False).size:
            return True
    return False


@dataclass(eq=False, slots=True)
class _Job:
    reads: BlockSets
    writes: BlockSets
    started: bool = False
    finished: bool = False
    then: list[Callable[[], None]] = field(default_factory=list)
    """Called on the loop once the job has finished (later jobs that wait for it)."""


def _conflicts(job: _Job, reads: BlockSets, writes: BlockSets) -> bool:
    """Whether ``job`` shares a block with these reads and writes, one of the two a write."""
    return (
        _overlap(job.writes, writes) or _overlap(job.writes, reads) or _overlap(job.reads, writes)
    )


@dataclass(eq=False, slots=True)
class _Work:
    """A started job on its way to a copy thread and back."""

    job: _Job
    fn: Callable[[], Any]
    result: asyncio.Future[Any]
    on_done: Callable[[asyncio.Future[Any]], None] | None
    on_thread: Callable[[Any], None] | None
    loop: asyncio.AbstractEventLoop


class CopyExecutor:
    """Copy threads, with per-block hazard ordering in arrival order.

    Call `submit` from the event loop. The order of `submit` calls is the order of application
    for conflicting jobs: the conflict check happens synchronously inside `submit`.

    The threads are this class's own, fed from one `queue.SimpleQueue`, rather than a
    `concurrent.futures.ThreadPoolExecutor`: on a 1-block move the pool's per-item future,
    locks and callbacks cost more than the copy, on both sides of the hand-off (docs/benchmarks.md,
    "bench latency").
    """

    def __init__(self, threads: int, *, name: str = "kvsidecar-copy") -> None:
        if threads < 1:
            raise ValueError(f"copy threads must be >= 1, got {threads}")
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._closing = False
        self._active: list[_Job] = []
        self._finished: collections.deque[tuple[_Work, object, BaseException | None]] = (
            collections.deque()
        )
        """Work the threads have finished and the loop has not settled yet (`settle_finished`)."""
        self._idle_waiters: list[asyncio.Future[None]] = []
        # Daemon threads: after a drain timeout a copy still running is abandoned to process
        # exit (`shutdown(wait=False)`) instead of holding the exit up.
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

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
        self,
        fn: Callable[[], T],
        *,
        reads: BlockSets,
        writes: BlockSets,
        on_done: Callable[[asyncio.Future[T]], None] | None = None,
        on_thread: Callable[[T], None] | None = None,
    ) -> asyncio.Future[T]:
        """Run ``fn`` on a copy thread once every earlier conflicting job has finished.

        Returns a future for its result. Cancelling it before the job starts drops the job;
        once started, the thread runs to the end and the job stays in flight until it does, so
        no later job overtakes it and no mapping is released under a running copy.

        ``on_done`` is called with the future as soon as it is settled, in the same loop
        callback (a done-callback would wait one more loop iteration). The hand-off back is one
        ``call_soon_threadsafe`` with no task, wrapped future or shield on the way.

        ``on_thread`` is called on the copy thread with ``fn``'s result when it succeeded, after
        the job is queued for settling and before the loop is woken: the daemon answers a
        plain successful move from there (see `settle_finished` for the ordering this keeps).
        """
        loop = asyncio.get_running_loop()
        job = _Job(reads, writes)
        before = [j for j in self._active if _conflicts(j, reads, writes)]
        self._active.append(job)
        result: asyncio.Future[T] = loop.create_future()
        work = _Work(job, fn, result, on_done, on_thread, loop)
        if not before:
            self._start(work)
            return result
        waiting = len(before)

        def earlier_done() -> None:
            nonlocal waiting
            waiting -= 1
            if waiting == 0:
                self._start(work)

        def cancelled(fut: asyncio.Future[T]) -> None:
            if fut.cancelled() and not job.started:  # dropped before it started: nobody waits
                self._finish(job)
                if on_done is not None:
                    on_done(fut)

        for earlier in before:
            earlier.then.append(earlier_done)
        result.add_done_callback(cancelled)
        return result

    def free(self, *, reads: BlockSets, writes: BlockSets) -> bool:
        """Whether a job on these blocks may run right now, on the caller's (the loop's) thread.

        True when no job in flight conflicts with it and the executor is open: such a job,
        run to the end before the loop does anything else, keeps arrival order as `submit`
        would (any later job is submitted after it has finished). For copies shorter than the
        hand-off to a copy thread and back (two thread wake-ups).
        """
        return not self._closing and not any(_conflicts(j, reads, writes) for j in self._active)

    def _start(self, work: _Work) -> None:
        if work.result.done():  # cancelled while it waited: `cancelled` has finished it
            return
        work.job.started = True  # from here on it stays in flight until its thread is done
        if self._closing:
            self._settle(work, None, RuntimeError("the copy executor is shut down"))
            return
        self._queue.put(work)

    def _serve(self) -> None:
        """Run work on this copy thread until the stop sentinel."""
        get = self._queue.get
        while (work := get()) is not None:
            if self._closing:  # queued when `shutdown` came: never runs
                call_soon_from_thread(work.loop, self._drop, work)
                continue
            value: Any = None
            error: BaseException | None = None
            try:
                value = work.fn()
            except BaseException as exc:  # handed to the awaiting side, like run_in_executor
                error = exc
            self._finished.append((work, value, error))
            if error is None and work.on_thread is not None:
                try:
                    work.on_thread(value)
                except Exception:  # a bug in the hook must not stop this thread
                    log.exception("copy-thread completion hook failed")
            call_soon_from_thread(work.loop, self.settle_finished)
            # No cycle through this frame: it holds ``fn`` (the job's views) until the next get.
            del work, value, error

    def settle_finished(self) -> None:
        """Settle, on the loop, every job the threads have finished so far.

        Each finished job wakes the loop to call this, and the daemon also calls it before it
        handles a request: a reply sent from a copy thread (`submit`'s ``on_thread``) can reach
        its client, and the client's next request the daemon, before that wake-up has run, and
        the next request must find the move settled (counted, credited, blocks released).
        """
        finished = self._finished  # the threads only append, the loop alone pops
        while finished:
            self._settle(*finished.popleft())

    def _settle(self, work: _Work, value: object, error: BaseException | None) -> None:
        self._finish(work.job)
        result = work.result
        if not result.done():
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(value)
        if work.on_done is not None:
            work.on_done(result)

    def _drop(self, work: _Work) -> None:
        self._finish(work.job)
        work.result.cancel()
        if work.on_done is not None:
            work.on_done(work.result)

    def _finish(self, job: _Job) -> None:
        if job.finished:
            return
        job.finished = True
        self._active.remove(job)
        then, job.then = job.then, []
        for callback in then:
            callback()
        if not self._active:
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is in flight; False if ``timeout`` seconds passed first."""
        if not self._active:
            return True
        idle = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(idle)
        try:
            await asyncio.wait_for(idle, timeout)
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
        """Stop the threads; queued jobs are dropped (cancelled), none starts from now on.

        With ``wait=False`` a running copy is abandoned to process exit.
        """
        self._closing = True
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()
