"""Frame splitting and reply packing of the ZMQ data plane (kvsidecar/peer/zmq_plane.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.peer.messages import ReadData
from kvsidecar.peer.zmq_plane import PACK_BELOW, pack, packable, split_ranges


def test_long_ranges_become_pieces_of_at_most_the_limit() -> None:
    ranges = np.array([[0, 0, 5], [1, 10, 2], [2, 100, 7]], dtype=np.int64)
    dest = np.array([[3, 1000], [4, 0], [5, 7]], dtype=np.int64)
    out, out_dest = split_ranges(ranges, dest, 3)
    assert out.tolist() == [
        [0, 0, 3], [0, 3, 2], [1, 10, 2], [2, 100, 3], [2, 103, 3], [2, 106, 1]
    ]  # fmt: skip
    assert out_dest.tolist() == [[3, 1000], [3, 1003], [4, 0], [5, 7], [5, 10], [5, 13]]
    assert ranges[0, 2] == 5  # the input is left alone


def test_short_ranges_are_returned_as_they_are() -> None:
    ranges = np.array([[0, 0, 5]], dtype=np.int64)
    dest = np.array([[0, 0]], dtype=np.int64)
    assert split_ranges(ranges, dest, 5)[0] is ranges
    empty = np.zeros((0, 3), dtype=np.int64)
    assert split_ranges(empty, np.zeros((0, 2), dtype=np.int64), 5)[0] is empty


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
    st.integers(1, 17),
)
def test_pieces_cover_the_same_bytes_in_order(lengths: list[int], limit: int) -> None:
    offsets = np.cumsum([0, *lengths[:-1]])
    ranges = np.array(
        [[i % 3, o, n] for i, (o, n) in enumerate(zip(offsets, lengths, strict=True))]
    )
    dest = np.array([[i % 2, 7 * o] for i, o in enumerate(offsets)])
    out, out_dest = split_ranges(ranges.astype(np.int64), dest.astype(np.int64), limit)
    assert (out[:, 2] <= limit).all() and (out[:, 2] > 0).all()

    def each_byte(r: np.ndarray, d: np.ndarray) -> list[tuple[int, int, int, int]]:
        """(remote layer, remote offset, local layer, local offset) of every byte, in order."""
        return [
            (int(li), int(o) + k, int(dl), int(do) + k)
            for (li, o, n), (dl, do) in zip(r.tolist(), d.tolist(), strict=True)
            for k in range(n)
        ]

    assert each_byte(out, out_dest) == each_byte(ranges, dest)


def test_only_replies_of_many_small_ranges_are_packed() -> None:
    def frames(*sizes: int) -> list[np.ndarray]:
        return [np.zeros(n, np.uint8) for n in sizes]

    def reply(fs: list[np.ndarray]) -> ReadData:
        return ReadData(id=1, nbytes=sum(f.nbytes for f in fs))

    small = frames(*[32 << 10] * 128)
    assert packable(reply(small), small)
    one = frames(32 << 10)
    assert not packable(reply(one), one), "a single frame gains nothing"
    long = frames(1 << 20, 1 << 20, 1 << 20, 1 << 20)
    assert not packable(reply(long), long)
    edge = frames(PACK_BELOW, PACK_BELOW)
    assert not packable(reply(edge), edge)
    mixed = frames(PACK_BELOW, PACK_BELOW - 2)
    assert packable(reply(mixed), mixed)


def test_a_packed_reply_holds_the_frames_back_to_back_in_order() -> None:
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    spans = [(900, 17), (0, 5), (40000, 333), (12, 1)]
    fs = [source[o : o + n] for o, n in spans]
    out, data = pack(ReadData(id=9, nbytes=356), fs)
    assert out == ReadData(id=9, nbytes=356, packed=True)
    assert len(data) == 1
    assert data[0].tobytes() == b"".join(source[o : o + n].tobytes() for o, n in spans)
    assert not np.shares_memory(data[0], source), "a copy: the budget counts it"
