"""The built-in data plane: ranges as zero-copy ZeroMQ frames over the peer connection.

Consumer side (`ZmqPlane.read`): a read plan is cut into chunks of about ``chunk_bytes``; each
chunk is one `ReadBlocks` request whose reply frames are received straight into the local
buffers (`PeerLink` uses ``recv_into``). Up to the link's ``max_in_flight`` chunks are
outstanding at once, so the producer's sends, the wire and our receives overlap.

Producer side (`serve_read`): the requested ranges are checked against the worker's registered
layers and sent as frames that are views of the mapped memory (``copy=False``): ZeroMQ holds a
reference to each view until it is sent, so the mapping outlives the send even if the worker
unregisters meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsidecar.peer.link import Dest, PeerGone
from kvsidecar.peer.messages import PeerError, ReadBlocks, ReadData
from kvsidecar.peer.plan import ReadPlan
from kvsidecar.peer.planes import DataPlane, ReadTarget
from kvsidecar.registry import LayerBuffer

_RANGE = np.dtype("<i8")

_np_views: weakref.WeakKeyDictionary[LayerBuffer, npt.NDArray[np.uint8]] = (
    weakref.WeakKeyDictionary()
)


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


class ZmqPlane(DataPlane):
    """Consumer side of the ZMQ plane."""

    name = "zmq"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def _chunks(self, plan: ReadPlan) -> list[tuple[int, int]]:
        ends = np.cumsum(plan.ranges[:, 2])
        bounds = [0]
        target = self.chunk_bytes
        while bounds[-1] < len(ends):
            base = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
            nxt = int(np.searchsorted(ends, base + target, side="left")) + 1
            bounds.append(min(max(nxt, bounds[-1] + 1), len(ends)))
        return list(itertools.pairwise(bounds))

    async def read(self, target: ReadTarget, plan: ReadPlan, deadline: float) -> int:
        """Read ``plan`` chunk by chunk, several chunks in flight (see the module doc)."""
        link = target.link
        loop = asyncio.get_running_loop()
        locals_np = [as_bytes(lb) for lb in target.local_layers]

        async def one(lo: int, hi: int) -> int:
            rows = plan.ranges[lo:hi]
            dest_rows = plan.dest[lo:hi]
            dests: list[Dest] = [
                locals_np[int(li)][int(off) : int(off) + int(n)]
                for (li, off), n in zip(dest_rows, rows[:, 2], strict=True)
            ]
            msg = ReadBlocks(
                id=link.next_id(),
                engine_id=target.engine_id,
                tp_rank=plan.remote_tp_rank,
                pp_rank=plan.remote_pp_rank,
                request_id=target.request_id,
                layers=plan.remote_layers,
            )
            async with link.slots:
                reply = await link.request(
                    msg,
                    [np.ascontiguousarray(rows, dtype=_RANGE)],
                    dests,
                    timeout=deadline - loop.time(),
                )
            if not isinstance(reply, ReadData):
                raise PeerGone(f"unexpected {type(reply).__name__} to a read")
            return int(rows[:, 2].sum())

        tasks = [asyncio.ensure_future(one(lo, hi)) for lo, hi in self._chunks(plan)]
        try:
            return sum(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def serve_read(
    msg: ReadBlocks, frame: memoryview, layers: dict[str, LayerBuffer], max_ranges: int
) -> tuple[ReadData | PeerError, list[Any]]:
    """Check a `ReadBlocks` against a worker's layers; return the reply and its data frames."""
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
    idx, off, n = ranges[:, 0], ranges[:, 1], ranges[:, 2]
    sizes = np.array([b.mapped.nbytes for b in bufs], dtype=np.int64)
    if idx.min() < 0 or idx.max() >= len(bufs):
        return _refuse(msg, "out_of_range", "layer index outside the named layers"), []
    if off.min() < 0 or n.min() <= 0 or np.any(off + n > sizes[idx]):
        return _refuse(msg, "out_of_range", "a range runs outside its layer buffer"), []
    try:
        views = [as_bytes(b) for b in bufs]
    except ValueError as exc:
        return _refuse(msg, "unsupported", str(exc)), []
    frames = [views[i][o : o + k] for i, o, k in ranges.tolist()]
    return ReadData(id=msg.id, nbytes=int(n.sum())), frames


def _refuse(msg: ReadBlocks, code: Any, message: str) -> PeerError:
    return PeerError(id=msg.id, code=code, message=message)
