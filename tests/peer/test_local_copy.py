"""The local plane's copy (`kvsidecar.peer.local._copy_ranges`) against a byte-by-byte reference.

Rows of one length at offsets that are multiples of it go as one numpy gather of records; any
other rows one by one, in pieces. Both must land exactly the bytes a plain slice copy lands, and
stop at the flag.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvsidecar.core.layout import describe_tensor
from kvsidecar.memory.base import TensorBuffer
from kvsidecar.node.registry import LayerBuffer
from kvsidecar.peer import local
from kvsidecar.peer.link import PeerGone

pytestmark = pytest.mark.timeout(60)


def _layers(seed: int, count: int = 3, blocks: int = 64) -> list[LayerBuffer]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        t = torch.randint(-30000, 30000, (2, blocks, 4, 2, 8), generator=gen, dtype=torch.int16)
        t = t.view(torch.float16)
        desc = describe_tensor(t, arrangement="kv_first")
        out.append(
            LayerBuffer.map(f"l{i}", desc, TensorBuffer(t.view(-1).view(torch.uint8), "shm"))
        )
    return out


def _bytes(layer: LayerBuffer) -> np.ndarray:
    return layer.mapped.flat.numpy().copy()


def test_every_kind_of_row_lands_as_a_slice_copy_would() -> None:
    src, dst = _layers(1), _layers(2)
    row = 4 * 2 * 8 * 2  # a block's K (or V) row: 128 bytes
    rng = np.random.default_rng(3)
    groups = [
        # block rows of one length, aligned: copied as records
        [
            (0, int(b) * row, row, 1, int(c) * row)
            for b, c in zip(rng.permutation(64)[:40], rng.permutation(64)[:40], strict=True)
        ],
        # one length, offsets not multiples of it (a head slice): row by row
        [
            (1, int(b) * row + 32, 64, 2, int(c) * row + 16)
            for b, c in zip(rng.permutation(64)[:20], rng.permutation(64)[:20], strict=True)
        ],
        # runs of several lengths
        [(2, 0, 5 * row, 0, 10 * row), (2, 20 * row, 3 * row, 0, 40 * row)],
    ]
    rows = [r for g in groups for r in g]
    ranges = np.array([(s, o, n) for s, o, n, _, _ in rows], dtype=np.int64)
    dest = np.array([(d, o) for _, _, _, d, o in rows], dtype=np.int64)
    want = [_bytes(layer) for layer in dst]
    for s, o, n, d, do in rows:
        want[d][do : do + n] = _bytes(src[s])[o : o + n]
    moved = local._copy_ranges(src, dst, ranges, dest, threading.Event())
    assert moved == int(ranges[:, 2].sum())
    for got, expected in zip(dst, want, strict=True):
        assert np.array_equal(_bytes(got), expected)


def test_a_set_flag_stops_the_copy_before_it_writes() -> None:
    src, dst = _layers(4), _layers(5)
    before = [_bytes(layer) for layer in dst]
    ranges = np.array([(0, 0, 128), (1, 256, 100)], dtype=np.int64)
    dest = np.array([(0, 128), (1, 0)], dtype=np.int64)
    stop = threading.Event()
    stop.set()
    with pytest.raises(PeerGone):
        local._copy_ranges(src, dst, ranges, dest, stop)
    assert all(np.array_equal(_bytes(a), b) for a, b in zip(dst, before, strict=True))
