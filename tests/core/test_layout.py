"""Tests of kvsidecar.core.layout and .fixes against independent references written as loops.

Every expectation here is built element by element from offsets the tests compute themselves:
where a K/V region starts, where token n / head h / channel c sits in NHD or HND memory. The
reference receive fixes are the seed's three ``kv_postprocess_*`` functions transcribed into loops.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsidecar.core.fixes as fixes_module
from kvsidecar.core.fixes import fix_received
from kvsidecar.core.layout import (
    LayoutError,
    block_bytes,
    block_len,
    block_views,
    buffer_nbytes,
    describe_tensor,
    head_slice,
    head_slice_target,
    heads_of_rank,
    logical_shape,
    memory_shape,
    torch_dtype,
    view_buffer,
)
from kvsidecar.wire.types import BufferDescriptor

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
RATIOS = [1, 2, 4, 8, 16]
ARRANGEMENTS = ["kv_first", "blocks_first", "split", "mla"]
LAYOUTS = ["NHD", "HND"]
PROPS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


# --------------------------------------------------------------------------------------------
# Independent model of the memory: offsets written out by hand
# --------------------------------------------------------------------------------------------


def regions_per_block(arr: str) -> int:
    return 2 if arr in ("kv_first", "blocks_first") else 1


def region_elems(n: int, h: int, c: int) -> int:
    return n * h * c


def region_start(arr: str, b: int, kv: int, num_blocks: int, elems: int) -> int:
    """Element offset of block b's K (kv=0) or V (kv=1) region in the whole buffer."""
    if arr == "kv_first":
        return kv * num_blocks * elems + b * elems
    if arr == "blocks_first":
        return (b * 2 + kv) * elems
    return b * elems


def in_region(layout: str, n: int, h: int, c: int, nn: int, hh: int, cc: int) -> int:
    """Element offset of (token n, head h, channel c) inside a region of nn tokens, hh heads."""
    if layout == "NHD":
        return (n * hh + h) * cc + c
    return (h * nn + n) * cc + c


def random_ints(numel: int, itemsize: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bits = 8 * itemsize
    low, high = (0, 256) if itemsize == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    return torch.randint(low, high, (numel,), generator=gen, dtype=torch.int64).to(INT_OF[itemsize])


def make_cache(
    arr: str,
    layout: str,
    nb: int,
    n: int,
    h: int,
    c: int,
    dtype: torch.dtype,
    *,
    shape_order: str = "NH",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (flat integer storage, engine tensor over it) built without the code under test."""
    if arr == "mla":
        h = 1
    itemsize = torch.empty(0, dtype=dtype).element_size()
    storage = random_ints(nb * regions_per_block(arr) * n * h * c, itemsize, seed)
    if arr == "mla":
        region: tuple[int, ...] = (n, c)
    else:
        region = (n, h, c) if layout == "NHD" else (h, n, c)
    outer = {"kv_first": (2, nb), "blocks_first": (nb, 2), "split": (nb,), "mla": (nb,)}[arr]
    t = storage.view(*outer, *region)
    heads_first_in_shape = shape_order == "HN"
    if arr != "mla" and (layout == "HND") != heads_first_in_shape:
        t = t.transpose(-3, -2)
    return storage, t.view(dtype)


def as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF[t.element_size()])


PATHS = ["vectorised", "per_block"]


@contextlib.contextmanager
def fix_path(path: str) -> Iterator[None]:
    """Force one of fix_received's two CPU strategies (normally chosen by block size)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fixes_module, "_PER_BLOCK_MIN_BYTES", 0 if path == "per_block" else 1 << 62)
        yield


# --------------------------------------------------------------------------------------------
# Reference receive fixes in loop form
# --------------------------------------------------------------------------------------------


def loop_fix(
    old: list[int],
    arr: str,
    ids: list[int],
    nb: int,
    n: int,
    h: int,
    c: int,
    *,
    remote: str,
    local: str,
    ratio: int,
) -> list[int]:
    """Storage after the fix: local token r*rn+m comes from remote block r's (m, h, c)."""
    if arr == "mla":
        h = 1
    new = list(old)
    rn = n // ratio
    elems = region_elems(n, h, c)
    for b in ids:
        for kv in range(regions_per_block(arr)):
            base = region_start(arr, b, kv, nb, elems)
            for r in range(ratio):
                for m in range(rn):
                    for hh in range(h):
                        for cc in range(c):
                            src = base + r * rn * h * c + in_region(remote, m, hh, cc, rn, h, c)
                            dst = base + in_region(local, r * rn + m, hh, cc, n, h, c)
                            new[dst] = old[src]
    return new


def seed_layout_on_receive(cache: torch.Tensor, ids: list[int]) -> None:
    """kv_postprocess_layout_on_receive, in loops: an NHD block read as (H, N, C), transposed."""
    for i in ids:
        halves = [cache[i]] if cache.dim() == 4 else [cache[i, 0], cache[i, 1]]
        for blk in halves:
            nn, hh, cc = blk.shape
            flat = blk.flatten().tolist()  # logical order: what reshape sees
            new = [[[0] * cc for _ in range(hh)] for _ in range(nn)]
            for h in range(hh):
                for n in range(nn):
                    for c in range(cc):
                        new[n][h][c] = flat[(h * nn + n) * cc + c]
            blk.copy_(torch.tensor(new, dtype=blk.dtype))


def seed_blksize_on_receive(
    cache: torch.Tensor, ids: list[int], ratio: int, memory_order: str
) -> None:
    """kv_postprocess_blksize_on_receive (an HND cache, given as (B, N, H, C)) and
    kv_postprocess_blksize_and_layout_on_receive (an NHD cache), in loops.

    Both read a received block's values in memory order ((H, N, C) or (N, H, C)) as ``ratio``
    remote HND blocks of (H, N / ratio, C), one after the other, and put token ``r * rn + m`` of
    head ``h`` where remote block ``r``'s token ``m`` of head ``h`` was.
    """
    for i in ids:
        blk = cache[i]
        nn, hh, cc = blk.shape
        rn = nn // ratio
        in_memory = blk.permute(1, 0, 2) if memory_order == "HND" else blk
        flat = in_memory.flatten().tolist()
        new: list[list[list[Any]]] = [[[0] * cc for _ in range(hh)] for _ in range(nn)]
        for r in range(ratio):
            for h in range(hh):
                for m in range(rn):
                    for c in range(cc):
                        new[r * rn + m][h][c] = flat[((r * hh + h) * rn + m) * cc + c]
        blk.copy_(torch.tensor(new, dtype=blk.dtype))


# --------------------------------------------------------------------------------------------
# Descriptor helpers
# --------------------------------------------------------------------------------------------


def desc_of(arr: str, layout: str, dtype: torch.dtype, nb: int, n: int, h: int, c: int) -> Any:
    name = str(dtype).removeprefix("torch.")
    if arr == "mla":
        return BufferDescriptor("mla", "NHD", name, nb, n, 1, c)
    return BufferDescriptor(arr, layout, name, nb, n, h, c)  # type: ignore[arg-type]


def test_torch_dtype() -> None:
    assert torch_dtype("float16") is torch.float16
    assert torch_dtype("bfloat16") is torch.bfloat16
    for bad in ("float17", "Tensor", "", "_C"):
        with pytest.raises(LayoutError, match="unknown dtype"):
            torch_dtype(bad)


def test_sizes_and_shapes() -> None:
    d = BufferDescriptor("kv_first", "HND", "float16", 10, 16, 4, 8)
    assert logical_shape(d) == (2, 10, 16, 4, 8)
    assert memory_shape(d) == (2, 10, 4, 16, 8)
    assert block_len(d) == 16 * 4 * 8 * 2
    assert block_bytes(d) == 2 * block_len(d)
    assert buffer_nbytes(d) == 10 * 2 * 16 * 4 * 8 * 2
    d = BufferDescriptor("blocks_first", "NHD", "float32", 3, 4, 2, 5)
    assert logical_shape(d) == memory_shape(d) == (3, 2, 4, 2, 5)
    assert block_bytes(d) == 2 * 4 * 2 * 5 * 4
    d = BufferDescriptor("split", "HND", "bfloat16", 3, 4, 2, 5)
    assert logical_shape(d) == (3, 4, 2, 5) and memory_shape(d) == (3, 2, 4, 5)
    assert block_bytes(d) == block_len(d) == 4 * 2 * 5 * 2
    d = BufferDescriptor("mla", "NHD", "uint8", 3, 4, 1, 5)
    assert logical_shape(d) == memory_shape(d) == (3, 4, 5)
    assert buffer_nbytes(d) == 60


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        (BufferDescriptor("mla", "NHD", "float16", 3, 4, 2, 5), "num_heads=2, must be 1"),
        (BufferDescriptor("split", "NHD", "float16", 0, 4, 2, 5), "num_blocks=0"),
        (BufferDescriptor("split", "NHD", "nope", 1, 4, 2, 5), "unknown dtype 'nope'"),
        (BufferDescriptor("bad", "NHD", "float16", 1, 4, 2, 5), "unknown arrangement"),  # type: ignore[arg-type]
        (BufferDescriptor("split", "DHN", "float16", 1, 4, 2, 5), "unknown memory_order"),  # type: ignore[arg-type]
    ],
)
def test_bad_descriptors(desc: BufferDescriptor, message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        buffer_nbytes(desc)


# --------------------------------------------------------------------------------------------
# view_buffer / describe_tensor / block_views
# --------------------------------------------------------------------------------------------

shapes = st.fixed_dictionaries(
    {
        "arr": st.sampled_from(ARRANGEMENTS),
        "layout": st.sampled_from(LAYOUTS),
        "dtype": st.sampled_from(DTYPES),
        "nb": st.integers(1, 4),
        "n": st.integers(1, 5),
        "h": st.integers(1, 3),
        "c": st.integers(1, 3),
        "shape_order": st.sampled_from(["NH", "HN"]),
    }
)


@PROPS
@given(p=shapes)
def test_view_buffer_matches_offsets(p: dict[str, Any]) -> None:
    arr, layout, dtype = p["arr"], p["layout"], p["dtype"]
    nb, n, h, c = p["nb"], p["n"], p["h"], p["c"]
    desc = desc_of(arr, layout, dtype, nb, n, h, c)
    h = desc.num_heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    flat = random_ints(buffer_nbytes(desc), 1, seed=nb * 100 + n)
    v = view_buffer(flat, desc, shape_order=p["shape_order"])
    assert v.dtype == dtype and v.data_ptr() == flat.data_ptr()
    mem = flat.view(INT_OF[itemsize]).tolist()
    vi = as_ints(v)
    elems = region_elems(n, h, c)
    for kv in range(regions_per_block(arr)):
        for b in range(nb):
            base = region_start(arr, b, kv, nb, elems)
            for t in range(n):
                for hh in range(h):
                    for cc in range(c):
                        want = mem[base + in_region(desc.memory_order, t, hh, cc, n, h, c)]
                        if arr == "mla":
                            idx: tuple[int, ...] = (b, t, cc)
                        else:
                            pos = (t, hh) if p["shape_order"] == "NH" else (hh, t)
                            outer = {"kv_first": (kv, b), "blocks_first": (b, kv), "split": (b,)}
                            idx = (*outer[arr], *pos, cc)
                        assert vi[idx].item() == want
    # A write through the view lands in the buffer: it is a view, not a copy.
    vi[(0,) * vi.dim()] = 7
    assert flat.view(INT_OF[itemsize])[0].item() == 7
    # And the tensor describes back to the same descriptor.
    assert (
        describe_tensor(
            v, arrangement=arr, memory_order=desc.memory_order, shape_order=p["shape_order"]
        )
        == desc
    )


def test_view_buffer_rejects() -> None:
    desc = BufferDescriptor("split", "HND", "float16", 2, 4, 2, 8)
    with pytest.raises(LayoutError, match="has 255 bytes, descriptor needs 256"):
        view_buffer(torch.zeros(255, dtype=torch.uint8), desc)
    with pytest.raises(LayoutError, match="contiguous 1-D uint8"):
        view_buffer(torch.zeros(128, dtype=torch.int16), desc)
    with pytest.raises(LayoutError, match="cannot be viewed as float16"):
        view_buffer(torch.zeros(257, dtype=torch.uint8)[1:], desc)


def test_describe_engine_conventions() -> None:
    nb, n, h, c = 3, 16, 4, 8
    nhd = torch.zeros(nb, n, h, c, dtype=torch.bfloat16)
    hnd_ref = torch.zeros(nb, h, n, c, dtype=torch.bfloat16).transpose(1, 2)  # (B,N,H,C) HND
    hnd_033 = torch.zeros(nb, h, n, c, dtype=torch.bfloat16)  # vLLM 0.33: contiguous (B,H,N,C)
    want = BufferDescriptor("split", "HND", "bfloat16", nb, n, h, c)
    assert describe_tensor(nhd, arrangement="split") == BufferDescriptor(
        "split", "NHD", "bfloat16", nb, n, h, c
    )
    assert describe_tensor(hnd_ref, arrangement="split") == want
    assert describe_tensor(hnd_033, arrangement="split", shape_order="HN") == want
    assert (
        describe_tensor(hnd_033, arrangement="split", memory_order="HND", shape_order="HN") == want
    )
    fi = torch.zeros(nb, 2, h, n, c).transpose(2, 3)
    assert describe_tensor(fi, arrangement="blocks_first") == BufferDescriptor(
        "blocks_first", "HND", "float32", nb, n, h, c
    )
    fa = torch.zeros(2, nb, n, h, c, dtype=torch.float16)
    assert describe_tensor(fa, arrangement="kv_first").num_blocks == nb
    mla = torch.zeros(nb, n, 576, dtype=torch.float16)
    assert describe_tensor(mla, arrangement="mla") == BufferDescriptor(
        "mla", "NHD", "float16", nb, n, 1, 576
    )


@pytest.mark.parametrize(
    ("tensor", "kwargs", "message"),
    [
        (torch.zeros(3, 8, 4, 8)[:, ::2], {"arrangement": "split"}, "is not laid out NHD or HND"),
        (
            torch.zeros(3, 8, 4, 8),
            {"arrangement": "split", "memory_order": "HND"},
            "shape_order='HN'",
        ),
        (torch.zeros(3, 8, 4), {"arrangement": "split"}, "split tensor must have 4 dims"),
        (torch.zeros(3, 2, 4, 8, 2), {"arrangement": "kv_first"}, "must have 2 in dim 0"),
        (torch.zeros(3, 3, 4, 8, 2), {"arrangement": "blocks_first"}, "must have 2 in dim 1"),
        (torch.zeros(3, 8, 4).transpose(0, 1), {"arrangement": "mla"}, "mla tensor"),
        (torch.zeros(3, 8, 4, 8), {"arrangement": "paged"}, "unknown arrangement"),
    ],
)
def test_describe_rejects(tensor: torch.Tensor, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        describe_tensor(tensor, **kwargs)


@PROPS
@given(p=shapes)
def test_block_views_rows_are_block_bytes(p: dict[str, Any]) -> None:
    arr, layout, dtype = p["arr"], p["layout"], p["dtype"]
    nb, n, h, c = p["nb"], p["n"], p["h"], p["c"]
    desc = desc_of(arr, layout, dtype, nb, n, h, c)
    storage, cache = make_cache(
        arr, layout, nb, n, h, c, dtype, shape_order=p["shape_order"], seed=3
    )
    views = block_views(cache, desc)
    raw = storage.view(torch.uint8).tolist()
    region = block_len(desc)
    assert len(views) == (2 if arr == "kv_first" else 1)
    for kv, view in enumerate(views):
        assert view.dtype == torch.uint8
        assert view.shape == (nb, region if arr == "kv_first" else block_bytes(desc))
        assert view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        for b in range(nb):
            start = (kv * nb + b) * region if arr == "kv_first" else b * block_bytes(desc)
            assert view[b].tolist() == raw[start : start + view.shape[1]]
    # Moving raw rows between two caches moves whole blocks: the block reads the same afterwards.
    _, other = make_cache(arr, layout, nb, n, h, c, dtype, shape_order=p["shape_order"], seed=4)
    for src, dst in zip(views, block_views(other, desc), strict=True):
        dst[nb - 1].copy_(src[0])
    if arr == "kv_first":
        assert torch.equal(as_ints(other)[:, nb - 1], as_ints(cache)[:, 0])
    else:
        assert torch.equal(as_ints(other)[nb - 1], as_ints(cache)[0])


def test_block_views_padded_block_stride() -> None:
    # Pages of 3 blocks' room each hold one block: the block stride is not the block size.
    nb, n, h, c = 4, 2, 3, 2
    base = torch.arange(nb * 3 * n * h * c, dtype=torch.float32)
    cache = base.as_strided((nb, n, h, c), (3 * n * h * c, h * c, c, 1))
    desc = BufferDescriptor("split", "NHD", "float32", nb, n, h, c)
    (view,) = block_views(cache, desc)
    assert view.shape == (nb, n * h * c * 4) and view.data_ptr() == base.data_ptr()
    for b in range(nb):
        assert torch.equal(view[b].view(torch.float32), base[b * 3 * n * h * c :][: n * h * c])


def test_block_views_rejects() -> None:
    desc = BufferDescriptor("split", "HND", "float16", 2, 4, 2, 8)
    with pytest.raises(LayoutError, match="does not match descriptor shape"):
        block_views(torch.zeros(2, 4, 3, 8, dtype=torch.float16), desc)
    with pytest.raises(LayoutError, match=re.escape("dtype torch.float32 does not match")):
        block_views(torch.zeros(2, 4, 2, 8), desc)
    with pytest.raises(LayoutError, match="not dense"):
        block_views(torch.zeros(2, 4, 2, 16, dtype=torch.float16)[..., ::2], desc)


# --------------------------------------------------------------------------------------------
# fix_received
# --------------------------------------------------------------------------------------------


def shuffled_subset(draw: Any, nb: int) -> list[int]:
    ids: list[int] = draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    return ids


@st.composite
def fix_cases(draw: Any) -> dict[str, Any]:
    ratio = draw(st.sampled_from(RATIOS))
    nb = draw(st.integers(1, 5))
    p = {
        "arr": draw(st.sampled_from(ARRANGEMENTS)),
        "local": draw(st.sampled_from(LAYOUTS)),
        "remote": draw(st.sampled_from(LAYOUTS)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "ratio": ratio,
        "nb": nb,
        "n": ratio * draw(st.integers(1, 3)),
        "h": draw(st.integers(1, 3)),
        "c": draw(st.integers(1, 3)),
        "shape_order": draw(st.sampled_from(["NH", "HN"])),
        "id_kind": draw(st.sampled_from(["list", "numpy", "tensor"])),
        "path": draw(st.sampled_from(PATHS)),
    }
    full = draw(st.booleans())
    ids = list(range(nb)) if full else shuffled_subset(draw, nb)
    if full:
        ids = draw(st.permutations(ids))
    p["ids"] = ids
    return p


def as_kind(ids: list[int], kind: str) -> Any:
    if kind == "numpy":
        return np.array(ids, dtype=np.int32)
    if kind == "tensor":
        return torch.tensor(ids, dtype=torch.int64)
    return ids


@PROPS
@given(p=fix_cases())
def test_fix_received_matches_loop_reference(p: dict[str, Any]) -> None:
    arr, nb, n, h, c = p["arr"], p["nb"], p["n"], p["h"], p["c"]
    storage, cache = make_cache(
        arr, p["local"], nb, n, h, c, p["dtype"], shape_order=p["shape_order"], seed=nb + n
    )
    old = storage.tolist()
    want = loop_fix(
        old, arr, p["ids"], nb, n, h, c, remote=p["remote"], local=p["local"], ratio=p["ratio"]
    )
    with fix_path(p["path"]):
        fix_received(
            cache,
            as_kind(p["ids"], p["id_kind"]),
            remote_layout=p["remote"],
            local_layout=p["local"],
            block_size_ratio=p["ratio"],
            arrangement="kv_first" if arr == "kv_first" else None,
            shape_order=p["shape_order"],
        )
    assert storage.tolist() == want


@PROPS
@given(p=fix_cases())
def test_fix_received_after_raw_copy_reads_remote_tokens(p: dict[str, Any]) -> None:
    """End to end: the remote's blocks copied byte for byte, fixed, read as the remote's tokens."""
    arr, nb, n, h, c, ratio = p["arr"], p["nb"], p["n"], p["h"], p["c"], p["ratio"]
    rn = n // ratio
    if arr == "mla":
        h = 1
    # Remote cache: ratio remote blocks per local block, remote layout, its own shape convention.
    r_storage, remote = make_cache(arr, p["remote"], nb * ratio, rn, h, c, p["dtype"], seed=11)
    l_storage, local = make_cache(
        arr, p["local"], nb, n, h, c, p["dtype"], shape_order=p["shape_order"], seed=12
    )
    before = as_ints(local).clone()
    relems, lelems = region_elems(rn, h, c), region_elems(n, h, c)
    ids = p["ids"]
    for j, b in enumerate(ids):  # local block b receives remote blocks j*ratio .. j*ratio+ratio-1
        for kv in range(regions_per_block(arr)):
            dst = region_start(arr, b, kv, nb, lelems)
            for r in range(ratio):
                src = region_start(arr, j * ratio + r, kv, nb * ratio, relems)
                l_storage[dst + r * relems : dst + (r + 1) * relems] = r_storage[src : src + relems]
    with fix_path(p["path"]):
        fix_received(
            local,
            as_kind(ids, p["id_kind"]),
            remote_layout=p["remote"],
            local_layout=p["local"],
            block_size_ratio=ratio,
            arrangement="kv_first" if arr == "kv_first" else None,
            shape_order=p["shape_order"],
        )
    li, ri = as_ints(local), as_ints(remote)

    def at(t: torch.Tensor, b: int, kv: int, tok: int, head: int, ch: int, order: str) -> int:
        if arr == "mla":
            return int(t[b, tok, ch])
        pos = (tok, head) if order == "NH" else (head, tok)
        outer = {"kv_first": (kv, b), "blocks_first": (b, kv), "split": (b,)}[arr]
        return int(t[(*outer, *pos, ch)])

    for b in range(nb):
        for kv in range(regions_per_block(arr)):
            for tok in range(n):
                for head in range(h):
                    for ch in range(c):
                        got = at(li, b, kv, tok, head, ch, p["shape_order"])
                        if b in ids:
                            rb = ids.index(b) * ratio + tok // rn
                            want = at(ri, rb, kv, tok % rn, head, ch, "NH")
                        else:
                            want = at(before, b, kv, tok, head, ch, p["shape_order"])
                        assert got == want


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("five_d", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_seed_layout_on_receive(dtype: torch.dtype, five_d: bool, path: str) -> None:
    arr = "blocks_first" if five_d else "split"
    nb, n, h, c, ids = 5, 4, 3, 2, [3, 0, 4]
    _, cache = make_cache(arr, "NHD", nb, n, h, c, dtype, seed=1)
    _, ref = make_cache(arr, "NHD", nb, n, h, c, dtype, seed=1)
    seed_layout_on_receive(as_ints(ref), ids)
    with fix_path(path):
        fix_received(cache, ids, remote_layout="HND", local_layout="NHD")
    assert torch.equal(as_ints(cache), as_ints(ref))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("local", "h", "ids", "seed"),
    [("HND", 2, [2, 1], 2), ("NHD", 3, [0, 3], 3)],
    ids=["blksize", "blksize_and_layout"],
)
def test_matches_seed_blksize_on_receive(
    local: str, h: int, ids: list[int], seed: int, dtype: torch.dtype, ratio: int, path: str
) -> None:
    nb, n, c = 4, 16, 2
    _, cache = make_cache("split", local, nb, n, h, c, dtype, seed=seed)
    _, ref = make_cache("split", local, nb, n, h, c, dtype, seed=seed)
    seed_blksize_on_receive(as_ints(ref), ids, ratio, local)
    with fix_path(path):
        fix_received(cache, ids, remote_layout="HND", local_layout=local, block_size_ratio=ratio)
    assert torch.equal(as_ints(cache), as_ints(ref))
    if local == "HND":
        # vLLM 0.33's contiguous (B, H, N, C) view of the same memory fixes to the same bytes.
        _, c033 = make_cache("split", "HND", nb, n, h, c, dtype, shape_order="HN", seed=seed)
        with fix_path(path):
            fix_received(
                c033,
                ids,
                remote_layout="HND",
                local_layout="HND",
                block_size_ratio=ratio,
                shape_order="HN",
            )
        assert torch.equal(as_ints(c033).transpose(1, 2), as_ints(ref))


@pytest.mark.parametrize("ratio", RATIOS)
def test_nhd_remote_with_ratio_is_a_no_op_and_mla_too(ratio: int) -> None:
    # Consecutive NHD blocks of n tokens concatenate to one NHD block of ratio*n tokens.
    for arr in ("split", "blocks_first", "kv_first", "mla"):
        kind: Any = "kv_first" if arr == "kv_first" else None
        storage, cache = make_cache(arr, "NHD", 3, 16, 2, 2, torch.float16, seed=5)
        before = storage.clone()
        fix_received(
            cache,
            [0, 2],
            remote_layout="NHD",
            local_layout="NHD",
            block_size_ratio=ratio,
            arrangement=kind,
        )
        assert torch.equal(storage, before)
        for layout in ("NHD", "HND"):  # equal layouts, equal block sizes: nothing to do
            storage, cache = make_cache(arr, layout, 3, 16, 2, 2, torch.float16, seed=5)
            before = storage.clone()
            fix_received(cache, [1], remote_layout=layout, local_layout=layout, arrangement=kind)
            assert torch.equal(storage, before)
    storage, mla = make_cache("mla", "NHD", 3, 16, 1, 4, torch.bfloat16, seed=5)
    before = storage.clone()
    fix_received(mla, [2, 0], remote_layout="HND", local_layout="NHD", block_size_ratio=ratio)
    assert torch.equal(storage, before)


def test_fix_received_empty_ids_and_id_kinds() -> None:
    storage, cache = make_cache("split", "NHD", 3, 4, 2, 2, torch.float32, seed=6)
    before = storage.clone()
    empties: list[Any] = [[], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.int64)]
    for empty in empties:
        fix_received(cache, empty, remote_layout="HND", local_layout="NHD", block_size_ratio=2)
    assert torch.equal(storage, before)
    fix_received(cache, np.array([2], dtype=np.uint16), remote_layout="HND", local_layout="NHD")
    assert not torch.equal(storage, before)


@pytest.mark.parametrize(
    ("cache", "ids", "kwargs", "message"),
    [
        (torch.zeros(4, 8, 2, 2), [0, 0], {}, "duplicates"),
        (torch.zeros(4, 8, 2, 2), [4], {}, "block id 4 out of range for a cache of 4 blocks"),
        (torch.zeros(4, 8, 2, 2), [-1], {}, "block id -1 out of range"),
        (torch.zeros(4, 8, 2, 2), [0.5], {}, "block ids must be integers"),
        (torch.zeros(4, 8, 2, 2), np.array([1.0]), {}, "block ids must be integers"),
        (torch.zeros(4, 8, 2, 2), torch.tensor([True]), {}, "block ids must be integers"),
        (torch.zeros(4, 8, 2, 2), torch.tensor([[0]]), {}, "must be 1-D"),
        (torch.zeros(4, 8, 2, 2), [0], {"block_size_ratio": 3}, "3 must be >= 1 and divide"),
        (torch.zeros(4, 8, 2, 2), [0], {"block_size_ratio": 0}, "0 must be >= 1"),
        (torch.zeros(4, 8, 2, 2), [0], {"block_size_ratio": -2}, "-2 must be >= 1"),
        (torch.zeros(4, 8), [0], {}, "must have 3, 4 or 5 dims"),
        (torch.zeros(4, 8, 2, 2), [0], {"arrangement": "kv_first"}, "kv_first cache must have 5"),
        (torch.zeros(4, 3, 8, 2, 2), [0], {}, "must have 2 (K, V) in dim 1"),
        (torch.zeros(4, 8, 2, 2), [0], {"local_layout": "HND"}, "shape_order='HN'"),
        (torch.zeros(4, 8, 2, 4)[..., ::2], [0], {}, "is not laid out NHD"),
        (torch.zeros(4, 8, 2, 2), [0], {"remote_layout": "HDN"}, "unknown remote_layout"),
        (torch.zeros(4, 8, 2, 2), [0], {"shape_order": "X"}, "unknown shape_order"),
    ],
)
def test_fix_received_rejects(cache: torch.Tensor, ids: Any, kwargs: Any, message: str) -> None:
    args = {"remote_layout": "HND", "local_layout": "NHD", **kwargs}
    before = cache.clone()
    with pytest.raises(LayoutError, match=re.escape(message)):
        fix_received(cache, ids, **args)
    assert torch.equal(cache, before)


# --------------------------------------------------------------------------------------------
# Head slices
# --------------------------------------------------------------------------------------------


def heads_held(tp: int, rank: int, total: int) -> list[int]:
    """Heads of a rank by brute force: heads are dealt out in order; with more ranks than heads,
    every run of tp // total ranks shares one head."""
    if tp <= total:
        per = total // tp
        return [hd for hd in range(total) if hd // per == rank]
    return [hd for hd in range(total) if rank * total // tp == hd]


def head_map(tp: int, rank: int, total: int, head_bytes: int) -> list[int]:
    """One HND region of a rank, each byte labelled with the head it belongs to."""
    return [hd for hd in heads_held(tp, rank, total) for _ in range(head_bytes)]


tp_sizes = st.sampled_from([1, 2, 4, 8, 16])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    total=st.sampled_from([1, 2, 4, 8]),
    tp_a=tp_sizes,
    tp_b=tp_sizes,
    n=st.integers(1, 4),
    c=st.integers(1, 3),
    itemsize=st.sampled_from([1, 2, 4]),
)
def test_head_slices_cover_exactly_the_local_heads(
    total: int, tp_a: int, tp_b: int, n: int, c: int, itemsize: int
) -> None:
    local_tp, remote_tp = max(tp_a, tp_b), min(tp_a, tp_b)
    hb = n * c * itemsize
    geometry = {"num_heads_total": total, "block_size": n, "head_size": c, "itemsize": itemsize}
    for rank in range(local_tp):  # local TP >= remote TP: read a slice
        first, count = heads_of_rank(tp_size=local_tp, tp_rank=rank, num_heads_total=total)
        assert list(range(first, first + count)) == heads_held(local_tp, rank, total)
        off, length = head_slice(
            local_tp_size=local_tp, remote_tp_size=remote_tp, local_tp_rank=rank, **geometry
        )
        remote_rank = rank // (local_tp // remote_tp)
        region = head_map(remote_tp, remote_rank, total, hb)
        assert region[off : off + length] == head_map(local_tp, rank, total, hb)
    local_tp, remote_tp = remote_tp, local_tp
    for rank in range(local_tp):  # remote TP >= local TP: place whole remote regions
        want = head_map(local_tp, rank, total, hb)
        got: list[int | None] = [None] * len(want)
        ratio = remote_tp // local_tp
        for q in range(rank * ratio, (rank + 1) * ratio):
            off, length = head_slice_target(
                local_tp_size=local_tp, remote_tp_size=remote_tp, remote_tp_rank=q, **geometry
            )
            incoming = head_map(remote_tp, q, total, hb)
            assert length == len(incoming)
            assert want[off : off + length] == incoming  # replicas land on identical bytes
            got[off : off + length] = incoming
        assert got == want


def test_head_slice_docstring_examples() -> None:
    g = {"block_size": 16, "head_size": 128, "itemsize": 2}
    assert head_slice(
        local_tp_size=4, remote_tp_size=1, local_tp_rank=2, num_heads_total=8, **g
    ) == (16384, 8192)
    assert head_slice(
        local_tp_size=4, remote_tp_size=1, local_tp_rank=3, num_heads_total=2, **g
    ) == (4096, 4096)
    assert head_slice(
        local_tp_size=8, remote_tp_size=4, local_tp_rank=5, num_heads_total=2, **g
    ) == (0, 4096)
    assert head_slice_target(
        local_tp_size=1, remote_tp_size=4, remote_tp_rank=3, num_heads_total=8, **g
    ) == (24576, 8192)
    for q in (2, 3):
        assert head_slice_target(
            local_tp_size=1, remote_tp_size=4, remote_tp_rank=q, num_heads_total=2, **g
        ) == (4096, 4096)
    assert heads_of_rank(tp_size=4, tp_rank=3, num_heads_total=8) == (6, 2)
    assert heads_of_rank(tp_size=8, tp_rank=5, num_heads_total=2) == (1, 1)


def test_head_slice_rejects() -> None:
    g = {"block_size": 16, "head_size": 8, "itemsize": 2, "num_heads_total": 8}
    with pytest.raises(LayoutError, match="local_tp_size 2 must be a multiple of remote_tp_size 4"):
        head_slice(local_tp_size=2, remote_tp_size=4, local_tp_rank=0, **g)
    with pytest.raises(LayoutError, match="remote_tp_size 6 must be a multiple"):
        head_slice_target(local_tp_size=4, remote_tp_size=6, remote_tp_rank=0, **g)
    with pytest.raises(LayoutError, match="tp_rank 4 out of range for tp_size 4"):
        head_slice(local_tp_size=4, remote_tp_size=2, local_tp_rank=4, **g)
    with pytest.raises(LayoutError, match="8 KV heads do not split over tp_size 3"):
        heads_of_rank(tp_size=3, tp_rank=0, num_heads_total=8)
    with pytest.raises(LayoutError, match="tp_size 12 is not a multiple of 8 KV heads"):
        heads_of_rank(tp_size=12, tp_rank=0, num_heads_total=8)
    with pytest.raises(LayoutError, match="block_size 0 must be >= 1"):
        head_slice(local_tp_size=2, remote_tp_size=1, local_tp_rank=0, **{**g, "block_size": 0})
