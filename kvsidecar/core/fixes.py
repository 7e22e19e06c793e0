"""Receive-side layout fixes: blocks that a remote wrote as raw bytes, put right in place.

The copy engine moves bytes, not tokens: when the remote engine keeps its KV cache in another
memory order (NHD against HND) or with a smaller block size, the blocks it sent hold the right
bytes in the wrong places. `fix_received` rearranges them in place once they have landed. It is
the reference's three ``kv_postprocess_*`` functions, plus NHD into HND. The vocabulary (regions,
memory order, shape order) is `kvsidecar.core.layout`'s, and so are the argument checks and the
memory-order views this module builds on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.core.layout import (
    CPU_PACKED,
    LayoutError,
    ShapeOrder,
    check_arrangement,
    check_memory_order,
    check_rank,
    check_shape_order,
    dense_from,
    layout_hint,
    to_memory_order,
)
from kvsidecar.wire.types import Arrangement, BufferDescriptor, MemoryOrder

__all__ = ["BlockIds", "fix_received", "needs_fix"]

BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Block ids as the engine has them: a list, a numpy integer array or an integer tensor."""

# Raw-byte stand-ins: indexing kernels exist for these on every device, unlike float8 or bfloat16.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Block size (bytes, K and V together) from which fix_received on CPU goes block by block.
_PER_BLOCK_MIN_BYTES = 8 * 1024
# The arrangement a cache of this many dims has when the caller does not say.
_ARRANGEMENT_OF_RANK: dict[int, Arrangement] = {3: "mla", 4: "split", 5: "blocks_first"}


def needs_fix(remote_order: MemoryOrder, local: BufferDescriptor, ratio: int) -> bool:
    """Whether raw blocks from ``remote_order`` need `fix_received` to read as ``local``'s.

    ``ratio``: how many of the remote's blocks make one of ``local``'s. The one rule for local
    moves (`kvsidecar.node.jobs`) and node-to-node pulls (`kvsidecar.peer.plan`); both sides
    are known by then to agree on arrangement and heads.
    """
    if local.arrangement in CPU_PACKED:
        return ratio > 1  # K or V packed across tokens: packed blocks never read as one block
    if local.arrangement == "mla" or local.num_heads == 1:
        return False  # one head: token order is the only order, concatenation is already right
    # NHD blocks laid end to end are one bigger NHD block; HND ones are not.
    return remote_order != local.memory_order or (ratio > 1 and local.memory_order == "HND")


def fix_received(
    cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    remote_layout: MemoryOrder,
    local_layout: MemoryOrder,
    block_size_ratio: int = 1,
    arrangement: Arrangement | None = None,
    shape_order: ShapeOrder = "NH",
) -> None:
    """Make blocks that hold raw bytes from another layout or block size read correctly, in place.

    ``cache`` is one KV tensor as the engine holds it, its memory in ``local_layout``. Each listed
    block's K region (and V region) holds what a remote with ``remote_layout`` and block size
    ``n = N // block_size_ratio`` wrote there: ``block_size_ratio`` consecutive remote regions
    packed into one local region, remote block ``r`` holding local tokens ``r*n .. r*n + n - 1``.
    After the call ``cache[b, t, h, c]`` (logical) is the remote's value for that token; other
    blocks are untouched. This is the reference's ``kv_postprocess_layout_on_receive`` (HND into
    NHD, ratio 1), ``kv_postprocess_blksize_on_receive`` (HND into HND) and
    ``kv_postprocess_blksize_and_layout_on_receive`` (HND into NHD), plus NHD into HND. Nothing is
    left to do (but inputs are still checked) when concatenated remote blocks already are the
    local bytes: NHD into NHD at any ratio, equal layouts at ratio 1, one head, or MLA.

    ``arrangement`` defaults by rank: 3 dims MLA, 4 ``split`` (also one half of a kv_first
    tensor), 5 ``blocks_first``; pass ``"kv_first"`` for a ``(2, B, N, H, C)`` tensor and
    ``"vllm_cpu"`` (or ``"vllm_cpu_amx"``) for vLLM's CPU cache ``(B, H, N, 2C)`` (memory orders
    do not apply to it: only a block-size ratio needs a fix, see `_fix_cpu_packed`).
    ``shape_order="HN"`` accepts vLLM 0.33's contiguous ``(B, H, N, C)`` HND tensor. Works on the
    raw bytes (an integer view), so float8 and bfloat16 caches fix like any other. The listed
    blocks are gathered once and scattered back once, the remap folded into the scatter; on CPU,
    blocks of 8 KiB and more go one at a time through a small reused scratch instead (faster there).

    Raises ``LayoutError`` (nothing modified) for a ratio that is < 1 or does not divide N, a rank
    or shape that does not fit, memory not dense in ``local_layout`` within a block, or block ids
    that are not integers, out of range or duplicated.
    """
    arrangement = _checked_arrangement(
        cache, arrangement, (remote_layout, local_layout), shape_order, block_size_ratio
    )
    if arrangement in CPU_PACKED:
        _fix_cpu_packed(cache, block_ids, block_size_ratio, arrangement)
        return
    regions = _regions(cache, arrangement, local_layout, shape_order)
    if local_layout == "HND" and arrangement != "mla":
        _, _, num_heads, block_size, _ = regions.shape
    else:
        _, _, block_size, num_heads, _ = regions.shape
    if block_size_ratio < 1 or block_size % block_size_ratio:
        raise LayoutError(
            f"block_size_ratio {block_size_ratio} must be >= 1 and divide the local block size "
            f"{block_size}"
        )
    # A region's bytes must be dense, or "raw bytes as the remote wrote them" has no meaning.
    if not dense_from(regions, 2):
        raise LayoutError(f"cache {layout_hint(cache, local_layout, shape_order)}")
    index = _block_index(block_ids, regions.shape[0], cache.device)

    concat_is_local = (remote_layout == local_layout == "NHD") or (
        remote_layout == local_layout and block_size_ratio == 1
    )
    if concat_is_local or num_heads == 1 or index.numel() == 0:
        return
    raw = regions.view(_INT_OF_SIZE[cache.element_size()])
    tokens = (block_size_ratio, block_size // block_size_ratio, num_heads)
    _remap(raw, index, remote_layout, local_layout, tokens)


def _checked_arrangement(
    cache: torch.Tensor,
    arrangement: Arrangement | None,
    layouts: tuple[MemoryOrder, MemoryOrder],
    shape_order: ShapeOrder,
    block_size_ratio: int,
) -> Arrangement:
    """Check what `fix_received` can check without a view; return the arrangement it works on.

    ``layouts`` is ``(remote_layout, local_layout)``; ``arrangement=None`` is read from the rank.
    """
    for name, layout in zip(("remote_layout", "local_layout"), layouts, strict=True):
        check_memory_order(layout, name)
    check_shape_order(shape_order)
    if arrangement is None:
        if cache.dim() not in _ARRANGEMENT_OF_RANK:
            raise LayoutError(f"cache must have 3, 4 or 5 dims, got shape {tuple(cache.shape)}")
        arrangement = _ARRANGEMENT_OF_RANK[cache.dim()]
    else:
        check_arrangement(arrangement)
    check_rank(cache, arrangement, "cache")
    kv_dim = {"kv_first": 0, "blocks_first": 1}.get(arrangement)
    if kv_dim is not None and cache.shape[kv_dim] != 2:
        raise LayoutError(
            f"{arrangement} cache must have 2 (K, V) in dim {kv_dim}, "
            f"got shape {tuple(cache.shape)}"
        )
    if isinstance(block_size_ratio, bool) or not isinstance(block_size_ratio, int):
        raise LayoutError(f"block_size_ratio must be an int, got {block_size_ratio!r}")
    return arrangement


def _regions(
    cache: torch.Tensor,
    arrangement: Arrangement,
    local_layout: MemoryOrder,
    shape_order: ShapeOrder,
) -> torch.Tensor:
    """View ``cache`` as regions in memory order: ``(B, regions per block, P1, P2, C)``.

    ``P1, P2`` are ``N, H`` for NHD and ``H, N`` for HND; an MLA latent is one region of one head.
    """
    mem = to_memory_order(cache, arrangement, local_layout, shape_order)
    if arrangement == "mla":
        return mem.unsqueeze(1).unsqueeze(3)  # (B, 1, N, 1, C): one head, order irrelevant
    if arrangement == "kv_first":
        return mem.transpose(0, 1)
    if arrangement in ("split", "kv_cells"):
        return mem.unsqueeze(1)
    return mem


def _block_index(block_ids: BlockIds, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Return ``block_ids`` as a 1-D int64 tensor on ``device``: integers, in range, unique."""
    if isinstance(block_ids, torch.Tensor):
        index = block_ids
    elif isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu":
            raise LayoutError(f"block ids must be integers, got numpy dtype {block_ids.dtype}")
        index = torch.from_numpy(block_ids.astype(np.int64))
    else:
        ids = list(block_ids)
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
            raise LayoutError(f"block ids must be integers, got {ids!r}")
        index = torch.tensor(ids, dtype=torch.int64)
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise LayoutError(f"block ids must be integers, got {index.dtype}")
    if index.dim() != 1:
        raise LayoutError(f"block ids must be 1-D, got shape {tuple(index.shape)}")
    index = index.to(device=device, dtype=torch.int64)
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= num_blocks:
            bad = low if low < 0 else high
            raise LayoutError(f"block id {bad} out of range for a cache of {num_blocks} blocks")
        if torch.unique(index).numel() != index.numel():
            raise LayoutError("block ids contain duplicates")
    return index


def _remap(
    raw: torch.Tensor,
    index: torch.Tensor,
    remote_layout: MemoryOrder,
    local_layout: MemoryOrder,
    tokens: tuple[int, int, int],
) -> None:
    """Rewrite blocks ``index`` of ``raw`` (`_regions` as integers) from remote into local order.

    ``tokens`` is ``(ratio, n, H)``: remote regions per local one, remote block size, heads.
    """
    dst = _cache_as_remote(raw, local_layout, tokens)
    if raw.device.type == "cpu" and raw[0].numel() * raw.element_size() >= _PER_BLOCK_MIN_BYTES:
        # On CPU a big gather and a strided scatter run at first-touch speed (every page of the
        # gathered copy is new); one block at a time through a reused, cache-resident scratch is
        # several times faster for blocks of 8 KiB and more. On GPUs the kernel launch per block
        # would dominate instead.
        scratch = torch.empty((1, *raw.shape[1:]), dtype=raw.dtype)
        src = _as_remote(scratch, remote_layout, tokens)
        for b in index.tolist():
            scratch[0].copy_(raw[b])
            dst[b : b + 1].copy_(src)
        return
    dst.index_copy_(0, index, _as_remote(raw.index_select(0, index), remote_layout, tokens))


def _as_remote(
    blocks: torch.Tensor, remote_layout: MemoryOrder, tokens: tuple[int, int, int]
) -> torch.Tensor:
    """Read dense blocks (k, R, P1, P2, C) as `ratio` remote regions: (k, R, ratio, n, H, C)."""
    ratio, remote_n, num_heads = tokens
    k, nregions = blocks.shape[0], blocks.shape[1]
    if remote_layout == "HND":
        return blocks.view(k, nregions, ratio, num_heads, remote_n, -1).transpose(3, 4)
    return blocks.view(k, nregions, ratio, remote_n, num_heads, -1)


def _cache_as_remote(
    raw: torch.Tensor, local_layout: MemoryOrder, tokens: tuple[int, int, int]
) -> torch.Tensor:
    """View the cache's regions indexed as `_as_remote` indexes remote ones: (B, R, ratio, n, H, C).

    Splitting the token dim is always a view, so the whole remap happens inside the write back,
    without an intermediate copy.
    """
    ratio, remote_n, num_heads = tokens
    num_blocks, nregions = raw.shape[0], raw.shape[1]
    if local_layout == "HND":
        dst = raw.view(num_blocks, nregions, num_heads, ratio, remote_n, -1)
        return dst.permute(0, 1, 3, 4, 2, 5)
    return raw.view(num_blocks, nregions, ratio, remote_n, num_heads, -1)


def _fix_cpu_packed(
    cache: torch.Tensor, block_ids: BlockIds, ratio: int, arrangement: Arrangement
) -> None:
    """Turn ``ratio`` packed remote blocks into one block of vLLM's CPU cache, in place.

    ``cache`` is ``(B, H, N, 2C)``; per block and head K then V, as ``arrangement`` packs them. A
    raw copy of ``ratio`` remote blocks of ``n = N / ratio`` tokens leaves each local block as
    ``ratio`` whole remote blocks in a row, ``(ratio, H, [K | V])``. Ratio 1 needs nothing (the
    layouts are equal).

    - ``vllm_cpu`` (vec kernels): K transposed ``(C, N)``, V ``(N, C)``. Afterwards head ``h``
      holds K whose columns ``j*n .. j*n + n - 1`` are remote block ``j``'s, and V likewise by
      rows.
    - ``vllm_cpu_amx`` (amx kernels): K as ``N/16`` tiles of 16 tokens, each ``(C/2, 16, 2)``,
      then V as ``C/16`` groups of 16 channels, each ``(N/2, 16, 2)`` (token pairs). Remote
      block ``j``'s K tiles are the local block's tiles ``j * n/16 ..``: K only moves as a whole;
      V's group ``g`` of the local block is every remote block's group ``g`` in a row.

    Both are held element by element to a model of the packings (tests/vllm/test_cpu_layout.py),
    itself checked against vLLM's own kernels (tests/vllm/test_engines.py).
    """
    if not dense_from(cache, 1) or cache.shape[-1] % 2:
        raise LayoutError(f"{arrangement} cache {layout_hint(cache, 'dense (B, H, N, 2C)', 'HN')}")
    num_blocks, heads, block_size, two_c = cache.shape
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1 or block_size % ratio:
        raise LayoutError(
            f"block_size_ratio {ratio} must be >= 1 and divide the local block size {block_size}"
        )
    index = _block_index(block_ids, num_blocks, cache.device)
    if ratio == 1 or index.numel() == 0:
        return
    c, n = two_c // 2, block_size // ratio
    if arrangement == "vllm_cpu_amx" and (n % 16 or c % 16):
        raise LayoutError(
            f"vllm_cpu_amx: remote block size {n} and head size {c} must be multiples of 16"
        )
    raw = cache.view(_INT_OF_SIZE[cache.element_size()])
    packed = raw.index_select(0, index)  # (k, H, N, 2C) holding (k, ratio, H, 2, n*C)
    k = packed.shape[0]
    src = packed.view(k, ratio, heads, 2, n * c)
    out = torch.empty_like(packed).view(k, heads, 2, block_size * c)
    if arrangement == "vllm_cpu_amx":
        # K: local (ratio, n*C) per head <- remote j's whole K
        out[:, :, 0].view(k, heads, ratio, n * c).copy_(src[:, :, :, 0].permute(0, 2, 1, 3))
        # V: local (C/16, ratio, 16n) per head <- remote j's (C/16, 16n)
        out[:, :, 1].view(k, heads, c // 16, ratio, 16 * n).copy_(
            src[:, :, :, 1].reshape(k, ratio, heads, c // 16, 16 * n).permute(0, 2, 3, 1, 4)
        )
    else:
        # K: local (C, ratio, n) per head <- remote j's (C, n)
        out[:, :, 0].view(k, heads, c, ratio, n).copy_(
            src[:, :, :, 0].reshape(k, ratio, heads, c, n).permute(0, 2, 3, 1, 4)
        )
        # V: local (ratio, n, C) per head <- remote j's (n, C)
        out[:, :, 1].view(k, heads, ratio, n * c).copy_(src[:, :, :, 1].permute(0, 2, 1, 3))
    raw.index_copy_(0, index, out.view_as(packed))
