"""Running a checked job and answering it: on the event loop when short, else on a copy thread.

Every copy the daemon makes for a request (a move, a batch, a layout fix, a cache store or load)
is checked into a `kvsidecar.node.jobs.Job` by its handler and handed to `JobRunner.run`, which

- runs a short CPU job (`Job.inline`) on blocks no job in flight touches right on the loop, since
  the copy takes less than the hand-off to a thread and back;
- submits any other job to the `CopyExecutor`, which claims its blocks at once (arrival order is
  application order), behind the admission bound and with the job's workers noted, so that a
  release while it waits or runs fails it with ``worker_lost``.

A success is answered as soon as it is known (on the copy thread, from the thread: waking the
loop first would add a hand-off to every move's round trip), unless the handler builds its reply
from the bookkeeping (``finish``, the cache's commands): then the loop answers after it. The
loop settles every job (counts, the handler's ``track``: metrics and completions) before it reads
any later request (`CopyExecutor.settle_finished`). Completion is a chain of callbacks, not a
task: on a 1-block move a task's loop iterations cost as much as the copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvsidecar.daemon.limits.admission import Admission
from kvsidecar.daemon.state import DaemonState, MoveTotals
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.jobs import Job
from kvsidecar.node.registry import Registry, Worker
from kvsidecar.wire.batch import MovedBatch
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Error, Fixed, Moved, Reply
from kvsidecar.wire.types import WorkerRef

log = logging.getLogger("kvsidecar.daemon")

Track = Callable[[asyncio.Future[Reply]], None]
"""A handler's bookkeeping of a finished job (metrics, completions, the cache index)."""


class Answer(Protocol):
    """Where one request's one reply goes; ``send`` answers it unless it is answered already.

    `kvsidecar.daemon.control.ReplyTo` is the one implementation; this is the part a job needs.
    A copy thread and the loop may both try to answer (a move that finished just as its worker
    was released): whoever claims the reply first sends it, and what was sent stays readable so
    that the loop's bookkeeping matches what the client got.
    """

    def send(self, reply: Reply, *, from_thread: bool = False) -> bool:
        """Send ``reply`` unless the reply is claimed already; True if this call sent it."""
        ...

    def claim(self) -> Reply | None:
        """Claim the reply for the caller (None; then `deliver` it) or return what was sent."""
        ...

    def deliver(self, reply: Reply) -> None:
        """Send the reply that `claim` reserved (on the event loop)."""
        ...


class JobRunner:
    """Runs checked jobs and answers them (see the module doc); counts moves in `MoveTotals`."""

    def __init__(
        self,
        registry: Registry,
        executor: CopyExecutor,
        admission: Admission,
        state: DaemonState,
        totals: MoveTotals,
    ) -> None:
        self._registry = registry
        self._executor = executor
        self._admission = admission
        self._state = state
        self._totals = totals

    def run(
        self,
        job: Job,
        request_id: int,
        answer: Answer,
        *,
        move: bool = True,
        track: Track | None = None,
        build: Callable[[int], Reply] | None = None,
        finish: Callable[[Moved], Reply] | None = None,
    ) -> asyncio.Future[Reply]:
        """Run ``job``, answer it through ``answer``; returns its outcome.

        ``move``: the job is a move (counted, answered with `Moved`) rather than a layout fix.
        ``build`` makes the reply of a job that ran (given the request id) instead of the
        `Moved` made from the job's fields (a batch's `MovedBatch`). ``finish`` turns the job's
        reply (a `Moved`) into the one sent, after ``track`` ran; an `Error` is sent as it is.
        """
        started = time.perf_counter()
        outcome: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        result: Reply | BaseException
        if job.inline and self._executor.free(reads=job.reads, writes=job.writes):
            # Run here. A success is answered at once, as a copy thread answers it, and the
            # bookkeeping follows while the reply travels, still before the loop reads any later
            # request. No worker can be released and no other job can start while this runs,
            # so there is neither admission nor a worker check to do.
            try:
                nbytes = job.run()
                result = self._success_reply(
                    job, request_id, nbytes, {}, move=move, started=started, build=build
                )
            except Exception as exc:  # as from a copy thread: handed on to the reply
                result = exc
            sent = finish is None and not isinstance(result, BaseException) and answer.send(result)
            self._conclude(outcome, request_id, result, move, track)
            if not sent:
                answer.send(_final(outcome, request_id, finish))
            return outcome
        # On a copy thread, with the workers as they are now: a release (or re-registration)
        # while the job waits or runs fails it instead of reporting bytes that may have gone to,
        # or come from, memory nobody owns any more.
        refs = [w for w in job.workers if isinstance(w, WorkerRef)]
        engines = self._registry.engines
        users = [e.owner for e in map(engines.get, {r.engine_id for r in refs}) if e is not None]
        ticket = self._admission.admit(refs, users)  # bounded queue: busy beyond it
        owners = {ref: self._registry.workers.get(ref) for ref in refs}

        def success(nbytes: int) -> Reply:
            return self._success_reply(
                job, request_id, nbytes, owners, move=move, started=started, build=build
            )

        def on_thread(nbytes: int) -> None:
            try:
                reply = success(nbytes)
            except SidecarError:  # a worker left meanwhile: the loop answers worker_lost
                return
            answer.send(reply, from_thread=True)

        def done(pending: asyncio.Future[int]) -> None:
            self._state.jobs.pop(pending, None)
            self._admission.release(ticket)
            # What the copy thread told the client, whatever happened since; or None, and from
            # here on the thread can no longer answer: this callback does.
            sent = answer.claim()
            result: Reply | BaseException
            try:
                result = sent if sent is not None else success(_copied(pending, self._state))
            except BaseException as exc:  # handed on to the reply
                result = exc
            self._conclude(outcome, request_id, result, move, track)
            if sent is None:
                answer.deliver(_final(outcome, request_id, finish))

        # Claim the blocks now, synchronously, so that arrival order is application order.
        pending = self._executor.submit(
            job.run,
            reads=job.reads,
            writes=job.writes,
            on_done=done,
            on_thread=None if finish is not None else on_thread,
        )
        self._state.jobs[pending] = job.workers
        return outcome

    def _conclude(
        self,
        outcome: asyncio.Future[Reply],
        request_id: int,
        result: Reply | BaseException,
        move: bool,
        track: Track | None,
    ) -> None:
        """Settle ``outcome`` with the job's reply or failure, count it, then run ``track``."""
        if isinstance(result, BaseException):
            if move:
                self._totals.moves_failed += 1
            if isinstance(result, asyncio.CancelledError):
                outcome.cancel()
            else:
                if not isinstance(result, SidecarError):
                    log.error("request %d failed", request_id, exc_info=result)
                # Handed on without its traceback: its frames would keep the job (and its
                # views of a released worker's memory) alive until a garbage collection.
                outcome.set_exception(result.with_traceback(None))
        else:
            self.count(result, request_id)
            outcome.set_result(result)
        if track is not None:
            track(outcome)

    def _success_reply(
        self,
        job: Job,
        request_id: int,
        nbytes: int,
        owners: dict[WorkerRef, Worker | None],
        *,
        move: bool,
        started: float,
        build: Callable[[int], Reply] | None,
    ) -> Reply:
        """Return the reply of a job that ran to the end; ``worker_lost`` if a worker left.

        Called on the copy thread (and on the loop as a fallback): it only reads the registry.
        """
        lost = [r for r, w in owners.items() if self._registry.workers.get(r) is not w]
        if lost:
            raise SidecarError(
                "worker_lost",
                f"{', '.join(r.label() for r in lost)} was released during the move; "
                "its outcome is unknown",
            )
        if not move:
            return Fixed(id=request_id, blocks=job.blocks)
        if build is not None:
            return build(request_id)
        check = job.verification
        return Moved(
            id=request_id,
            blocks=job.blocks,
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
            fixed=job.fixed,
            verified=check is not None and check.verified,
            invalid_block_ids=[] if check is None else check.invalid_block_ids,
        )

    def count(self, reply: Reply, request_id: int) -> None:
        """Add a finished move (or a batch's moves) to the daemon's totals (on the loop)."""
        if isinstance(reply, MovedBatch):
            for result in reply.results:
                if not result.error_code:
                    self._count_one(request_id, result.nbytes, result.invalid_block_ids)
        elif isinstance(reply, Moved):
            self._count_one(request_id, reply.nbytes, reply.invalid_block_ids)

    def _count_one(self, request_id: int, nbytes: int, invalid_block_ids: list[int]) -> None:
        totals = self._totals
        totals.moves += 1
        totals.bytes_moved += nbytes
        if invalid_block_ids:
            totals.integrity_failures += 1
            log.warning(
                "move %d: checksum mismatch on destination blocks %s",
                request_id,
                invalid_block_ids[:16],
            )


def _copied(pending: asyncio.Future[int], state: DaemonState) -> int:
    """Bytes a finished job copied; raises its failure (or cancellation) instead."""
    if pending.cancelled():
        if state.draining:  # cancelled by shutdown
            raise asyncio.CancelledError
        # by a release of one of its workers
        raise SidecarError("worker_lost", "a worker of this move was released while it waited")
    return pending.result()


def _final(
    outcome: asyncio.Future[Reply], request_id: int, finish: Callable[[Moved], Reply] | None
) -> Reply:
    reply = reply_of(outcome, request_id)
    return finish(reply) if finish is not None and isinstance(reply, Moved) else reply


def reply_of(outcome: asyncio.Future[Reply], request_id: int) -> Reply:
    """Return a finished request's reply: its result, or its failure as an `Error`."""
    if outcome.cancelled():
        return Error(id=request_id, code="shutting_down", message="cancelled by shutdown")
    exc = outcome.exception()
    if exc is None:
        return outcome.result()
    if isinstance(exc, SidecarError):
        return Error(id=request_id, code=exc.code, message=exc.message)
    return Error(id=request_id, code="internal", message=f"{type(exc).__name__}: {exc}")
