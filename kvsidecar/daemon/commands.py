"""Commands on registered memory: moves, layout fixes, host blocks, status.

``move`` and ``fix_layout`` are checked here (`jobs`) and run on the `CopyExecutor`;
`Commands._run_job` answers them (from the copy thread on success) and hands back the outcome.
``host_alloc`` / ``host_free`` hand out an engine's host-pool block ids; ``status`` reports.

A mixin of `kvsidecar.daemon.server.Daemon`, which owns the state declared below and sets it in
``__init__`` / ``startup``; ``_dispatch`` there calls these handlers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from kvsidecar import __version__
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.limits.admission import Admission  # reliability
from kvsidecar.daemon.metrics.families import LayoutFixKind, MoveKind
from kvsidecar.daemon.metrics.observability import Observability, move_fix_kind, move_kind
from kvsidecar.memory.base import HandleError
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.node.batch import PreparedBatch, prepare_batch
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.jobs import Job, prepare_move
from kvsidecar.node.registry import Registry, Worker
from kvsidecar.wire.batch import MoveBatch, MovedBatch
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray, decode_ids, encode_ids
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Error,
    Fixed,
    HostAlloc,
    HostAllocated,
    HostFree,
    Move,
    Moved,
    Ok,
    Reply,
    Status,
    StatusReply,
)
from kvsidecar.wire.types import WorkerRef

log = logging.getLogger("kvsidecar.daemon")  # one logger for the whole daemon


class Commands:
    """Handlers of the copy, host-block and status commands (a `Daemon` mixin)."""

    # Owned and set by `Daemon`.
    config: Config
    registry: Registry
    completions: CompletionService
    observability: Observability
    admission: Admission
    draining: bool
    moves_total: int
    moves_failed_total: int
    bytes_moved_total: int
    errors_total: int
    integrity_failures_total: int
    _executor: CopyExecutor | None
    _pool: HostPool | None
    _started_at: float
    _jobs: dict[asyncio.Future[Any], frozenset[Hashable]]

    def _ids(self, frame: memoryview, dtype: Any, what: str) -> IdArray:
        return decode_ids(frame, dtype, max_ids=self.config.max_ids_per_command, what=what)

    def _host_alloc(self, req: HostAlloc) -> tuple[Reply, tuple[Any, ...]]:
        engine = self.registry.engine(req.engine_id)
        if req.count < 0:
            raise SidecarError("invalid_message", f"count {req.count} < 0")
        if req.count > self.config.max_ids_per_command:
            raise SidecarError("too_large", f"{req.count} ids is more than one command may carry")
        if engine.allocator is None:
            raise SidecarError("pool_exhausted", f"engine {req.engine_id!r} has no host blocks")
        try:
            ids = engine.allocator.alloc(req.count)
        except HandleError as exc:
            raise SidecarError("pool_exhausted", str(exc)) from None
        arr = encode_ids(ids, req.ids_dtype)
        return HostAllocated(id=req.id, count=len(ids), ids_dtype=req.ids_dtype), (arr,)

    def _host_free(self, req: HostFree, frame: memoryview) -> Ok:
        engine = self.registry.engine(req.engine_id)
        ids = self._ids(frame, req.ids_dtype, "host block")
        if engine.allocator is None:
            raise SidecarError("not_allocated", f"engine {req.engine_id!r} has no host blocks")
        try:
            engine.allocator.free(ids.tolist())
        except HandleError as exc:
            raise SidecarError("not_allocated", str(exc)) from None
        return Ok(id=req.id)

    def _move(self, req: Move, data: list[memoryview], respond: ReplySink) -> asyncio.Future[Reply]:
        src_ids = self._ids(data[0], req.ids_dtype, "source")
        dst_ids = self._ids(data[1], req.ids_dtype, "destination")
        checksum = self.config.checksum if req.checksum is None else req.checksum
        job = prepare_move(self.registry, req, src_ids, dst_ids, checksum=checksum)
        # Classified now: by the time the move ends its workers may have left the registry.
        fix = move_fix_kind(self.registry, req) if job.fixed else None
        invalid = dst_ids.tolist() if req.request_ids else []
        return self._run_job(
            job,
            req.id,
            move=True,
            respond=respond,
            track=lambda reply: self._track_move(req, fix, invalid, reply),
        )

    def _move_batch(
        self, req: MoveBatch, data: list[memoryview], respond: ReplySink
    ) -> asyncio.Future[Reply]:
        """Check a batch item by item and run its items as one job (`kvsidecar.daemon.batch`)."""
        src_ids = self._ids(data[0], req.ids_dtype, "source")
        dst_ids = self._ids(data[1], req.ids_dtype, "destination")
        checksum = self.config.checksum if req.checksum is None else req.checksum
        batch = prepare_batch(self.registry, req, src_ids, dst_ids, checksum=checksum)
        # Classified now, as for a move: by the end the workers may have left the registry.
        kinds = [
            (move_kind(it.move.src, it.move.dst), move_fix_kind(self.registry, it.move))
            if it.job is not None
            else None
            for it in batch.items
        ]
        return self._run_job(
            batch.job,
            req.id,
            move=True,
            respond=respond,
            track=lambda outcome: self._track_batch(batch, kinds, outcome),
            build=batch.reply,
        )

    def _track_batch(
        self,
        batch: PreparedBatch,
        kinds: list[tuple[MoveKind, LayoutFixKind | None] | None],
        outcome: asyncio.Future[Reply],
    ) -> None:
        """Metrics and completions of a batch's items that ran (as `_track_move` for each)."""
        whole: str | None = None  # the batch's own failure, shared by every item that ran
        if outcome.cancelled():
            whole = "shutting_down"
        elif (failure := outcome.exception()) is not None:
            whole = failure.code if isinstance(failure, SidecarError) else "internal"
        seconds = time.perf_counter() - batch.started
        for item, kind in zip(batch.items, kinds, strict=True):
            if kind is None:  # refused by its checks: it never ran, nothing to credit
                continue
            move, result = item.move, item.result
            code = whole or (result.error_code if result is not None else "internal")
            if code:
                self.observability.move_failed(kind[0], code)
                self.completions.move_finished(
                    move.src, move.dst, move.request_ids, ok=False, dst_ids=item.dst_ids.tolist()
                )
                continue
            assert result is not None
            self.observability.move_done(kind[0], move.dst.worker.engine_id, result.nbytes, seconds)
            self.observability.layout_fixed(kind[1])
            self.completions.move_finished(move.src, move.dst, move.request_ids, ok=True)

    def _track_move(
        self,
        req: Move,
        fix: LayoutFixKind | None,
        dst_ids: list[int],
        outcome: asyncio.Future[Reply],
    ) -> None:
        """Metrics and completions of one move: counted by kind, its request ids credited."""
        kind = move_kind(req.src, req.dst)
        failure = None if outcome.cancelled() else outcome.exception()
        if outcome.cancelled() or failure is not None:
            if failure is None:
                code = "shutting_down"
            else:
                code = failure.code if isinstance(failure, SidecarError) else "internal"
            self.observability.move_failed(kind, code)
            self.completions.move_finished(
                req.src, req.dst, req.request_ids, ok=False, dst_ids=dst_ids
            )
            return
        self._move_succeeded(req, fix, outcome.result())

    def _move_succeeded(self, req: Move, fix: LayoutFixKind | None, reply: Reply) -> None:
        """Metrics and completions of a move that ran to the end (also `ShortMoves`')."""
        if isinstance(reply, Moved):
            self.observability.move_done(
                move_kind(req.src, req.dst), req.dst.worker.engine_id, reply.nbytes, reply.seconds
            )
            self.observability.layout_fixed(fix)
        self.completions.move_finished(req.src, req.dst, req.request_ids, ok=True)

    def _run_job(
        self,
        job: Job,
        request_id: int,
        *,
        move: bool,
        respond: ReplySink,
        track: Callable[[asyncio.Future[Reply]], None] | None = None,
        build: Callable[[int], Reply] | None = None,
    ) -> asyncio.Future[Reply]:
        """Run a checked job and answer it through ``respond``; returns its outcome.

        ``build`` makes the reply of a job that ran (given the request id) instead of the
        `Moved` (or `Fixed`) made from the job's fields: a batch's `MovedBatch`.

        A short CPU job (`Job.inline`) on blocks no job in flight touches runs right here, on
        the loop (`_run_here`); any other goes to the executor (`_submit`).
        """
        assert self._executor is not None
        if job.inline and self._executor.free(reads=job.reads, writes=job.writes):
            return self._run_here(
                job, request_id, move=move, respond=respond, track=track, build=build
            )
        return self._submit(job, request_id, move=move, respond=respond, track=track, build=build)

    def _submit(
        self,
        job: Job,
        request_id: int,
        *,
        move: bool,
        respond: ReplySink,
        track: Callable[[asyncio.Future[Reply]], None] | None,
        build: Callable[[int], Reply] | None,
    ) -> asyncio.Future[Reply]:
        """Submit a checked job to the executor (`_run_job`); returns its outcome.

        A job that succeeds is answered from its copy thread, right after the copy: waking the
        event loop first would add a thread hand-off to every move's round trip. The loop still
        settles it (counts, ``track``: metrics and completions) before it handles any later
        request (`CopyExecutor.settle_finished`). Every other outcome (failure, a worker
        released meanwhile, shutdown) is answered from the loop. Completion is a chain of
        callbacks, not a task: on a 1-block move a task's loop iterations cost as much as the
        copy.
        """
        assert self._executor is not None
        # reliability: bounded queue (busy beyond it); the workers as they are now, so that a
        # release (or re-registration) while the job waits or runs fails it instead of
        # reporting bytes that may have gone to, or come from, memory nobody owns any more.
        refs = [w for w in job.workers if isinstance(w, WorkerRef)]
        ticket = self.admission.admit(refs)
        owners = {ref: self.registry.workers.get(ref) for ref in refs}
        started = time.perf_counter()
        outcome: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

        def success(nbytes: int) -> Reply:
            return self._success_reply(
                job, request_id, nbytes, owners=owners, move=move, started=started, build=build
            )

        def on_thread(nbytes: int) -> None:
            try:
                reply = success(nbytes)
            except SidecarError:  # a worker left meanwhile: the loop answers worker_lost
                return
            respond.send(reply, from_thread=True, early=True)

        def finish(pending: asyncio.Future[int]) -> None:
            self._jobs.pop(pending, None)
            self.admission.release(ticket)
            # What the copy thread told the client, whatever happened since; or None, and from
            # here on the thread can no longer answer: this callback does.
            sent = respond.claim()
            result: Reply | BaseException
            try:
                result = sent if sent is not None else success(_copied(pending, self.draining))
            except BaseException as exc:  # handed on to the reply
                result = exc
            self._conclude(outcome, request_id, result, move=move, track=track)
            if sent is None:
                respond.deliver(reply_of(outcome, request_id))

        # Claim the blocks now, synchronously, so that arrival order is application order.
        pending = self._executor.submit(
            job.run, reads=job.reads, writes=job.writes, on_done=finish, on_thread=on_thread
        )
        self._jobs[pending] = job.workers
        return outcome

    def _run_here(
        self,
        job: Job,
        request_id: int,
        *,
        move: bool,
        respond: ReplySink,
        track: Callable[[asyncio.Future[Reply]], None] | None,
        build: Callable[[int], Reply] | None,
    ) -> asyncio.Future[Reply]:
        """Run a short job on the loop, do its bookkeeping, then answer it; returns its outcome.

        A success is answered at once, as a copy thread answers it (`_submit`), and the
        bookkeeping (counts, ``track``: metrics and completions) follows while the reply
        travels, still before the loop reads any later request. A sink whose reply is built
        from the bookkeeping (a cache command's) declines the early answer and is answered
        after it; so is a failure. No worker can be released and no other job can start while
        this runs, so there is neither admission nor a worker check to do.
        """
        started = time.perf_counter()
        outcome: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        result: Reply | BaseException
        try:
            nbytes = job.run()
            result = self._success_reply(
                job, request_id, nbytes, owners={}, move=move, started=started, build=build
            )
        except Exception as exc:  # as from a copy thread: handed on to the reply
            result = exc
        sent = not isinstance(result, BaseException) and respond.send(result, early=True)
        self._conclude(outcome, request_id, result, move=move, track=track)
        if not sent:
            respond.send(reply_of(outcome, request_id))
        return outcome

    def _conclude(
        self,
        outcome: asyncio.Future[Reply],
        request_id: int,
        result: Reply | BaseException,
        *,
        move: bool,
        track: Callable[[asyncio.Future[Reply]], None] | None,
    ) -> None:
        """Settle a job's ``outcome`` with its reply or failure, count it, then run ``track``.

        The one ending of both paths (`_submit` and `_run_here`), before the reply is sent.
        """
        if isinstance(result, BaseException):
            if move:
                self.moves_failed_total += 1
            if isinstance(result, asyncio.CancelledError):
                outcome.cancel()
            else:
                if not isinstance(result, SidecarError):
                    log.error("request %d failed", request_id, exc_info=result)
                # Handed on without its traceback: its frames would keep the job (and its
                # views of a released worker's memory) alive until a garbage collection.
                outcome.set_exception(result.with_traceback(None))
        else:
            self._count(result, request_id)
            outcome.set_result(result)
        if track is not None:
            track(outcome)

    def _success_reply(
        self,
        job: Job,
        request_id: int,
        nbytes: int,
        *,
        owners: dict[WorkerRef, Worker | None],
        move: bool,
        started: float,
        build: Callable[[int], Reply] | None = None,
    ) -> Reply:
        """Return the reply of a job that ran to the end; ``worker_lost`` if a worker left.

        Called on the copy thread (and on the loop as a fallback): it only reads the registry.
        """
        lost = [r for r, w in owners.items() if self.registry.workers.get(r) is not w]
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

    def _count(self, reply: Reply, request_id: int) -> None:
        """Add a finished move (or a batch's moves) to the daemon's totals (on the loop)."""
        if isinstance(reply, MovedBatch):
            for result in reply.results:
                if not result.error_code:
                    self._count_one(request_id, result.nbytes, result.invalid_block_ids)
        elif isinstance(reply, Moved):
            self._count_one(request_id, reply.nbytes, reply.invalid_block_ids)

    def _count_one(self, request_id: int, nbytes: int, invalid_block_ids: list[int]) -> None:
        self.moves_total += 1
        self.bytes_moved_total += nbytes
        if invalid_block_ids:
            self.integrity_failures_total += 1
            log.warning(
                "move %d: checksum mismatch on destination blocks %s",
                request_id,
                invalid_block_ids[:16],
            )

    def _status(self, req: Status) -> StatusReply:
        now = time.monotonic()
        executor = self._executor

        def in_flight(ref: WorkerRef) -> int:
            if executor is None:
                return 0
            return executor.in_flight_for(ref)

        pool = self._pool
        return StatusReply(
            id=req.id,
            daemon_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=now - self._started_at,
            endpoint=self.config.endpoint,
            engines=self.registry.engine_infos(now, in_flight),
            host_pool_bytes=0 if pool is None else pool.capacity_bytes,
            host_pool_used_bytes=0 if pool is None else pool.used_bytes,
            in_flight_moves=0 if executor is None else executor.in_flight,
            moves_total=self.moves_total,
            moves_failed_total=self.moves_failed_total,
            bytes_moved_total=self.bytes_moved_total,
            errors_total=self.errors_total,
            draining=self.draining,
            metrics_port=self.observability.port,
        )


class ReplySink(Protocol):
    """Where a request's one reply goes (`kvsidecar.daemon.server`): whoever claims it first sends.

    `send` claims and sends in one step; `claim` then `deliver` let the loop claim first and
    decide the reply afterwards, knowing that no copy thread can answer in between.
    """

    def send(self, reply: Reply, *, from_thread: bool = False, early: bool = False) -> bool:
        """Send ``reply`` unless the reply is claimed already; True if this call sent it.

        ``from_thread``: called on a copy thread rather than on the event loop. ``early``: a
        success sent before the loop's bookkeeping of its job, which a sink may decline.
        """
        ...

    def claim(self) -> Reply | None:
        """Claim the reply for the caller (None; then `deliver` it) or return what was sent."""
        ...

    def deliver(self, reply: Reply) -> None:
        """Send the reply that `claim` reserved (on the event loop)."""
        ...


def _copied(pending: asyncio.Future[int], draining: bool) -> int:
    """Bytes a finished job copied; raises its failure (or cancellation) instead."""
    if pending.cancelled():
        if draining:  # cancelled by shutdown
            raise asyncio.CancelledError
        # by `_release`
        raise SidecarError("worker_lost", "a worker of this move was released while it waited")
    return pending.result()


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
