"""The id checks of moves, fixes, pulls and publishes (kvsidecar/core/mover.py), on each path.

The duplicate-id check: a handful of ids (a Python set), many ids for a small buffer (one flag
per block), and few ids for a large buffer (a sort): each must refuse exactly the id lists that
repeat an id, and name a repeated one. A short move's one-pass check (`fine_small`) must pass
exactly the id lists that the full check (`check_ids`) passes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.core.mover import check_ids, check_unique, fine_small
from kvsidecar.wire.errors import SidecarError


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(0, 300),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_refuses_exactly_the_lists_that_repeat_an_id(
    num_blocks: int, n: int, repeat: bool, rnd: object
) -> None:
    rng = np.random.default_rng(rnd.randrange(1 << 30))  # type: ignore[attr-defined]
    n = min(n, num_blocks)
    ids = rng.choice(num_blocks, n, replace=False).astype("<i4")
    if repeat and n >= 2:
        ids[rng.integers(1, n)] = ids[0]
    repeated = len(set(ids.tolist())) != len(ids)
    if not repeated:
        check_unique(ids, "destination", num_blocks)
        return
    with pytest.raises(SidecarError) as err:
        check_unique(ids, "destination", num_blocks)
    assert err.value.code == "duplicate_destination"
    assert f"destination id {int(ids[0])} appears twice" == err.value.message


@settings(max_examples=500, deadline=None)
@given(st.data(), st.sampled_from([1, 2]), st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_a_short_moves_check_passes_exactly_what_the_full_check_passes(
    data: st.DataObject, ratio: int, src_blocks: int, dst_blocks: int, same: bool
) -> None:
    n_dst = src_blocks if same else dst_blocks
    n = data.draw(st.integers(0, 6))
    # Mostly the right length, ids near both ends of the range: every check gets its cases.
    length = data.draw(st.sampled_from([ratio * n, ratio * n, ratio * n + 1]))
    src = data.draw(st.lists(st.integers(-1, src_blocks), min_size=length, max_size=length))
    dst = data.draw(st.lists(st.integers(-1, n_dst), min_size=n, max_size=n))
    blocks = (src_blocks, n_dst)
    try:
        check_ids(
            np.array(src, "<i8"), np.array(dst, "<i8"), blocks=blocks, ratio=ratio, same_set=same
        )
        passes = True
    except SidecarError:
        passes = False
    fine = fine_small(src, dst, ratio=ratio, blocks=blocks, same_set=same)
    # An empty move passes the full check; the short one leaves it to the full one.
    assert fine == (passes and bool(dst))
