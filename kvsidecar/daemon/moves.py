"""The commands on registered memory: moves, batches, layout fixes and host blocks.

A ``move`` reaches `Moves.move` decoded and authorized once (`kvsidecar.daemon.control`). Its
first branch is the daemon's most frequent command: engine workers send 1-block moves by the
thousand per second, from synchronous code that waits for each reply. A move of at most
`mover.SMALL_MOVE_IDS` ids per side, with no checksum and no CUDA events, between two buffer sets
whose pair plan is cached and plain (`jobs.plain_pair`: equal block sizes, no layout fix, CPU
memory), copying at most `jobs.INLINE_MAX_BYTES` on blocks no job in flight touches, is copied
right here and answered, with no job, future or closure made for it. Every other move (and a short
one whose ids do not pass `jobs.fine_small`, so that the general check names what is wrong)
becomes a `kvsidecar.node.jobs.Job` for the `JobRunner`. Both branches count, meter and credit
completions the same way (`_succeeded`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvsidecar.core import copier, mover
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.metrics.families import LayoutFixKind, MoveKind
from kvsidecar.daemon.metrics.observability import Observability, move_fix_kind, move_kind
from kvsidecar.daemon.runner import Answer, JobRunner
from kvsidecar.daemon.state import MoveTotals
from kvsidecar.memory.base import HandleError
from kvsidecar.node.batch import PreparedBatch, prepare_batch
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.jobs import INLINE_MAX_BYTES, fine_small, move_job, plain_pair, prepare_fix
from kvsidecar.node.registry import BufferSet, Registry
from kvsidecar.wire.batch import MoveBatch
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray, decode_ids, encode_ids
from kvsidecar.wire.protocol import (
    FixLayout,
    HostAlloc,
    HostAllocated,
    HostFree,
    Move,
    Moved,
    Ok,
    Reply,
)


class Moves:
    """Handlers of ``move``, ``move_batch``, ``fix_layout``, ``host_alloc`` and ``host_free``."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        *,
        executor: CopyExecutor,
        runner: JobRunner,
        totals: MoveTotals,
        observability: Observability,
        completions: CompletionService,
    ) -> None:
        self._config = config
        self._registry = registry
        self._executor = executor
        self._runner = runner
        self._totals = totals
        self._observability = observability
        self._completions = completions
        self._short = config.short_move_fast_path

    def ids(self, frame: memoryview, dtype: Any, what: str) -> IdArray:
        """Decode one id frame, bounded by ``max_ids_per_command``."""
        return decode_ids(frame, dtype, max_ids=self._config.max_ids_per_command, what=what)

    def move(
        self, req: Move, data: list[memoryview], answer: Answer
    ) -> asyncio.Future[Reply] | None:
        """Copy a move now and answer it (None), or return the outcome of its job."""
        src_ids = self.ids(data[0], req.ids_dtype, "source")
        dst_ids = self.ids(data[1], req.ids_dtype, "destination")
        checksum = self._config.checksum if req.checksum is None else req.checksum
        src = self._registry.buffer_set(req.src)
        dst = self._registry.buffer_set(req.dst)
        if (
            self._short
            and not checksum
            and req.events is None
            and src_ids.size <= mover.SMALL_MOVE_IDS
            and dst_ids.size <= mover.SMALL_MOVE_IDS
            and self._copy_short(req, src, dst, src_ids, dst_ids, answer=answer)
        ):
            return None
        job = move_job(
            self._registry,
            src,
            dst,
            src_ids,
            dst_ids,
            layers=req.layers,
            checksum=checksum,
            events=req.events,
        )
        # Classified now: by the time the move ends its workers may have left the registry.
        fix = move_fix_kind(self._registry, req) if job.fixed else None
        invalid = dst_ids.tolist() if req.request_ids else []
        return self._runner.run(
            job, req.id, answer, track=lambda outcome: self._track(req, fix, invalid, outcome)
        )

    def _copy_short(
        self,
        req: Move,
        src: BufferSet,
        dst: BufferSet,
        src_ids: IdArray,
        dst_ids: IdArray,
        *,
        answer: Answer,
    ) -> bool:
        """Copy a short plain move and answer it; False (nothing done) if it is not one."""
        pair = plain_pair(self._registry, src, dst, req.layers)
        if pair is None or pair.cpu_groups is None:  # `plain_pair` has groups; for the typing
            return False
        if pair.block_bytes * src_ids.size > INLINE_MAX_BYTES:  # before the ids are looked at
            return False
        src_list, dst_list = src_ids.tolist(), dst_ids.tolist()
        blocks = (pair.src_blocks, pair.dst_blocks)
        if not fine_small(src_list, dst_list, ratio=1, blocks=blocks, same_set=src is dst):
            return False
        if not self._executor.free(reads={src.key: src_ids}, writes={dst.key: dst_ids}):
            return False
        started = time.perf_counter()
        try:
            nbytes = copier.copy_small(
                pair.cpu_groups, mover.plan_small(src_list, dst_list), pair.block_bytes
            )
        except Exception:  # the job copies again (no source block was written) and reports it
            return False
        reply = Moved(
            id=req.id,
            blocks=len(dst_list),
            nbytes=nbytes,
            seconds=time.perf_counter() - started,
            fixed=False,
            verified=False,
            invalid_block_ids=[],
        )
        # As a job run on the loop: the reply first, then the counts, metrics and completions.
        answer.send(reply)
        self._totals.short_moves += 1
        self._runner.count(reply, req.id)
        self._succeeded(req, None, reply)
        return True

    def move_batch(
        self, req: MoveBatch, data: list[memoryview], answer: Answer
    ) -> asyncio.Future[Reply]:
        """Check a batch item by item and run its items as one job (`kvsidecar.node.batch`)."""
        src_ids = self.ids(data[0], req.ids_dtype, "source")
        dst_ids = self.ids(data[1], req.ids_dtype, "destination")
        checksum = self._config.checksum if req.checksum is None else req.checksum
        batch = prepare_batch(self._registry, req, src_ids, dst_ids, checksum=checksum)
        # Classified now, as for a move: by the end the workers may have left the registry.
        kinds = [
            (move_kind(it.move.src, it.move.dst), move_fix_kind(self._registry, it.move))
            if it.job is not None
            else None
            for it in batch.items
        ]
        return self._runner.run(
            batch.job,
            req.id,
            answer,
            track=lambda outcome: self._track_batch(batch, kinds, outcome),
            build=batch.reply,
        )

    def fix_layout(
        self, req: FixLayout, data: list[memoryview], answer: Answer
    ) -> asyncio.Future[Reply]:
        """Check a layout fix of a worker's blocks and run it."""
        ids = self.ids(data[0], req.ids_dtype, "block")
        job = prepare_fix(self._registry, req, ids)
        return self._runner.run(job, req.id, answer, move=False)

    def host_alloc(self, req: HostAlloc) -> tuple[Reply, tuple[Any, ...]]:
        """Hand out ``count`` of an engine's host-pool block ids (the ids as a data frame)."""
        engine = self._registry.engine(req.engine_id)
        if req.count < 0:
            raise SidecarError("invalid_message", f"count {req.count} < 0")
        if req.count > self._config.max_ids_per_command:
            raise SidecarError("too_large", f"{req.count} ids is more than one command may carry")
        if engine.allocator is None:
            raise SidecarError("pool_exhausted", f"engine {req.engine_id!r} has no host blocks")
        try:
            ids = engine.allocator.alloc(req.count)
        except HandleError as exc:
            raise SidecarError("pool_exhausted", str(exc)) from None
        arr = encode_ids(ids, req.ids_dtype)
        return HostAllocated(id=req.id, count=len(ids), ids_dtype=req.ids_dtype), (arr,)

    def host_free(self, req: HostFree, frame: memoryview) -> Ok:
        """Give an engine's host-pool block ids back."""
        engine = self._registry.engine(req.engine_id)
        ids = self.ids(frame, req.ids_dtype, "host block")
        if engine.allocator is None:
            raise SidecarError("not_allocated", f"engine {req.engine_id!r} has no host blocks")
        try:
            engine.allocator.free(ids.tolist())
        except HandleError as exc:
            raise SidecarError("not_allocated", str(exc)) from None
        return Ok(id=req.id)

    def _track(
        self,
        req: Move,
        fix: LayoutFixKind | None,
        dst_ids: list[int],
        outcome: asyncio.Future[Reply],
    ) -> None:
        """Metrics and completions of one move: counted by kind, its request ids credited."""
        failure = None if outcome.cancelled() else outcome.exception()
        if outcome.cancelled() or failure is not None:
            if failure is None:
                code = "shutting_down"
            else:
                code = failure.code if isinstance(failure, SidecarError) else "internal"
            self._observability.move_failed(move_kind(req.src, req.dst), code)
            self._completions.move_finished(
                req.src, req.dst, req.request_ids, ok=False, dst_ids=dst_ids
            )
            return
        self._succeeded(req, fix, outcome.result())

    def _succeeded(self, req: Move, fix: LayoutFixKind | None, reply: Reply) -> None:
        """Metrics and completions of a move that ran to the end."""
        if isinstance(reply, Moved):
            self._observability.move_done(
                move_kind(req.src, req.dst), req.dst.worker.engine_id, reply.nbytes, reply.seconds
            )
            self._observability.layout_fixed(fix)
        self._completions.move_finished(req.src, req.dst, req.request_ids, ok=True)

    def _track_batch(
        self,
        batch: PreparedBatch,
        kinds: list[tuple[MoveKind, LayoutFixKind | None] | None],
        outcome: asyncio.Future[Reply],
    ) -> None:
        """Metrics and completions of a batch's items that ran (as `_track` for each)."""
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
                self._observability.move_failed(kind[0], code)
                self._completions.move_finished(
                    move.src, move.dst, move.request_ids, ok=False, dst_ids=item.dst_ids.tolist()
                )
                continue
            assert result is not None
            self._observability.move_done(
                kind[0], move.dst.worker.engine_id, result.nbytes, seconds
            )
            self._observability.layout_fixed(kind[1])
            self._completions.move_finished(move.src, move.dst, move.request_ids, ok=True)
