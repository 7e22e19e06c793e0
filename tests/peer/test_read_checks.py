"""The producer's checks of a peer read (`kvsidecar.peer.zmq_plane.serve_read`), by reference.

A read is served only when every range lies inside its layer buffer and inside the rows of the
request's published blocks, within one block view (K or V of a ``kv_first`` layer). Both ways of
checking are held to it: plain ints for a few ranges, numpy for many (`FEW_RANGES`). The
reference marks the allowed bytes of each view one by one, from the rows torch's own indexing
gives (``t[0, b]``, ``t[b]``), never from the production code's stride arithmetic; a read is
allowed when some view allows every byte of each range. Served bytes are compared with the
tensors'.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.core.layout import describe_tensor
from kvsidecar.memory.base import TensorBuffer
from kvsidecar.node.registry import LayerBuffer
from kvsidecar.peer import zmq_plane
from kvsidecar.peer.messages import PeerError, ReadBlocks, ReadData
from kvsidecar.peer.zmq_plane import serve_read

NUM_BLOCKS = 6
# name: (logical shape, arrangement, rows of block b as torch indexing gives them)
SHAPES: dict[str, tuple[tuple[int, ...], str, Any]] = {
    "kv_first": ((2, NUM_BLOCKS, 2, 1, 4), "kv_first", lambda t, b: [t[0, b], t[1, b]]),
    "blocks_first": ((NUM_BLOCKS, 2, 2, 1, 4), "blocks_first", lambda t, b: [t[b]]),
    "mla": ((NUM_BLOCKS, 2, 8), "mla", lambda t, b: [t[b]]),
}


class Layers:
    """Two layers (of one arrangement, or of two: ``kinds``), filled with distinct bytes, and
    their allowed-byte masks."""

    def __init__(self, *kinds: str) -> None:
        self.tensors = []
        self.layers: dict[str, LayerBuffer] = {}
        self.row_fns = []
        for i, kind in enumerate(kinds * (2 // len(kinds))):
            shape, arrangement, rows = SHAPES[kind]
            t = torch.arange(int(np.prod(shape)), dtype=torch.int16).reshape(shape) * 7 + i
            t = t.view(torch.float16)
            desc = describe_tensor(t, arrangement=arrangement)  # type: ignore[arg-type]
            flat = t.view(-1).view(torch.uint8)
            self.layers[f"l{i}"] = LayerBuffer.map(f"l{i}", desc, TensorBuffer(flat, "shm"))
            self.tensors.append(t)
            self.row_fns.append(rows)

    def rows(self, layer: int, block: int) -> list[torch.Tensor]:
        """The rows of ``block`` in layer ``layer``, as torch's own indexing gives them."""
        return list(self.row_fns[layer](self.tensors[layer], block))

    def allowed(self, layer: int, published: list[int]) -> list[np.ndarray]:
        """Per block view, a mask of the layer's bytes that lie in published blocks' rows."""
        t = self.tensors[layer]
        base = t.data_ptr()
        size = t.numel() * t.element_size()
        views = len(self.rows(layer, 0))
        masks = [np.zeros(size, dtype=bool) for _ in range(views)]
        for b in published:
            for v, row in enumerate(self.rows(layer, b)):
                start = row.data_ptr() - base
                masks[v][start : start + row.numel() * row.element_size()] = True
        return masks

    def reference(self, ranges: list[tuple[int, int, int]], published: list[int]) -> bool:
        for layer, off, n in ranges:
            if not 0 <= layer < len(self.tensors):
                return False
            masks = self.allowed(layer, published)
            size = len(masks[0])
            if off < 0 or n <= 0 or off > size or n > size - off:
                return False
            if not any(m[off : off + n].all() for m in masks):
                return False
        return True

    def serve(
        self, ranges: list[tuple[int, int, int]], published: list[int]
    ) -> tuple[ReadData | PeerError, list[Any]]:
        msg = ReadBlocks(
            id=1, engine_id="p", tp_rank=0, pp_rank=0, request_id="r", layers=["l0", "l1"]
        )
        frame = memoryview(np.array(ranges, dtype="<i8").reshape(-1, 3).tobytes())
        blocks = np.array(sorted(set(published)), dtype=np.int64)
        return serve_read(msg, frame, self.layers, 1 << 10, blocks=blocks)

    def bytes_of(self, layer: int, off: int, n: int) -> bytes:
        return self.tensors[layer].view(-1).view(torch.uint8).numpy()[off : off + n].tobytes()


LAYERS = {kind: Layers(kind) for kind in SHAPES}
# Two layers of different geometry in one read: the checks group ranges by geometry.
LAYERS["kv_first+mla"] = Layers("kv_first", "mla")


@st.composite
def reads(draw: st.DrawFn, kind: str) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Published blocks and 1-4 ranges: most are runs of rows that start at a published block,
    some of them a byte off at either end; the rest anywhere, of any length."""
    layers = LAYERS[kind]
    published = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=NUM_BLOCKS, unique=True))
    nudge = st.sampled_from([0] * 14 + [-1, 1])
    ranges = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 2, 3, 4]))):
        layer = draw(st.sampled_from([0] * 7 + [1] * 7 + [-1, 2]))
        t = layers.tensors[max(0, min(layer, 1))]
        size = t.numel() * t.element_size()
        views = len(layers.rows(max(0, min(layer, 1)), 0))
        row = size // NUM_BLOCKS // views
        if draw(st.integers(0, 5)):
            view = draw(st.integers(0, views - 1))
            block = draw(st.sampled_from(published or [0]))
            run = draw(st.sampled_from([1, 1, 1, 2, 3]))
            off = (view * NUM_BLOCKS + block) * row + draw(nudge)
            n = run * row + draw(nudge)
        else:
            off = draw(st.one_of(st.integers(-3, size + 3), st.just((1 << 63) - 1)))
            n = draw(st.one_of(st.integers(-2, size + 2), st.just((1 << 63) - 1)))
        ranges.append((layer, off, n))
    return ranges, published


@pytest.mark.parametrize("few", [16, 0], ids=["plain ints", "numpy"])
@pytest.mark.parametrize("kind", list(LAYERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_read_is_served_exactly_when_the_reference_allows_it(
    kind: str, few: int, data: Any
) -> None:
    layers = LAYERS[kind]
    ranges, published = data.draw(reads(kind))
    saved, zmq_plane.FEW_RANGES = zmq_plane.FEW_RANGES, few
    try:
        reply, frames = layers.serve(ranges, published)
    finally:
        zmq_plane.FEW_RANGES = saved
    if layers.reference(ranges, published):
        assert isinstance(reply, ReadData), (reply, ranges, published)
        assert reply.nbytes == sum(n for _, _, n in ranges)
        got = [bytes(memoryview(f)) for f in frames]
        assert got == [layers.bytes_of(*r) for r in ranges]
    else:
        assert isinstance(reply, PeerError) and reply.code == "out_of_range", (reply, ranges)
        assert frames == []


def test_runs_of_published_blocks_are_one_range_and_a_gap_refuses_it() -> None:
    layers = LAYERS["kv_first"]
    assert zmq_plane.FEW_RANGES >= 2, "these reads take the plain-int checks"
    row = 2 * 1 * 4 * 2  # block_size x heads x head_size x fp16
    k_run = (0, 1 * row, 3 * row)  # K of blocks 1-3
    v_run = (1, (NUM_BLOCKS + 2) * row, 2 * row)  # V of blocks 2-3
    assert isinstance(layers.serve([k_run, v_run], [1, 2, 3])[0], ReadData)
    refused, _ = layers.serve([k_run], [1, 3])
    assert isinstance(refused, PeerError) and refused.code == "out_of_range"
    # K of the last block and V of the first lie side by side, but in two views.
    across = (0, (NUM_BLOCKS - 1) * row, 2 * row)
    refused, _ = layers.serve([across], list(range(NUM_BLOCKS)))
    assert isinstance(refused, PeerError) and refused.code == "out_of_range"


@pytest.mark.parametrize("few", [16, 0], ids=["plain ints", "numpy"])
def test_one_read_over_layers_of_two_geometries_checks_each_by_its_own(few: int) -> None:
    layers = LAYERS["kv_first+mla"]  # l0: kv_first, 16-byte rows; l1: mla, 32-byte blocks
    saved, zmq_plane.FEW_RANGES = zmq_plane.FEW_RANGES, few
    try:
        allowed, _ = layers.serve([(0, 0, 16), (1, 0, 32), (0, 96, 16)], [0])
        # Block 1 of the mla layer is not published (as a kv_first row it would be block 2-3).
        refused, _ = layers.serve([(0, 0, 16), (1, 32, 32)], [0, 2, 3])
    finally:
        zmq_plane.FEW_RANGES = saved
    assert layers.reference([(0, 0, 16), (1, 0, 32), (0, 96, 16)], [0])
    assert isinstance(allowed, ReadData) and allowed.nbytes == 64
    assert isinstance(refused, PeerError) and refused.code == "out_of_range"
