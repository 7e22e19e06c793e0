"""A pull from this very daemon: both engines on one node, one daemon, no socket in between.

A disaggregated prefill whose prefill and decode engines share a daemon needs the same steps as
a pull from another node (handshake, compatibility check, plan with its TP, block-size and layout
fixes, completion, the producer's notification), only the bytes do not travel: they are copied
from the producer's registered memory into the consumer's. So a `Pull` whose
``remote_endpoint`` is empty runs `kvsidecar.peer.pull.PeerPull` unchanged over:

- `LocalLink`: the "connection" to ourselves. A handshake is answered by this daemon's own
  `PeerService` (the welcome another node would get), a notification goes straight to its
  producer side;
- `LocalPlane`: the data plane that copies a read plan's byte ranges between two mappings of
  this daemon, on the copy executor.

Only published requests are read (`kvsidecar.peer.producer.Producer.readable`): the producer said
these blocks may go to a consumer, and they are held until read or until the lease ends. Who may
pull locally from whom is decided before (`kvsidecar.daemon.limits.access`: the same user only).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.registry import LayerBuffer, Registry
from kvsidecar.peer.link import Dest, PeerGone, PeerLink, PeerRefused
from kvsidecar.peer.messages import (
    Notify,
    PeerError,
    PeerHello,
    PeerReply,
    PeerRequest,
    PeerWelcome,
)
from kvsidecar.peer.plan import ReadPlan
from kvsidecar.peer.planes import DataPlane, ReadTarget
from kvsidecar.peer.producer import Producer
from kvsidecar.peer.zmq_plane import as_bytes, check_ranges

LOCAL_PLANE = "local"
"""`Pulled.plane` of a pull served by this daemon itself."""


class LocalLink(PeerLink):
    """The daemon as its own peer (see the module doc): no socket, no task, never drops."""

    def __init__(
        self,
        welcome: Callable[[PeerHello], PeerWelcome | PeerError],
        on_notify: Callable[[Notify], None],
    ) -> None:  # no super(): there is no socket
        """Answer handshakes with ``welcome``; hand notifications to ``on_notify``.

        ``welcome``: this daemon's answer to a handshake (`PeerService.welcome`); ``on_notify``:
        its producer side's (`kvsidecar.peer.producer.Producer.on_notify`).
        """
        self.endpoint = ""
        self.closed = False
        self._connected = True  # `connected` stays true: no stream can break
        self._streams = []
        self.lost = False
        self._welcome = welcome
        self._on_notify = on_notify
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """Return a fresh request id."""
        return next(self._ids)

    async def request(
        self,
        msg: PeerRequest,
        frames: Sequence[Any] = (),
        dests: Sequence[Dest] = (),
        *,
        timeout: float,
    ) -> PeerReply:
        """Answer a handshake the way this daemon answers other nodes; nothing else is asked."""
        if not isinstance(msg, PeerHello):
            raise PeerGone(f"a local link carries handshakes and notifications, not {msg!r}")
        reply = self._welcome(msg)
        if isinstance(reply, PeerError):
            raise PeerRefused(reply)
        return reply

    async def send(self, msg: PeerRequest) -> None:
        """Hand a consumer's notification to this daemon's producer side."""
        if isinstance(msg, Notify):
            self._on_notify(msg)

    def fail_all(self, exc: Exception) -> None:
        """Nothing is ever in flight on a local link."""

    async def close(self) -> None:
        """Nothing to close; the link stays usable."""


class LocalPlane(DataPlane):
    """Copies a read plan's ranges from a producer's mapped layers into ours (executor)."""

    name = LOCAL_PLANE

    def __init__(self, producer: Producer, registry: Registry, executor: CopyExecutor) -> None:
        self._producer = producer
        self._registry = registry
        self._executor = executor

    async def read(self, target: ReadTarget, plan: ReadPlan, deadline: float) -> int:
        """Copy every range of ``plan`` by ``deadline``.

        The same checks as a read served to another node (`kvsidecar.peer.zmq_plane.serve_read`):
        the request is published and within its lease, and every range lies inside the blocks it
        was published with. The range check runs with the copy, on a copy thread: its cost grows
        with the plan, which the event loop must not pay.
        """
        blocks = self._producer.readable(target.engine_id, target.request_id)
        if isinstance(blocks, PeerError):
            raise PeerRefused(blocks)
        worker = self._registry.rank_worker(
            target.engine_id, plan.remote_tp_rank, plan.remote_pp_rank
        )
        if worker is None:
            raise PeerGone(f"producer rank tp{plan.remote_tp_rank} of {target.engine_id} is gone")
        sources = [worker.device.layers[name] for name in plan.remote_layers]
        stop = threading.Event()

        def copy() -> int:
            # In slices: each numpy call holds the GIL, which the event loop waits for.
            for first in range(0, len(plan.ranges), _ROWS):
                why = check_ranges(plan.ranges[first : first + _ROWS], sources, blocks)
                if why:
                    raise PeerRefused(PeerError(id=0, code="out_of_range", message=why))
            return _copy_ranges(sources, target.local_layers, plan.ranges, plan.dest, stop)

        loop = asyncio.get_running_loop()
        job = self._executor.submit(copy, reads={}, writes={})
        try:
            return await asyncio.wait_for(asyncio.shield(job), max(deadline - loop.time(), 0.001))
        except (TimeoutError, asyncio.TimeoutError):
            # The copy stops at its next chunk; the read fails only once it has, so that nothing
            # writes the destination after the pull reported its blocks invalid.
            stop.set()
            with contextlib.suppress(Exception):
                await job
            raise PeerGone("local copy did not finish before the pull's deadline") from None


_CHUNK = 4 << 20
"""Bytes a local copy moves between two looks at its stop flag."""
_ROWS = 1 << 16
"""Ranges checked, or turned into Python ints, at a time: a plan of millions would take
gigabytes of ints at once, and one numpy call over all of it would hold the GIL for seconds."""


def _copy_ranges(
    sources: list[LayerBuffer],
    targets: list[LayerBuffer],
    ranges: npt.NDArray[np.int64],
    dest: npt.NDArray[np.int64],
    stop: threading.Event,
) -> int:
    """Copy ``(source layer, offset, length)`` rows to ``(target layer, offset)``; bytes moved.

    Stops (and raises `PeerGone`) at the first chunk after ``stop`` is set.
    """
    src: list[npt.NDArray[np.uint8]] = [as_bytes(b) for b in sources]
    dst: list[npt.NDArray[np.uint8]] = [as_bytes(b) for b in targets]
    total = since = 0  # bytes copied; since the last look at the stop flag
    for first in range(0, len(ranges), _ROWS):
        rows, dests = ranges[first : first + _ROWS], dest[first : first + _ROWS]
        for r, d in _runs_of_one_pair(rows, dests):
            n = _record_length(r, d)
            # Records: a numpy call per _CHUNK bytes, each followed by a look at the flag.
            for at in range(0, len(r) if n else 0, max(1, _CHUNK // max(n, 1))):
                if stop.is_set():
                    raise PeerGone("local copy stopped at the pull's deadline")
                piece = slice(at, at + max(1, _CHUNK // n))
                _copy_records(src[int(r[0, 0])], dst[int(d[0, 0])], r[piece], d[piece], n)
                total += n * len(r[piece])
            if n:
                continue
            for (si, so, n), (di, do) in zip(r.tolist(), d.tolist(), strict=True):
                for at in range(0, n, _CHUNK):
                    if since >= _CHUNK:
                        if stop.is_set():
                            raise PeerGone("local copy stopped at the pull's deadline")
                        since = 0
                    size = min(_CHUNK, n - at)
                    np.copyto(dst[di][do + at : do + at + size], src[si][so + at : so + at + size])
                    since += size
                    total += size
    return total


_RECORD_MAX = 64 << 10
"""Ranges up to this length, all of one length, are copied as records (`_copy_records`)."""


def _runs_of_one_pair(
    rows: npt.NDArray[np.int64], dests: npt.NDArray[np.int64]
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """Cut rows into runs that read one source layer and write one target layer.

    Plans keep a layer's rows together: a run per layer and side.
    """
    change = (np.diff(rows[:, 0]) != 0) | (np.diff(dests[:, 0]) != 0)
    cuts = [0, *(np.flatnonzero(change) + 1).tolist(), len(rows)]
    return [(rows[a:b], dests[a:b]) for a, b in itertools.pairwise(cuts) if b > a]


def _record_length(rows: npt.NDArray[np.int64], dests: npt.NDArray[np.int64]) -> int:
    """Return the length ``n`` of rows that can be copied as ``n``-byte records, else 0.

    They can when they all have one length ``n`` (at most `_RECORD_MAX`) and every offset on
    both sides is a multiple of it (block rows are, at their row length): the buffers are then
    arrays of ``n``-byte records, and a copy is one numpy call, not a Python step per row.
    """
    n = int(rows[0, 2])
    if n > _RECORD_MAX or not (rows[:, 2] == n).all():
        return 0
    if (rows[:, 1] % n).any() or (dests[:, 1] % n).any():
        return 0
    return n


def _copy_records(
    src: npt.NDArray[np.uint8],
    dst: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.int64],
    dests: npt.NDArray[np.int64],
    n: int,
) -> None:
    """Copy rows of `_record_length` ``n`` as one gather and scatter of ``n``-byte records."""
    record = np.dtype((np.void, n))
    src_records = src[: src.size // n * n].view(record)
    dst_records = dst[: dst.size // n * n].view(record)
    dst_records[dests[:, 1] // n] = src_records[rows[:, 1] // n]
