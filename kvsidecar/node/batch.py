"""A `MoveBatch` checked item by item and run as one copy job.

`prepare_batch` slices the batch's two id frames by item, checks each item as a `Move` of its
own (`kvsidecar.node.jobs.prepare_move`: a typed error per item that fails, the others go on),
and joins the items that pass into one `Job`: one hand-off to a copy thread for the whole batch,
its blocks claimed at once (so it is ordered against other commands like one big move), its
items run in order. `PreparedBatch.reply` builds the `MovedBatch` once the job has run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from kvsidecar.node.jobs import Job, prepare_move
from kvsidecar.node.registry import Registry
from kvsidecar.wire.batch import MoveBatch, MovedBatch, MoveItem, MoveResult
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import Move

log = logging.getLogger("kvsidecar.daemon")


@dataclass(eq=False)
class BatchItem:
    """One item of a batch: its move and ids, and its job (None when it failed its checks)."""

    item: MoveItem
    move: Move
    dst_ids: IdArray
    job: Job | None
    result: MoveResult | None = None
    """Set by its check (a failure) or once the batch ran."""


@dataclass(eq=False)
class PreparedBatch:
    """A checked batch: its items and the one job that runs those that passed."""

    items: list[BatchItem]
    job: Job
    started: float = field(default_factory=time.perf_counter)

    def reply(self, request_id: int) -> MovedBatch:
        """Return the reply once `job` has run (called on the copy thread or the loop)."""
        return MovedBatch(
            id=request_id,
            results=[it.result or MoveResult() for it in self.items],
            seconds=time.perf_counter() - self.started,
        )


def prepare_batch(
    registry: Registry, req: MoveBatch, src_ids: IdArray, dst_ids: IdArray, *, checksum: bool
) -> PreparedBatch:
    """Check every item (see the module doc); raises `SidecarError` for the batch as a whole."""
    if any(it.num_src < 0 or it.num_dst < 0 for it in req.items):
        raise SidecarError("invalid_message", "negative id counts in a batch item")
    if (
        sum(it.num_src for it in req.items) != src_ids.size
        or sum(it.num_dst for it in req.items) != dst_ids.size
    ):
        raise SidecarError("length_mismatch", "batch item id counts do not match the id frames")
    src_parts = _split(src_ids, [it.num_src for it in req.items])
    dst_parts = _split(dst_ids, [it.num_dst for it in req.items])
    items = []
    for item, s, d in zip(req.items, src_parts, dst_parts, strict=True):
        move = Move(
            id=req.id,
            src=item.src,
            dst=item.dst,
            layers=item.layers,
            ids_dtype=req.ids_dtype,
            request_ids=item.request_ids,
            checksum=req.checksum,
        )
        try:
            job: Job | None = prepare_move(registry, move, s, d, checksum=checksum)
            failed = None
        except SidecarError as exc:
            job, failed = None, MoveResult(error_code=exc.code, error=exc.message)
        items.append(BatchItem(item, move, d, job, failed))
    return PreparedBatch(items, _joined(items))


def _split(ids: IdArray, counts: list[int]) -> list[IdArray]:
    """``ids`` cut into consecutive slices of ``counts`` ids (none for no counts)."""
    if not counts:
        return []
    return np.split(ids, np.cumsum(counts, dtype=np.int64)[:-1])


def _joined(items: list[BatchItem]) -> Job:
    """One job running every checked item in order; each item's outcome lands in its result."""
    jobs = [it for it in items if it.job is not None]
    reads: dict[Hashable, list[IdArray]] = {}
    writes: dict[Hashable, list[IdArray]] = {}
    for it in jobs:
        assert it.job is not None
        for key, ids in it.job.reads.items():
            reads.setdefault(key, []).append(ids.astype(np.int64))
        for key, ids in it.job.writes.items():
            writes.setdefault(key, []).append(ids.astype(np.int64))

    def run() -> int:
        total = 0
        for it in jobs:
            assert it.job is not None
            try:
                nbytes = it.job.run()
            except Exception as exc:  # this item failed; the others still run
                log.error("batch item failed", exc_info=exc)
                it.result = MoveResult(error_code="internal", error=f"{type(exc).__name__}: {exc}")
                continue
            check = it.job.verification
            it.result = MoveResult(
                blocks=it.job.blocks,
                nbytes=nbytes,
                fixed=it.job.fixed,
                verified=check is not None and check.verified,
                invalid_block_ids=[] if check is None else check.invalid_block_ids,
            )
            total += nbytes
        return total

    return Job(
        reads={k: np.concatenate(v) for k, v in reads.items()},
        writes={k: np.concatenate(v) for k, v in writes.items()},
        run=run,
        blocks=sum(it.job.blocks for it in jobs if it.job is not None),
        fixed=any(it.job.fixed for it in jobs if it.job is not None),
        workers=frozenset().union(*(it.job.workers for it in jobs if it.job is not None)),
    )
