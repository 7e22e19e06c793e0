"""Short plain moves answered in one step: the fast path of the daemon's most frequent command.

Engine workers send 1-block moves by the thousand per second, from synchronous code that waits for
each reply. Through the general path (`Edge._on_message`, `_dispatch`, `Commands._move`,
`jobs.prepare_move`, `Commands._run_job`) such a move cost ~45 µs of Python on the event loop,
twice the sum of its checks, its copy and its reply timed one by one: a `ReplyTo`, a `Job`,
closures, a future and six layers of calls per move (docs/benchmarks.md, round 8).

`ShortMoves._serve_short` answers the moves that need none of that machinery, with the same checks,
the same copy and the same bookkeeping, in one function:

- a `Move` of at most `mover.SMALL_MOVE_IDS` ids per side, no checksum and no CUDA events;
- between two buffer sets whose pair plan is cached and plain (`jobs.plain_pair`: equal block
  sizes, no layout fix, CPU memory), as any earlier move between them with these layers made it;
- copying at most `jobs.INLINE_MAX_BYTES`, on blocks no job in flight touches.

Anything else goes to the general path untouched, and so does every request that fails a check
here. Each check is free of side effects, so the general path runs the request from the start and
answers its error as it always does. A copy that raises is handed on the same way: the general
path copies again (no source block of a plain move is written, so the second copy writes what the
first would have) and reports the failure. tests/test_short_moves.py sends the same requests
through both paths and compares the replies, the bytes, the counters, the metrics and the
completions.
"""

from __future__ import annotations

import logging
import time

import zmq

from kvsidecar.core import copier, mover
from kvsidecar.daemon.commands import Commands
from kvsidecar.daemon.edge import Edge
from kvsidecar.daemon.limits.access import authorize
from kvsidecar.node.jobs import INLINE_MAX_BYTES, fine_small, plain_pair
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import Move, Moved

log = logging.getLogger("kvsidecar.daemon")

_MOVE = str(Move.__struct_config__.tag)
"""The command label of a move (as `Edge._on_message` derives it)."""

_MAX_SHORT_ID_BYTES = 2 * mover.SMALL_MOVE_IDS * 8
"""The most both id frames of a short move can hold (int64 ids; int32 ones take half)."""


class ShortMoves(Edge, Commands):
    """The fast path for short plain moves (a `Daemon` mixin; see the module doc)."""

    short_moves_total = 0
    """Moves answered here (the rest of a move's counts are shared with the general path)."""

    def _serve_short(self, frames: list[zmq.Frame]) -> bool:
        """Answer ``frames`` here if they are a short plain move that passes every check.

        False: nothing was done, and the general path must serve the request.
        """
        try:
            done = self._copy_short(frames)
        except Exception:  # a bug here must not cost the request its answer: the general path
            log.exception("short-move path failed before its reply; the general path serves it")
            return False
        if done is None:
            return False
        ident, req, reply, started = done
        # As `Commands._run_here`: the reply first, then the counts, the metrics, the completions.
        self._send(ident, reply, command=_MOVE, started=started)
        self.short_moves_total += 1
        self._count(reply, req.id)
        self._move_succeeded(req, None, reply)
        return True

    def _copy_short(self, frames: list[zmq.Frame]) -> tuple[bytes, Move, Moved, float] | None:
        """Check a short plain move and copy it; its reply, or None (nothing done)."""
        executor = self._executor
        config = self.config
        if len(frames) != 4 or executor is None or self.draining or not config.short_move_fast_path:
            return None
        started = time.perf_counter()
        header = frames[1]
        id_bytes = len(frames[2]) + len(frames[3])
        # More bytes of ids than a short move's, even as int64: leave before decoding the
        # header, which the general path then does once (decoding twice cost a 16 MiB move's
        # loop ~28 µs, docs/benchmarks.md).
        if id_bytes > _MAX_SHORT_ID_BYTES or self._too_large(len(header), len(header) + id_bytes):
            return None
        ident = frames[0].bytes
        registry = self.registry
        try:
            req = self._decode(header.buffer)
            if type(req) is not Move or req.events is not None:
                return None
            if req.checksum or (req.checksum is None and config.checksum):
                return None
            src_ids = self._ids(frames[2].buffer, req.ids_dtype, "source")
            dst_ids = self._ids(frames[3].buffer, req.ids_dtype, "destination")
            # Long moves leave here before the sender's rights and the buffers are looked up,
            # which the general path then does once.
            if src_ids.size > mover.SMALL_MOVE_IDS or dst_ids.size > mover.SMALL_MOVE_IDS:
                return None
            authorize(self.access, self._principal(ident, header), req)
            src = registry.buffer_set(req.src)
            dst = registry.buffer_set(req.dst)
        except SidecarError:
            return None
        pair = plain_pair(registry, src, dst, req.layers)
        if pair is None or pair.cpu_groups is None:  # `plain_pair` has groups; for the typing
            return None
        src_list, dst_list = src_ids.tolist(), dst_ids.tolist()
        blocks = (pair.src_blocks, pair.dst_blocks)
        if not fine_small(src_list, dst_list, ratio=1, blocks=blocks, same_set=src is dst):
            return None
        if pair.block_bytes * len(src_list) > INLINE_MAX_BYTES:
            return None
        if not executor.free(reads={src.key: src_ids}, writes={dst.key: dst_ids}):
            return None
        copy_started = time.perf_counter()
        nbytes = copier.copy_small(
            pair.cpu_groups, mover.plan_small(src_list, dst_list), pair.block_bytes
        )
        reply = Moved(
            id=req.id,
            blocks=len(dst_list),
            nbytes=nbytes,
            seconds=time.perf_counter() - copy_started,
            fixed=False,
            verified=False,
            invalid_block_ids=[],
        )
        return ident, req, reply, started
