"""Tests for kvsidecar.core.mover and .copier, checked against an independent per-block loop."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.core import copier, mover
from kvsidecar.core.copier import copy_runs
from kvsidecar.core.mover import (
    MoveError,
    Run,
    RunPlan,
    clip_ssm_state_blocks,
    plan_runs,
    validate_move,
)
from kvsidecar.wire.errors import ERROR_CODES

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------------------------
# Independent references: one block at a time, no coalescing, no stacking.
# ---------------------------------------------------------------------------------------------


def naive_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def naive_copy(
    src_views: Sequence[torch.Tensor],
    dst_views: Sequence[torch.Tensor],
    src: Sequence[int],
    dst: Sequence[int],
) -> None:
    for s_view, d_view in zip(src_views, dst_views, strict=True):
        for s, d in zip(src, dst, strict=True):
            # rows may differ in shape (N-D vs 2-D) but not in bytes: copy the flat row
            d_view[d].view(-1).copy_(s_view[s].reshape(-1))


# ---------------------------------------------------------------------------------------------
# Buffer arrangements. Each returns (backing uint8 tensors, per-layer views of `dtype`).
# ---------------------------------------------------------------------------------------------

Arrangement = Callable[
    [int, int, int, torch.dtype, torch.Generator], tuple[list[torch.Tensor], list[torch.Tensor]]
]


def _random_bytes(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def stacked(layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator):
    """All layers in one region, layer-major: (L, B, row)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    base = _random_bytes(layers * blocks * elems * esize, gen)
    typed = base.view(dtype).view(layers, blocks, elems)
    return [base], [typed[i] for i in range(layers)]


def separate(layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator):
    """One tensor per layer, shaped (B, 2, elems // 2) when possible (N-D block views)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    bases = [_random_bytes(blocks * elems * esize, gen) for _ in range(layers)]
    shape = (blocks, 2, elems // 2) if elems % 2 == 0 else (blocks, elems)
    return bases, [b.view(dtype).view(shape) for b in bases]


def kv_interleaved(layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator):
    """Blocks-first per layer, (L, B, 2, row): K and V views with block stride 2 x row, listed
    K0 V0 K1 V1 ... (groups of two stack). ``layers`` counts views, K and V alike."""
    esize = torch.empty(0, dtype=dtype).element_size()
    caches = (layers + 1) // 2
    base = _random_bytes(caches * blocks * 2 * elems * esize, gen)
    typed = base.view(dtype).view(caches, blocks, 2, elems)
    return [base], [typed[i, :, kv] for i in range(caches) for kv in range(2)][:layers]


def kv_interleaved_k_then_v(
    layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator
):
    """As kv_interleaved, listed K0 K1 ... V0 V1 ...: all Ks stack, then all Vs."""
    bases, views = kv_interleaved(2 * ((layers + 1) // 2), blocks, elems, dtype, gen)
    return bases, (views[0::2] + views[1::2])[:layers]


def padded(layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator):
    """Rows followed by 3 elements of padding: block stride > row length, one region."""
    esize = torch.empty(0, dtype=dtype).element_size()
    base = _random_bytes(layers * blocks * (elems + 3) * esize, gen)
    typed = base.view(dtype).view(layers, blocks, elems + 3)
    return [base], [typed[i, :, :elems] for i in range(layers)]


def uneven(layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator):
    """One region, layers at growing gaps: only pairs are equally spaced, so pairs stack."""
    esize = torch.empty(0, dtype=dtype).element_size()
    per = blocks * elems
    gaps = [i * (i + 1) // 2 for i in range(layers)]
    base = _random_bytes((layers * per + gaps[-1]) * esize, gen)
    flat = base.view(dtype)
    return [base], [flat[i * per + gaps[i] :][:per].view(blocks, elems) for i in range(layers)]


ARRANGEMENTS: dict[str, Any] = {
    "stacked": stacked,
    "separate": separate,
    "kv_interleaved": kv_interleaved,
    "kv_k_then_v": kv_interleaved_k_then_v,
    "padded": padded,
    "uneven": uneven,
}


def overlapping_sources(
    layers: int, blocks: int, elems: int, dtype: torch.dtype, gen: torch.Generator
):
    """Source views shifted by one block in one storage: they alias, which reading allows."""
    esize = torch.empty(0, dtype=dtype).element_size()
    base = _random_bytes((blocks + layers) * elems * esize, gen)
    typed = base.view(dtype).view(blocks + layers, elems)
    return [base], [typed[i : i + blocks] for i in range(layers)]


# ---------------------------------------------------------------------------------------------
# Block-id strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def moves(draw: st.DrawFn, src_blocks: int, dst_blocks: int) -> tuple[list[int], list[int]]:
    kind = draw(st.sampled_from(["empty", "random", "sorted", "full", "runs", "dup_src"]))
    limit = min(src_blocks, dst_blocks)
    if kind == "empty":
        return [], []
    if kind == "full":
        ids = list(range(limit))
        return ids, list(ids)
    if kind == "runs":
        src: list[int] = []
        dst: list[int] = []
        free = draw(st.permutations(range(dst_blocks)))
        used = 0
        while used < limit:
            n = draw(st.integers(1, min(6, limit - used)))
            s0 = draw(st.integers(0, src_blocks - n))
            # a destination run: n consecutive ids starting at a free id, if all free
            d0 = free[used] if free[used] + n <= dst_blocks else dst_blocks - n
            cand = list(range(d0, d0 + n))
            if set(cand) & set(dst):
                break
            src += list(range(s0, s0 + n))
            dst += cand
            used += n
        return src, dst
    n = draw(st.integers(1, limit))
    dst = draw(st.permutations(range(dst_blocks)))[:n]
    if kind == "dup_src":
        src = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
    else:
        src = draw(st.permutations(range(src_blocks)))[:n]
    if kind == "sorted":
        src, dst = sorted(src), sorted(dst)
    return src, dst


def as_kind(ids: list[int], kind: str) -> Any:
    if kind == "list":
        return ids
    if kind.startswith("np"):
        return np.asarray(ids, dtype=np.int32 if kind == "np32" else np.int64)
    return torch.tensor(ids, dtype=torch.int32 if kind == "t32" else torch.int64)


ID_KINDS = ["list", "np32", "np64", "t32", "t64"]


# ---------------------------------------------------------------------------------------------
# plan_runs
# ---------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_plan_runs_matches_naive(data: st.DataObject) -> None:
    src, dst = data.draw(moves(data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))))
    kind = data.draw(st.sampled_from(ID_KINDS))
    plan = plan_runs(as_kind(src, kind), as_kind(dst, kind))
    assert [(r.src_start, r.dst_start, r.length) for r in plan] == naive_runs(src, dst)
    assert len(plan) == len(naive_runs(src, dst))
    assert plan.num_blocks == len(src)
    for arr in (plan.src_starts, plan.dst_starts, plan.lengths):
        assert arr.dtype == np.int64


def test_plan_runs_examples() -> None:
    plan = plan_runs([3, 4, 5, 9, 10, 2], [7, 8, 9, 0, 1, 5])
    assert list(plan) == [Run(3, 7, 3), Run(9, 0, 2), Run(2, 5, 1)]
    # a break on either side alone ends a run
    assert list(plan_runs([1, 2, 3], [5, 6, 8])) == [Run(1, 5, 2), Run(3, 8, 1)]
    assert list(plan_runs([1, 2, 4], [5, 6, 7])) == [Run(1, 5, 2), Run(4, 7, 1)]
    # descending ids never merge; repeated sources never merge
    assert len(plan_runs([3, 2, 1], [3, 2, 1])) == 3
    assert len(plan_runs([4, 4], [0, 1])) == 2
    empty = plan_runs([], [])
    assert len(empty) == 0 and empty.num_blocks == 0 and list(empty) == []


def test_plan_runs_int32_edge_does_not_wrap() -> None:
    top = np.iinfo(np.int32).max
    plan = plan_runs(np.array([top - 1, top], np.int32), np.array([0, 1], np.int32))
    assert list(plan) == [Run(top - 1, 0, 2)]


def test_plan_runs_from_raw_frame() -> None:
    frame = np.array([8, 9, 10, 1], dtype="<i4").tobytes()
    ids = np.frombuffer(frame, dtype="<i4")
    assert list(plan_runs(ids, ids)) == [Run(8, 8, 3), Run(1, 1, 1)]


@pytest.mark.parametrize(
    ("src", "dst"),
    [([1, 2], [1]), ([[1, 2]], [[1, 2]]), ([1.5], [1]), (np.array([True]), [1])],
)
def test_plan_runs_rejects_bad_ids(src: Any, dst: Any) -> None:
    with pytest.raises(MoveError) as err:
        plan_runs(src, dst)
    assert err.value.code in {"length_mismatch", "invalid_message"}


# ---------------------------------------------------------------------------------------------
# validate_move
# ---------------------------------------------------------------------------------------------


def test_error_codes_are_protocol_codes() -> None:
    assert set(mover.MoveErrorCode.__args__) <= ERROR_CODES  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ID_KINDS)
def test_validate_move_accepts(kind: str) -> None:
    validate_move(
        as_kind([0, 0, 9], kind), as_kind([3, 2, 1], kind), src_num_blocks=10, dst_num_blocks=4
    )
    validate_move(as_kind([], kind), as_kind([], kind), src_num_blocks=0, dst_num_blocks=0)


@pytest.mark.parametrize(
    ("src", "dst", "kwargs", "code"),
    [
        ([1, 2], [1], {}, "length_mismatch"),
        ([], [0], {}, "length_mismatch"),
        ([10], [0], {}, "out_of_range"),
        ([-1], [0], {}, "out_of_range"),
        ([0], [4], {}, "out_of_range"),
        ([0], [-3], {}, "out_of_range"),
        (np.array([2**63 + 5], dtype=np.uint64), [0], {}, "out_of_range"),
        ([0, 1, 2], [3, 1, 3], {}, "duplicate_destination"),
        ([0, 1], [1, 2], {"aliased": True}, "invalid_message"),
        ([0.0, 1.0], [1, 2], {}, "invalid_message"),
        (torch.tensor([0.0]), [1], {}, "invalid_message"),
        (torch.tensor([True]), [1], {}, "invalid_message"),
        ([[0]], [[1]], {}, "invalid_message"),
        (["a"], [1], {}, "invalid_message"),
        (np.array(3), [1], {}, "invalid_message"),
    ],
)
def test_validate_move_errors(src: Any, dst: Any, kwargs: dict[str, Any], code: str) -> None:
    with pytest.raises(MoveError) as err:
        validate_move(src, dst, src_num_blocks=10, dst_num_blocks=4, **kwargs)
    assert err.value.code == code
    assert isinstance(err.value, ValueError) and str(err.value)


def test_validate_move_aliased_allows_disjoint() -> None:
    validate_move([0, 1], [2, 3], src_num_blocks=4, dst_num_blocks=4, aliased=True)


@settings(max_examples=150, deadline=None)
@given(
    src=st.lists(st.integers(-3, 12), max_size=12),
    dst=st.lists(st.integers(-3, 12), max_size=12),
)
def test_validate_move_agrees_with_definition(src: list[int], dst: list[int]) -> None:
    expected = None
    if len(src) != len(dst):
        expected = "length_mismatch"
    elif any(not 0 <= s < 10 for s in src) or any(not 0 <= d < 8 for d in dst):
        expected = "out_of_range"
    elif len(set(dst)) != len(dst):
        expected = "duplicate_destination"
    try:
        validate_move(src, dst, src_num_blocks=10, dst_num_blocks=8)
    except MoveError as err:
        assert err.code == expected
    else:
        assert expected is None


# ---------------------------------------------------------------------------------------------
# copy_runs
# ---------------------------------------------------------------------------------------------


def _check_copy(
    data: st.DataObject,
    src_arrangement: Any,
    dst_arrangement: Any,
    dtype: torch.dtype,
    threads: int,
) -> None:
    layers = data.draw(st.integers(1, 4), label="layers")
    src_blocks = data.draw(st.integers(1, 24), label="src_blocks")
    dst_blocks = data.draw(st.integers(1, 24), label="dst_blocks")
    elems = data.draw(st.sampled_from([1, 2, 6, 16]), label="elems")
    src, dst = data.draw(moves(src_blocks, dst_blocks), label="ids")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    src_bases, src_views = src_arrangement(layers, src_blocks, elems, dtype, gen)
    dst_bases, dst_views = dst_arrangement(layers, dst_blocks, elems, dtype, gen)
    expected_bases = [b.clone() for b in dst_bases]
    # the same views over the cloned bases (same offsets and strides)
    expected_views = [
        torch.empty(0, dtype=dtype).set_(
            expected_bases[_base_index(dst_bases, v)].untyped_storage(),
            v.storage_offset(),
            v.shape,
            v.stride(),
        )
        for v in dst_views
    ]
    naive_copy(src_views, expected_views, src, dst)
    src_before = [b.clone() for b in src_bases]

    validate_move(src, dst, src_num_blocks=src_blocks, dst_num_blocks=dst_blocks)
    copied = copy_runs(src_views, dst_views, plan_runs(src, dst), threads=threads)

    row_bytes = elems * torch.empty(0, dtype=dtype).element_size()
    assert copied == len(src) * row_bytes * len(src_views)
    for got, want in zip(dst_bases, expected_bases, strict=True):
        assert torch.equal(got, want)  # uint8 backing: every byte, padding included
    for after, before in zip(src_bases, src_before, strict=True):
        assert torch.equal(after, before)


def _base_index(bases: list[torch.Tensor], view: torch.Tensor) -> int:
    ptr = view.untyped_storage().data_ptr()
    return next(i for i, b in enumerate(bases) if b.untyped_storage().data_ptr() == ptr)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_copy_runs_matches_naive(data: st.DataObject) -> None:
    src_arr = data.draw(st.sampled_from(sorted(ARRANGEMENTS)), label="src layout")
    dst_arr = data.draw(st.sampled_from(sorted(ARRANGEMENTS)), label="dst layout")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    _check_copy(data, ARRANGEMENTS[src_arr], ARRANGEMENTS[dst_arr], dtype, threads=1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_copy_runs_threaded_matches_naive(data: st.DataObject) -> None:
    # Force the helper-thread split (normally only for moves of several MiB).
    src_arr = data.draw(st.sampled_from(sorted(ARRANGEMENTS)), label="src layout")
    dst_arr = data.draw(st.sampled_from(sorted(ARRANGEMENTS)), label="dst layout")
    threads = data.draw(st.integers(2, 5), label="threads")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(copier, "_PARALLEL_MIN_BYTES", 0)
        mp.setattr(copier, "_PARALLEL_MIN_CALL_BYTES", 0)
        _check_copy(data, ARRANGEMENTS[src_arr], ARRANGEMENTS[dst_arr], torch.float16, threads)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_copy_runs_from_aliasing_sources(data: st.DataObject) -> None:
    _check_copy(data, overlapping_sources, stacked, torch.float32, threads=1)


@pytest.mark.parametrize(
    ("arrangement", "groups"),
    [
        ("stacked", [4]),
        ("separate", [1, 1, 1, 1]),
        ("kv_interleaved", [2, 2]),
        ("kv_k_then_v", [2, 2]),
        ("padded", [4]),
        ("uneven", [2, 2]),
    ],
)
def test_layer_stacking_is_found(arrangement: str, groups: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    _, views = ARRANGEMENTS[arrangement](4, 8, 16, torch.float16, gen)
    rows = [copier._byte_rows(v, "v") for v in views]
    found = copier._group_views(rows, rows)
    assert [s.layers for s, _ in found] == groups


def test_overlapping_destinations_do_not_stack() -> None:
    # two views one block apart in one storage: they share 7 of their 8 blocks
    base = torch.zeros(10, 4)
    shifted = [copier._byte_rows(base[i : i + 8], "v") for i in range(2)]
    region = torch.zeros(2, 8, 4)
    packed = [copier._byte_rows(region[i], "v") for i in range(2)]
    assert [s.layers for s, _ in copier._group_views(packed, packed)] == [2]
    assert [s.layers for s, _ in copier._group_views(packed, shifted)] == [1, 1]
    # as sources the same views stack: reads may alias
    assert [s.layers for s, _ in copier._group_views(shifted, packed)] == [2]


def test_copy_runs_large_move_uses_threads_and_matches() -> None:
    # 9 MiB in runs of 64 KiB: over the thresholds, so the helper threads take part.
    layers, blocks, elems = 3, 256, 8192
    src = torch.randint(0, 256, (layers, blocks, elems), dtype=torch.uint8)
    dst = torch.zeros(layers, blocks, elems, dtype=torch.uint8)
    ids = np.random.default_rng(1).permutation(blocks)[:192]
    src_ids = np.sort(ids)
    plan = plan_runs(src_ids, ids)
    copied = copy_runs(list(src), list(dst), plan, threads=2)
    assert copied == layers * 192 * elems
    assert torch.equal(dst[:, ids], src[:, src_ids])
    untouched = np.setdiff1d(np.arange(blocks), ids)
    assert not dst[:, untouched].any()


def test_split_blocks_covers_plan_exactly() -> None:
    plan = plan_runs([0, 1, 2, 3, 9, 20, 21], [5, 6, 7, 8, 0, 11, 12])
    for parts in range(1, 9):
        pieces = copier._split_blocks(plan, parts)
        pairs = [
            (s + k, d + k)
            for piece in pieces
            for s, d, n in zip(*piece, strict=True)
            for k in range(n)
        ]
        assert pairs == list(zip([0, 1, 2, 3, 9, 20, 21], [5, 6, 7, 8, 0, 11, 12], strict=True))
        assert all(n > 0 for piece in pieces for n in piece[2])


def test_copy_runs_errors_touch_nothing() -> None:
    src = [torch.ones(4, 8) for _ in range(2)]
    dst = [torch.zeros(4, 8) for _ in range(2)]
    cases: list[tuple[Any, Any, RunPlan, str]] = [
        (src, dst[:1], plan_runs([0], [0]), "incompatible_buffers"),
        (
            src,
            [torch.zeros(4, 8, dtype=torch.float64)] * 2,
            plan_runs([0], [0]),
            "incompatible_buffers",
        ),
        (src, [torch.zeros(4, 4)] * 2, plan_runs([0], [0]), "incompatible_buffers"),
        (src, [torch.zeros(8, 4).t()] * 2, plan_runs([0], [0]), "incompatible_buffers"),
        ([torch.ones(())] * 2, dst, plan_runs([0], [0]), "incompatible_buffers"),
        (src, dst, plan_runs([0, 1, 2, 3], [1, 2, 3, 4]), "out_of_range"),
        (src, dst, plan_runs([3, 4], [0, 1]), "out_of_range"),
        (src, dst, plan_runs([0, -1], [0, 1]), "out_of_range"),
    ]
    for s, d, plan, code in cases:
        with pytest.raises(MoveError) as err:
            copy_runs(s, d, plan)
        assert err.value.code == code
        assert not any(t.any() for t in dst)


def test_copy_runs_empty_and_zero_width() -> None:
    assert copy_runs([torch.ones(4, 8)], [torch.zeros(4, 8)], plan_runs([], [])) == 0
    assert copy_runs([], [], plan_runs([1], [2])) == 0
    assert copy_runs([torch.ones(4, 0)], [torch.zeros(4, 0)], plan_runs([1], [2])) == 0


def test_copy_runs_hnd_view_is_refused() -> None:
    # An HND cache seen through NHD strides: each block's bytes are one contiguous range, but
    # not in the view's element order, so copying it as a byte row would be wrong for a
    # destination with other strides. Such views are for layout.py to turn into byte rows.
    cache = torch.zeros(4, 2, 3, 5)  # (B, H, N, C) memory
    nhd = cache.permute(0, 2, 1, 3)
    with pytest.raises(MoveError) as err:
        copy_runs([nhd], [torch.zeros(4, 3, 2, 5)], plan_runs([0], [0]))
    assert err.value.code == "incompatible_buffers"


def test_copy_runs_into_same_storage_disjoint_blocks() -> None:
    region = torch.arange(2 * 8 * 4, dtype=torch.float32).view(2, 8, 4)
    expected = region.clone()
    naive_copy(list(expected), list(expected), [0, 1, 2], [5, 6, 7])
    validate_move([0, 1, 2], [5, 6, 7], src_num_blocks=8, dst_num_blocks=8, aliased=True)
    copy_runs(list(region), list(region), plan_runs([0, 1, 2], [5, 6, 7]))
    assert torch.equal(region, expected)


@gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("arrangement", ["stacked", "kv_interleaved", "separate"])
def test_copy_runs_cuda(direction: str, arrangement: str) -> None:
    gen = torch.Generator().manual_seed(3)
    src_bases, src_views = ARRANGEMENTS[arrangement](3, 16, 32, torch.bfloat16, gen)
    dst_bases, dst_views = ARRANGEMENTS[arrangement](3, 16, 32, torch.bfloat16, gen)
    dev = torch.device("cuda")

    def move(bases: list[torch.Tensor], views: list[torch.Tensor], to_gpu: bool):
        if not to_gpu:
            return bases, views
        moved = [b.to(dev) for b in bases]
        return moved, [
            torch.empty(0, dtype=v.dtype, device=dev).set_(
                moved[_base_index(bases, v)].untyped_storage(),
                v.storage_offset(),
                v.shape,
                v.stride(),
            )
            for v in views
        ]

    expected = [v.clone() for v in dst_views]
    src, dst = [0, 1, 2, 7, 3], [9, 10, 11, 2, 15]
    naive_copy(src_views, expected, src, dst)
    _, g_src = move(src_bases, src_views, direction in ("d2h", "d2d"))
    _, g_dst = move(dst_bases, dst_views, direction in ("h2d", "d2d"))
    stream = torch.cuda.Stream()
    copy_runs(g_src, g_dst, plan_runs(src, dst), stream=stream)
    for got, want in zip(g_dst, expected, strict=True):
        assert torch.equal(got.cpu(), want)


# ---------------------------------------------------------------------------------------------
# clip_ssm_state_blocks
# ---------------------------------------------------------------------------------------------


def test_clip_ssm_state_blocks_enumerated() -> None:
    for length, spec in itertools.product(range(7), range(9)):
        blocks = [100 + i for i in range(length)]
        got = clip_ssm_state_blocks(blocks, spec)
        if length == 0:
            assert got == []
        elif spec >= length:
            # all but one slot would be scratch: the first slot is the running state
            assert got == [100]
        else:
            # the running state sits just before the `spec` trailing scratch slots
            assert got == [100 + length - 1 - spec]
        assert blocks == [100 + i for i in range(length)]  # input untouched


def test_clip_ssm_state_blocks_rejects_negative() -> None:
    with pytest.raises(ValueError):
        clip_ssm_state_blocks([1, 2], -1)


# --- small moves (`plan_small` / `copy_small`, the daemon's path for a few ids) ---


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=16))
def test_plan_small_matches_plan_runs(pairs: list[tuple[int, int]]) -> None:
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    expected = [(r.src_start, r.dst_start, r.length) for r in mover.plan_runs(src, dst)]
    assert mover.plan_small(src, dst) == expected


def _views(kind: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Three layers' block views (16 blocks of 64 bytes) laid out as ``kind``."""
    if kind == "separate":  # one tensor per layer: nothing stacks
        return [torch.randint(0, 255, (16, 64), dtype=torch.uint8, generator=gen) for _ in range(3)]
    if kind == "one region":  # layers one after another in one storage: one 3-D stack
        region = torch.randint(0, 255, (3, 16, 64), dtype=torch.uint8, generator=gen)
        return list(region.unbind(0))
    # blocks-first K/V: both halves of a block lie inside one block stride (interleaved)
    region = torch.randint(0, 255, (16, 3, 64), dtype=torch.uint8, generator=gen)
    return [region[:, k] for k in range(3)]


@pytest.mark.parametrize("kind", ["separate", "one region", "interleaved"])
@pytest.mark.parametrize(
    ("src_ids", "dst_ids"), [([3, 4, 5, 9, 0], [7, 8, 1, 2, 15]), ([0], [15]), ([6, 7], [6, 7])]
)
def test_copy_small_matches_a_block_by_block_reference(
    kind: str, src_ids: list[int], dst_ids: list[int]
) -> None:
    gen = torch.Generator().manual_seed(len(kind) + len(src_ids))
    src = _views(kind, gen)
    got = _views(kind, gen)
    want = [v.clone() for v in got]
    for s_view, w_view in zip(src, want, strict=True):  # the reference: one block at a time
        for s, d in zip(src_ids, dst_ids, strict=True):
            w_view[d] = s_view[s]
    groups = copier.cpu_groups(src, got)
    assert groups is not None
    if kind == "one region":
        assert len(groups) == 1 and groups[0][0].ndim == 3  # stacked: one copy per run
    copied = copier.copy_small(groups, mover.plan_small(src_ids, dst_ids))
    assert copied == 3 * len(src_ids) * 64
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_cpu_groups_declines_what_copy_runs_would_refuse() -> None:
    a = torch.zeros(16, 64, dtype=torch.uint8)
    assert copier.cpu_groups([a], [torch.zeros(16, 32, dtype=torch.uint8)]) is None
    assert copier.cpu_groups([a], [a, a]) is None
    assert copier.cpu_groups([a[:, ::2]], [torch.zeros(16, 32, dtype=torch.uint8)]) is None


@pytest.mark.parametrize("kind", ["separate", "one region", "interleaved"])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_groups_matches_a_block_by_block_reference(kind: str, threads: int) -> None:
    """A 32 MiB move in runs of 4 (enough to use the helper threads) through prepared groups."""
    gen = torch.Generator().manual_seed(threads)
    blocks, row, layers = 256, 64 << 10, 4
    if kind == "separate":
        src = [
            torch.randint(0, 255, (blocks, row), dtype=torch.uint8, generator=gen) for _ in "abcd"
        ]
        got = [torch.zeros(blocks, row, dtype=torch.uint8) for _ in "abcd"]
    elif kind == "one region":
        src = list(torch.randint(0, 255, (layers, blocks, row), dtype=torch.uint8, generator=gen))
        got = list(torch.zeros(layers, blocks, row, dtype=torch.uint8))
    else:
        src_region = torch.randint(0, 255, (blocks, layers, row), dtype=torch.uint8, generator=gen)
        got_region = torch.zeros(blocks, layers, row, dtype=torch.uint8)
        src = [src_region[:, k] for k in range(layers)]
        got = [got_region[:, k] for k in range(layers)]
    want = [g.clone() for g in got]
    perm = torch.randperm(blocks // 4, generator=gen).tolist()
    src_ids = [4 * p + i for p in perm[:32] for i in range(4)]
    dst_ids = [4 * p + i for p in perm[32:] for i in range(4)]
    for s_view, w_view in zip(src, want, strict=True):  # the reference: one block at a time
        for s, d in zip(src_ids, dst_ids, strict=True):
            w_view[d] = s_view[s]
    groups = copier.cpu_groups(src, got)
    assert groups is not None
    copied = copier.copy_groups(groups, mover.plan_runs(src_ids, dst_ids), threads=threads)
    assert copied == layers * len(src_ids) * row
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
