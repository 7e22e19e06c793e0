"""The duplicate-id check of moves and fixes (kvsidecar/daemon/jobs.py), on each of its paths.

A handful of ids (a Python set), many ids for a small buffer (one flag per block), and few ids
for a large buffer (a sort): each must refuse exactly the id lists that repeat an id, and name
a repeated one.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.jobs import _check_unique
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
        _check_unique(ids, "destination", num_blocks)
        return
    with pytest.raises(SidecarError) as err:
        _check_unique(ids, "destination", num_blocks)
    assert err.value.code == "duplicate_destination"
    assert f"destination id {int(ids[0])} appears twice" == err.value.message
