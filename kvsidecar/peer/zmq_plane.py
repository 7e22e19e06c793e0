"""The built-in data plane: ranges as zero-copy ZeroMQ frames over the peer connection.

Consumer side (`ZmqPlane.read`): a read plan is cut into chunks of about ``chunk_bytes``; each
chunk is one `ReadBlocks` request whose reply frames are received straight into the local
buffers, on the thread of one of the link's data streams (`kvsidecar.peer.streams`: ZeroMQ's
``recv_into``, off the event loop). Up to the link's ``max_in_flight`` chunks are outstanding
at once, spread over its streams, so the producer's sends, the wire and our receives overlap.

Producer side (`serve_read`): the requested ranges are checked against the worker's registered
layers and sent as frames that are views of the mapped memory (``copy=False``): ZeroMQ holds a
reference to each view until it is sent, so the mapping outlives the send even if the worker
unregisters meanwhile. A chunk of many small ranges (single blocks: the ids an engine's
allocator hands out are rarely consecutive) is packed into one frame instead (`packable`,
`pack`): each frame is a send system call on the producer's side and a receive on the
consumer's, which for small blocks costs more than copying the bytes once more.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsidecar.node.registry import LayerBuffer
from kvsidecar.peer.link import Dest
from kvsidecar.peer.messages import PeerError, ReadBlocks, ReadData
from kvsidecar.peer.plan import ReadPlan
from kvsidecar.peer.planes import DataPlane, ReadTarget

_RANGE = np.dtype("<i8")

_np_views: weakref.WeakKeyDictionary[LayerBuffer, npt.NDArray[np.uint8]] = (
    weakref.WeakKeyDictionary()
)
_geometries: weakref.WeakKeyDictionary[LayerBuffer, list[tuple[int, int, int, int]]] = (
    weakref.WeakKeyDictionary()
)

FEW_RANGES = 16
"""A read of at most this many ranges is checked with plain ints (`_check_few`), a larger one
with numpy (`_check_many`): for the few ranges of a chunk of long runs, numpy's per-call cost
would be most of the producer's check (`benchmarks/probes/probe_producer_chunk.py`)."""


def as_bytes(layer: LayerBuffer) -> npt.NDArray[np.uint8]:
    """Return a numpy view of a layer's buffer (cached: slicing numpy is cheaper than torch)."""
    view = _np_views.get(layer)
    if view is None:
        flat = layer.mapped.flat
        if flat.device.type != "cpu":
            raise ValueError("the ZMQ plane moves host memory only; use NIXL for device memory")
        view = flat.numpy()
        _np_views[layer] = view
    return view


FRAME_BYTES = 1 << 20
"""Largest data frame: a longer range is read as several frames. ZeroMQ receives each frame
into memory of its own, which for large frames means fresh pages whose first touch costs more
than the copy, so large frames stream slower than 1 MiB ones (docs/benchmarks.md, "bench peer").
Contiguous blocks make ranges of many MiB (a layer's whole K half), so they are cut here, on the
consumer: the producer sends one frame per requested range, whatever its length."""


PACK_BELOW = 256 << 10
"""A reply is packed when its ranges average fewer bytes than this (`packable`). Each frame costs
the producer one ``send`` in ZeroMQ's I/O thread, so many small frames cost far more CPU than the
same bytes in a few large ones (`benchmarks/probes/probe_producer_chunk.py`; docs/benchmarks.md,
"bench peer")."""


CHUNK_RANGES = 4096
"""Most ranges in one read chunk, whatever their bytes: the producer checks and answers a chunk in
one turn of its event loop, and the consumer makes each chunk's destinations on its own, so a
pull of many tiny ranges costs both loops many short turns, never one long one."""


def packable(reply: ReadData, frames: list[Any]) -> bool:
    """Whether ``reply``'s frames are many and small enough to be sent as one packed frame."""
    return len(frames) > 1 and reply.nbytes < len(frames) * PACK_BELOW


def pack(reply: ReadData, frames: list[Any]) -> tuple[ReadData, list[Any]]:
    """Return ``reply`` saying ``packed`` and one new frame holding ``frames`` back to back."""
    return ReadData(id=reply.id, nbytes=reply.nbytes, packed=True), [np.concatenate(frames)]


def split_ranges(
    ranges: npt.NDArray[np.int64], dest: npt.NDArray[np.int64], limit: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Cut ``(layer, offset, length)`` rows longer than ``limit`` into pieces, ``dest`` alike."""
    n = ranges[:, 2]
    if not len(n) or int(n.max()) <= limit:
        return ranges, dest
    pieces = (n + limit - 1) // limit
    rows = np.repeat(np.arange(len(n)), pieces)
    step = (np.arange(len(rows)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * limit
    out = ranges[rows]  # fancy indexing: copies
    out[:, 1] += step
    out[:, 2] = np.minimum(limit, n[rows] - step)
    out_dest = dest[rows]
    out_dest[:, 1] += step
    return out, out_dest


class ZmqPlane(DataPlane):
    """Consumer side of the ZMQ plane."""

    name = "zmq"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def _chunks(self, ranges: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
        ends = np.cumsum(ranges[:, 2])
        bounds = [0]
        target = self.chunk_bytes
        while bounds[-1] < len(ends):
            base = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
            nxt = int(np.searchsorted(ends, base + target, side="left")) + 1
            nxt = min(nxt, bounds[-1] + CHUNK_RANGES)
            bounds.append(min(max(nxt, bounds[-1] + 1), len(ends)))
        return list(itertools.pairwise(bounds))

    async def read(self, target: ReadTarget, plan: ReadPlan, deadline: float) -> int:
        """Read ``plan`` chunk by chunk, several chunks in flight (see the module doc)."""
        link = target.link
        loop = asyncio.get_running_loop()
        locals_np = [as_bytes(lb) for lb in target.local_layers]
        ranges, dest = split_ranges(plan.ranges, plan.dest, FRAME_BYTES)

        def chunks() -> Iterator[tuple[ReadBlocks, list[Any], list[Dest]]]:
            for lo, hi in self._chunks(ranges):
                rows = ranges[lo:hi]
                # Plain ints (``tolist``): iterating numpy rows makes a numpy scalar per number,
                # which for a chunk of many single blocks costs more than the rest of its request.
                dests: list[Dest] = [
                    locals_np[li][off : off + n]
                    for (li, off), n in zip(dest[lo:hi].tolist(), rows[:, 2].tolist(), strict=True)
                ]
                msg = ReadBlocks(
                    id=link.next_id(),
                    engine_id=target.engine_id,
                    tp_rank=plan.remote_tp_rank,
                    pp_rank=plan.remote_pp_rank,
                    request_id=target.request_id,
                    layers=plan.remote_layers,
                )
                yield msg, [np.ascontiguousarray(rows, dtype=_RANGE)], dests

        # Every chunk is handed over at once, each sent as soon as it is made: the link's
        # streams keep their windows full from their own threads, so no round trip through this
        # loop sits between a reply landing and the next request going out.
        await link.read_all(chunks(), timeout=deadline - loop.time())
        return int(ranges[:, 2].sum())


def serve_read(
    msg: ReadBlocks,
    frame: memoryview,
    layers: dict[str, LayerBuffer],
    max_ranges: int,
    *,
    blocks: npt.NDArray[np.int64],
) -> tuple[ReadData | PeerError, list[Any]]:
    """Check a `ReadBlocks` against a worker's layers; return the reply and its data frames.

    Every range must lie inside its layer buffer and inside the rows of ``blocks``, the
    request's published block ids (sorted, unique): a reader gets what was published, nothing
    next to it.
    """
    if frame.nbytes % (3 * _RANGE.itemsize):
        return _refuse(msg, "bad_message", f"range frame of {frame.nbytes} bytes"), []
    ranges = np.frombuffer(frame, dtype=_RANGE).reshape(-1, 3)
    if len(ranges) > max_ranges:
        return _refuse(msg, "bad_message", f"{len(ranges)} ranges, limit {max_ranges}"), []
    bufs = []
    for name in msg.layers:
        layer = layers.get(name)
        if layer is None:
            return _refuse(msg, "unknown_worker", f"no layer {name!r}"), []
        bufs.append(layer)
    if len(ranges) == 0:
        return ReadData(id=msg.id, nbytes=0), []
    rows: list[list[int]] = ranges.tolist()
    why = check_ranges(ranges, bufs, blocks, rows)
    if why:
        return _refuse(msg, "out_of_range", why), []
    # A chunk usually lies in one or two of the named layers: only those are viewed.
    views: dict[int, Any] = {}
    try:
        for i in {r[0] for r in rows}:
            views[i] = as_bytes(bufs[i])
    except ValueError as exc:
        return _refuse(msg, "unsupported", str(exc)), []
    frames = [views[i][o : o + k] for i, o, k in rows]
    return ReadData(id=msg.id, nbytes=sum(r[2] for r in rows)), frames


def check_ranges(
    ranges: npt.NDArray[np.int64],
    bufs: list[LayerBuffer],
    blocks: npt.NDArray[np.int64],
    rows: list[list[int]] | None = None,
) -> str:
    """Why ``(layer index, offset, length)`` ranges of ``bufs`` may not be read ("": they may).

    Every range must lie inside its layer buffer and inside the rows of ``blocks`` (sorted,
    unique block ids). ``rows``: the same ranges as lists, when the caller has them already.
    """
    if len(ranges) <= FEW_RANGES:
        return _check_few(ranges.tolist() if rows is None else rows, bufs, blocks)
    return _check_many(ranges, bufs, blocks)


_BAD_LAYER = "layer index outside the named layers"
_OUTSIDE_BUFFER = "a range runs outside its layer buffer"
_OUTSIDE_BLOCKS = "a range reaches outside the published blocks"


def _check_many(
    ranges: npt.NDArray[np.int64], bufs: list[LayerBuffer], blocks: npt.NDArray[np.int64]
) -> str:
    """Why ``ranges`` may not be read ("" when they may), with numpy (many ranges)."""
    idx, off, n = ranges[:, 0], ranges[:, 1], ranges[:, 2]
    if idx.min() < 0 or idx.max() >= len(bufs):
        return _BAD_LAYER
    size = np.array([b.mapped.nbytes for b in bufs], dtype=np.int64)[idx]
    # Never ``off + n``: with a length near 2**63 the sum wraps round to a small number.
    if off.min() < 0 or n.min() <= 0 or np.any(off > size) or np.any(n > size - off):
        return _OUTSIDE_BUFFER
    return "" if published_only(ranges, bufs, blocks) else _OUTSIDE_BLOCKS


def _check_few(
    rows: list[list[int]], bufs: list[LayerBuffer], blocks: npt.NDArray[np.int64]
) -> str:
    """`_check_many` with plain ints, range by range, in the same order of checks."""
    if any(not 0 <= r[0] < len(bufs) for r in rows):
        return _BAD_LAYER
    for li, off, n in rows:
        size = bufs[li].mapped.nbytes
        if off < 0 or n <= 0 or off > size or n > size - off:
            return _OUTSIDE_BUFFER
    for li, off, n in rows:
        if not _in_published_rows(_geometry(bufs[li]), off, off + n - 1, blocks):
            return _OUTSIDE_BLOCKS
    return ""


def _geometry(layer: LayerBuffer) -> list[tuple[int, int, int, int]]:
    """``(origin, stride, row, count)`` in bytes of each block view of a layer (cached)."""
    views = _geometries.get(layer)
    if views is None:
        base = layer.mapped.flat.data_ptr()
        views = [
            (v.data_ptr() - base, max(int(v.stride(0)), 1), int(v.shape[1]), int(v.shape[0]))
            for v in layer.block_views
        ]
        _geometries[layer] = views
    return views


def _in_published_rows(
    views: list[tuple[int, int, int, int]],
    start: int,
    last_byte: int,
    blocks: npt.NDArray[np.int64],
) -> bool:
    """Whether bytes ``start..last_byte`` lie in rows of published blocks of one view."""
    for origin, stride, row, count in views:
        if start < origin:
            continue
        first, head = divmod(start - origin, stride)
        last, tail = divmod(last_byte - origin, stride)
        if last >= count or head >= row or tail >= row or (stride != row and first != last):
            continue
        held = bisect.bisect_right(blocks, last) - bisect.bisect_left(blocks, first)
        if held == last - first + 1:
            return True
    return False


def published_only(
    ranges: npt.NDArray[np.int64], layers: list[LayerBuffer], blocks: npt.NDArray[np.int64]
) -> bool:
    """Whether every ``(layer, offset, length)`` range lies inside rows of ``blocks`` only.

    A layer's blocks are rows of its block views (K and V for ``kv_first``), ``stride`` bytes
    apart; a range may span a run of consecutive rows only where the rows are dense (no padding
    in between), and every block of the run must be published. Ranges must already lie inside
    their buffers (no overflow below).

    The ranges are checked together per distinct geometry of the layers they name (an engine's
    layers usually share one), so the cost grows with the ranges, not ranges times layers.
    """
    idx = ranges[:, 0]
    used = np.flatnonzero(np.bincount(idx, minlength=len(layers))).tolist()
    groups: dict[tuple[tuple[int, int, int, int], ...], list[int]] = {}
    for li in used:
        groups.setdefault(tuple(_geometry(layers[li])), []).append(li)
    if len(groups) == 1:
        ((views, _),) = groups.items()
        return bool(_inside_rows(ranges[:, 1], ranges[:, 2], views, blocks).all())
    group_of = np.zeros(len(layers), dtype=np.int64)
    for g, members in enumerate(groups.values()):
        group_of[members] = g
    gid = group_of[idx]
    for g, views in enumerate(groups):
        mine = gid == g
        if not _inside_rows(ranges[mine, 1], ranges[mine, 2], views, blocks).all():
            return False
    return True


def _inside_rows(
    start: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    views: tuple[tuple[int, int, int, int], ...],
    blocks: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    """Per range of one layer geometry: whether it lies in rows of published blocks of a view."""
    last_byte = start + length - 1
    hit = np.zeros(len(start), dtype=bool)
    # held[b]: published blocks below b. A run first..last is all published when it holds
    # last - first + 1 of them: two lookups a range (a binary search each cost 30 times more).
    ceiling = max(count for _, _, _, count in views)
    held = np.zeros(ceiling + 1, dtype=np.int64)
    np.cumsum(np.bincount(blocks[blocks < ceiling], minlength=ceiling), out=held[1:])
    for origin, stride, row, count in views:
        first, last = (start - origin) // stride, (last_byte - origin) // stride
        ok = (start >= origin) & (last < count)
        ok &= (start - origin - first * stride < row) & (last_byte - origin - last * stride < row)
        if stride != row:
            ok &= first == last
        inside = held[np.clip(last + 1, 0, ceiling)] - held[np.clip(first, 0, ceiling)]
        hit |= ok & (inside == last - first + 1)
    return hit


def _refuse(msg: ReadBlocks, code: Any, message: str) -> PeerError:
    return PeerError(id=msg.id, code=code, message=message)
