"""KV-cache layouts: descriptors, zero-copy views and the receive-side layout fixes.

Vocabulary (the same as ``types.BufferDescriptor``):

- ``B`` blocks, ``N`` tokens per block, ``H`` KV heads, ``C`` head size.
- The *logical shape* is what the engine indexes: ``(2, B, N, H, C)`` (``kv_first``,
  FlashAttention), ``(B, 2, N, H, C)`` (``blocks_first``, FlashInfer), ``(B, N, H, C)`` (``split``,
  one tensor for K and one for V) or ``(B, N, C)`` (``mla``).
- The *memory order* says how one block's K or V region sits in memory: NHD is ``(N, H, C)``,
  HND is ``(H, N, C)``. Blocks are always the slowest dim inside their region.
- A *region* is one block's K part or V part (or its whole latent for MLA): ``block_len`` bytes.

Two conventions exist for handing over an HND tensor (see MEASURED.md): the reference's
``(B, N, H, C)`` shape with HND strides, and vLLM 0.33's contiguous ``(B, H, N, C)``. They hold the
same bytes. Functions that take a tensor accept both through ``shape_order``: ``"NH"`` (the default)
when the shape lists tokens before heads, ``"HN"`` when it lists heads before tokens. Everything
here works from the memory order, so both register and fix identically.

The copy engine moves raw bytes (``block_views``); whatever a remote engine with another memory
order or block size wrote is then put right in place by ``fix_received``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.wire.types import Arrangement, BufferDescriptor, MemoryOrder

__all__ = [
    "BlockIds",
    "LayoutError",
    "ShapeOrder",
    "block_bytes",
    "block_len",
    "block_views",
    "buffer_nbytes",
    "describe_tensor",
    "fix_received",
    "head_slice",
    "head_slice_target",
    "heads_of_rank",
    "logical_shape",
    "memory_shape",
    "torch_dtype",
    "view_buffer",
]

ShapeOrder: TypeAlias = Literal["NH", "HN"]
"""Order in which a tensor's *shape* lists tokens (N) and heads (H); independent of memory order."""

BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Block ids as the engine has them: a list, a numpy integer array or an integer tensor."""

_ARRANGEMENTS: tuple[Arrangement, ...] = ("kv_first", "blocks_first", "split", "mla")
_MEMORY_ORDERS: tuple[MemoryOrder, ...] = ("NHD", "HND")
_RANK = {"kv_first": 5, "blocks_first": 5, "split": 4, "mla": 3}
# Raw-byte stand-ins: indexing kernels exist for these on every device, unlike float8 or bfloat16.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Block size (bytes, K and V together) from which fix_received on CPU goes block by block.
_PER_BLOCK_MIN_BYTES = 8 * 1024


class LayoutError(ValueError):
    """A tensor, descriptor or request does not fit a supported KV layout; the message says why."""


# ---------------------------------------------------------------------------------------------
# Descriptor helpers
# ---------------------------------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype called ``name`` (``"float16"``, ``"bfloat16"``, ``"float8_e4m3fn"``).

    Raises ``LayoutError`` for a name that is not a torch dtype (in this torch build).
    """
    value = getattr(torch, name, None) if name and not name.startswith("_") else None
    if not isinstance(value, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}: not a torch dtype in torch {torch.__version__}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_descriptor(desc: BufferDescriptor) -> torch.dtype:
    # Structs built in-process skip msgspec's validation, so check what decoding would have.
    if desc.arrangement not in _ARRANGEMENTS:
        raise LayoutError(
            f"unknown arrangement {desc.arrangement!r}, expected one of {_ARRANGEMENTS}"
        )
    if desc.memory_order not in _MEMORY_ORDERS:
        raise LayoutError(f"unknown memory_order {desc.memory_order!r}, expected NHD or HND")
    for field in ("num_blocks", "block_size", "num_heads", "head_size"):
        value = getattr(desc, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"descriptor {field}={value!r}: must be a positive int")
    if desc.arrangement == "mla" and desc.num_heads != 1:
        raise LayoutError(f"mla descriptor has num_heads={desc.num_heads}, must be 1")
    return torch_dtype(desc.dtype)


def logical_shape(desc: BufferDescriptor) -> tuple[int, ...]:
    """Return the shape the engine indexes, tokens before heads.

    ``kv_first`` ``(2, B, N, H, C)``, ``blocks_first`` ``(B, 2, N, H, C)``, ``split``
    ``(B, N, H, C)``, ``mla`` ``(B, N, C)``.
    """
    _check_descriptor(desc)
    b, n, h, c = desc.num_blocks, desc.block_size, desc.num_heads, desc.head_size
    if desc.arrangement == "kv_first":
        return (2, b, n, h, c)
    if desc.arrangement == "blocks_first":
        return (b, 2, n, h, c)
    if desc.arrangement == "split":
        return (b, n, h, c)
    return (b, n, c)


def memory_shape(desc: BufferDescriptor) -> tuple[int, ...]:
    """Return the shape in which the buffer's bytes are C-contiguous.

    That is ``logical_shape`` with N and H swapped for HND (MLA has no heads, never swapped).
    """
    shape = logical_shape(desc)
    if desc.memory_order == "HND" and desc.arrangement != "mla":
        return (*shape[:-3], shape[-2], shape[-3], shape[-1])
    return shape


def block_len(desc: BufferDescriptor) -> int:
    """Bytes of one block's K region (or V region, or MLA latent): the reference's ``block_len``."""
    itemsize = _check_descriptor(desc).itemsize
    return desc.block_size * desc.num_heads * desc.head_size * itemsize


def block_bytes(desc: BufferDescriptor) -> int:
    """Bytes that one block id owns in this tensor: K and V together for kv_first/blocks_first."""
    regions = 2 if desc.arrangement in ("kv_first", "blocks_first") else 1
    return regions * block_len(desc)


def buffer_nbytes(desc: BufferDescriptor) -> int:
    """Size in bytes of the whole registered tensor."""
    return desc.num_blocks * block_bytes(desc)


# ---------------------------------------------------------------------------------------------
# Tensors <-> descriptors
# ---------------------------------------------------------------------------------------------


def _to_memory_order(
    t: torch.Tensor, arrangement: Arrangement, memory_order: MemoryOrder, shape_order: ShapeOrder
) -> torch.Tensor:
    """View of ``t`` whose dims follow memory order (``memory_shape``); strides not checked."""
    if arrangement == "mla":
        return t
    heads_first_in_memory = memory_order == "HND"
    heads_first_in_shape = shape_order == "HN"
    if heads_first_in_memory != heads_first_in_shape:
        return t.transpose(-3, -2)
    return t


def _dense_from(t: torch.Tensor, first_dim: int) -> bool:
    """Whether dims ``first_dim..`` of ``t`` are C-contiguous among themselves.

    Size-1 dims are skipped, as ``Tensor.is_contiguous`` does.
    """
    expected = 1
    for size, stride in zip(
        reversed(t.shape[first_dim:]), reversed(t.stride()[first_dim:]), strict=True
    ):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_shape_order(shape_order: str) -> None:
    if shape_order not in ("NH", "HN"):
        raise LayoutError(f"unknown shape_order {shape_order!r}, expected 'NH' or 'HN'")


def _layout_hint(t: torch.Tensor, memory_order: str, shape_order: str) -> str:
    return (
        f"shape {tuple(t.shape)} with strides {t.stride()} is not laid out {memory_order} "
        f"(shape_order={shape_order!r}; a contiguous (B, H, N, C) tensor declared HND needs "
        f"shape_order='HN')"
    )


def describe_tensor(
    t: torch.Tensor,
    *,
    arrangement: Arrangement,
    memory_order: MemoryOrder | None = None,
    shape_order: ShapeOrder = "NH",
) -> BufferDescriptor:
    """Infer the descriptor of an engine's KV tensor from its shape and strides.

    ``arrangement`` fixes which dims are which; ``shape_order`` says whether the shape lists
    tokens or heads first (``"HN"`` for vLLM 0.33's contiguous ``(B, H, N, C)`` HND tensor). With
    ``memory_order=None`` the memory order is read from the strides; given, it is checked. The
    tensor must be dense: its bytes are exactly the buffer (no padding, no foreign strides).

    Example: ``torch.empty(8, 4, 16, 64).transpose(1, 2)`` (shape ``(8, 16, 4, 64)``) describes as
    ``split``, HND, 8 blocks of 16 tokens, 4 heads; so does ``torch.empty(8, 4, 16, 64)`` with
    ``shape_order="HN"``. MLA descriptors always say NHD (the order has no meaning there).
    """
    if arrangement not in _RANK:
        raise LayoutError(f"unknown arrangement {arrangement!r}, expected one of {_ARRANGEMENTS}")
    _check_shape_order(shape_order)
    if t.dim() != _RANK[arrangement]:
        raise LayoutError(
            f"{arrangement} tensor must have {_RANK[arrangement]} dims, got shape {tuple(t.shape)}"
        )
    if arrangement == "kv_first" and t.shape[0] != 2:
        raise LayoutError(
            f"kv_first tensor must have 2 in dim 0 (K, V), got shape {tuple(t.shape)}"
        )
    if arrangement == "blocks_first" and t.shape[1] != 2:
        raise LayoutError(
            f"blocks_first tensor must have 2 in dim 1 (K, V), got shape {tuple(t.shape)}"
        )
    if arrangement == "mla":
        if not t.is_contiguous():
            raise LayoutError(f"mla tensor {_layout_hint(t, 'contiguous', shape_order)}")
        b, n, c = t.shape
        return BufferDescriptor("mla", "NHD", _dtype_name(t.dtype), b, n, 1, c)
    if memory_order is None:
        # Prefer the order the shape suggests; with H == 1 or N == 1 both fit, with the same bytes.
        preferred: tuple[MemoryOrder, ...] = (
            ("HND", "NHD") if shape_order == "HN" else ("NHD", "HND")
        )
        candidates = [
            m for m in preferred if _to_memory_order(t, arrangement, m, shape_order).is_contiguous()
        ]
        if not candidates:
            raise LayoutError(f"tensor {_layout_hint(t, 'NHD or HND', shape_order)}")
        memory_order = candidates[0]
    elif memory_order not in _MEMORY_ORDERS:
        raise LayoutError(f"unknown memory_order {memory_order!r}, expected NHD or HND")
    elif not _to_memory_order(t, arrangement, memory_order, shape_order).is_contiguous():
        raise LayoutError(f"tensor {_layout_hint(t, memory_order, shape_order)}")
    shape = t.shape
    n, h = (shape[-3], shape[-2]) if shape_order == "NH" else (shape[-2], shape[-3])
    b = shape[1] if arrangement == "kv_first" else shape[0]
    return BufferDescriptor(arrangement, memory_order, _dtype_name(t.dtype), b, n, h, shape[-1])


def view_buffer(
    flat: torch.Tensor, desc: BufferDescriptor, *, shape_order: ShapeOrder = "NH"
) -> torch.Tensor:
    """View raw bytes (a 1-D uint8 tensor of ``buffer_nbytes(desc)``) as the engine's KV tensor.

    No copy: writes through the result land in ``flat``. With HND and the default
    ``shape_order="NH"`` the result has shape ``(..., N, H, C)`` and HND strides (the reference's
    convention); ``shape_order="HN"`` gives the contiguous ``(..., H, N, C)`` tensor instead.
    """
    dtype = _check_descriptor(desc)
    _check_shape_order(shape_order)
    nbytes = buffer_nbytes(desc)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise LayoutError(
            f"buffer must be a contiguous 1-D uint8 tensor, got {flat.dtype} of shape "
            f"{tuple(flat.shape)} with strides {flat.stride()}"
        )
    if flat.numel() != nbytes:
        raise LayoutError(f"buffer has {flat.numel()} bytes, descriptor needs {nbytes}")
    try:
        typed = flat.view(dtype)
    except (
        RuntimeError
    ) as exc:  # misaligned start: the storage offset is not a multiple of itemsize
        raise LayoutError(f"buffer cannot be viewed as {desc.dtype}: {exc}") from exc
    in_memory = typed.view(memory_shape(desc))
    return _to_memory_order(in_memory, desc.arrangement, desc.memory_order, shape_order)


def block_views(cache_logical: torch.Tensor, desc: BufferDescriptor) -> list[torch.Tensor]:
    """Per-block raw byte views for the copy engine: ``(num_blocks, bytes)`` uint8, row i = block i.

    ``kv_first`` gives two views (K, V) of ``block_len`` bytes per row; the other arrangements one
    view of ``block_bytes`` per row (``blocks_first`` rows hold K then V). Either shape convention
    is accepted (they are the same bytes). The block dim may have any stride (e.g. padded pages),
    but each block's bytes must be dense. Always views, never copies.
    """
    dtype = _check_descriptor(desc)
    if cache_logical.dtype != dtype:
        raise LayoutError(
            f"tensor dtype {cache_logical.dtype} does not match descriptor {desc.dtype}"
        )
    logical = logical_shape(desc)
    swapped = (*logical[:-3], logical[-2], logical[-3], logical[-1])
    orders: list[ShapeOrder] = []
    if tuple(cache_logical.shape) == logical:
        orders.append("NH")
    if desc.arrangement != "mla" and tuple(cache_logical.shape) == swapped:
        orders.append("HN")
    if not orders:
        raise LayoutError(
            f"tensor shape {tuple(cache_logical.shape)} does not match descriptor shape {logical}"
        )
    # Dims from here on hold one block id's bytes (kv_first: one K or V region), so must be dense.
    dense_from = 2 if desc.arrangement == "kv_first" else 1
    for order in orders:
        mem = _to_memory_order(cache_logical, desc.arrangement, desc.memory_order, order)
        if _dense_from(mem, dense_from):
            break
    else:
        raise LayoutError(
            f"tensor {_layout_hint(cache_logical, desc.memory_order, orders[0])}: a block's bytes "
            "are not dense"
        )
    raw = mem.view(torch.uint8)  # same strides in bytes; last dim grows by itemsize
    if desc.arrangement == "kv_first":
        return [raw[0].flatten(1), raw[1].flatten(1)]
    return [raw.flatten(1)]


# ---------------------------------------------------------------------------------------------
# Receive-side fixes
# ---------------------------------------------------------------------------------------------


def _block_index(block_ids: BlockIds, num_blocks: int, device: torch.device) -> torch.Tensor:
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
    After the
    call ``cache[b, t, h, c]`` (logical) is the remote's value for that token; other blocks are
    untouched. This is the reference's ``kv_postprocess_layout_on_receive`` (HND into NHD, ratio
    1), ``kv_postprocess_blksize_on_receive`` (HND into HND) and
    ``kv_postprocess_blksize_and_layout_on_receive`` (HND into NHD), plus NHD into HND. Nothing is
    left to do (but inputs are still checked) when concatenated remote blocks already are the
    local bytes: NHD into NHD at any ratio, equal layouts at ratio 1, one head, or MLA.

    ``arrangement`` defaults by rank: 3 dims MLA, 4 ``split`` (also one half of a kv_first
    tensor), 5 ``blocks_first``; pass ``"kv_first"`` for a ``(2, B, N, H, C)`` tensor.
    ``shape_order="HN"`` accepts vLLM 0.33's contiguous ``(B, H, N, C)`` HND tensor. Works on the
    raw bytes (an integer view), so float8 and bfloat16 caches fix like any other. The listed
    blocks are gathered once and scattered back once, the remap folded into the scatter; on CPU,
    blocks of 8 KiB and more go one at a time through a small reused scratch instead (faster there).

    Raises ``LayoutError`` (nothing modified) for a ratio that is < 1 or does not divide N, a rank
    or shape that does not fit, memory not dense in ``local_layout`` within a block, or block ids
    that are not integers, out of range or duplicated.
    """
    for name, layout in (("remote_layout", remote_layout), ("local_layout", local_layout)):
        if layout not in _MEMORY_ORDERS:
            raise LayoutError(f"unknown {name} {layout!r}, expected NHD or HND")
    _check_shape_order(shape_order)
    if arrangement is None:
        by_rank: dict[int, Arrangement] = {3: "mla", 4: "split", 5: "blocks_first"}
        if cache.dim() not in by_rank:
            raise LayoutError(f"cache must have 3, 4 or 5 dims, got shape {tuple(cache.shape)}")
        arrangement = by_rank[cache.dim()]
    elif arrangement not in _RANK:
        raise LayoutError(f"unknown arrangement {arrangement!r}, expected one of {_ARRANGEMENTS}")
    if cache.dim() != _RANK[arrangement]:
        raise LayoutError(
            f"{arrangement} cache must have {_RANK[arrangement]} dims, "
            f"got shape {tuple(cache.shape)}"
        )
    kv_dim = {"kv_first": 0, "blocks_first": 1}.get(arrangement)
    if kv_dim is not None and cache.shape[kv_dim] != 2:
        raise LayoutError(
            f"{arrangement} cache must have 2 (K, V) in dim {kv_dim}, "
            f"got shape {tuple(cache.shape)}"
        )
    if isinstance(block_size_ratio, bool) or not isinstance(block_size_ratio, int):
        raise LayoutError(f"block_size_ratio must be an int, got {block_size_ratio!r}")

    # Memory-ordered view, then regions as (B, regions per block, P1, P2, C).
    mem = _to_memory_order(cache, arrangement, local_layout, shape_order)
    if arrangement == "mla":
        regions = mem.unsqueeze(1).unsqueeze(3)  # (B, 1, N, 1, C): one head, order irrelevant
    elif arrangement == "kv_first":
        regions = mem.transpose(0, 1)
    elif arrangement == "split":
        regions = mem.unsqueeze(1)
    else:
        regions = mem
    num_blocks = regions.shape[0]
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
    if not _dense_from(regions, 2):
        raise LayoutError(f"cache {_layout_hint(cache, local_layout, shape_order)}")
    index = _block_index(block_ids, num_blocks, cache.device)

    concat_is_local = (remote_layout == local_layout == "NHD") or (
        remote_layout == local_layout and block_size_ratio == 1
    )
    if concat_is_local or num_heads == 1 or index.numel() == 0:
        return

    ratio, remote_n = block_size_ratio, block_size // block_size_ratio
    raw = regions.view(_INT_OF_SIZE[cache.element_size()])

    def as_remote(blocks: torch.Tensor) -> torch.Tensor:
        """Dense blocks (k, R, P1, P2, C) read as `ratio` remote regions: (k, R, ratio, n, H, C)."""
        k, nregions = blocks.shape[0], blocks.shape[1]
        if remote_layout == "HND":
            return blocks.view(k, nregions, ratio, num_heads, remote_n, -1).transpose(3, 4)
        return blocks.view(k, nregions, ratio, remote_n, num_heads, -1)

    # The cache viewed the same way: splitting the token dim is always a view, so the whole remap
    # happens inside the write back, without an intermediate copy.
    nregions = raw.shape[1]
    if local_layout == "HND":
        dst = raw.view(num_blocks, nregions, num_heads, ratio, remote_n, -1)
        dst = dst.permute(0, 1, 3, 4, 2, 5)
    else:
        dst = raw.view(num_blocks, nregions, ratio, remote_n, num_heads, -1)

    if cache.device.type == "cpu" and raw[0].numel() * raw.element_size() >= _PER_BLOCK_MIN_BYTES:
        # On CPU a big gather and a strided scatter run at first-touch speed (~0.5 GB/s measured);
        # one block at a time through a reused, cache-resident scratch ran 3-30x faster for blocks
        # of 8 KiB and more. On GPUs the kernel launch per block would dominate instead.
        scratch = torch.empty((1, *raw.shape[1:]), dtype=raw.dtype)
        src = as_remote(scratch)
        for b in index.tolist():
            scratch[0].copy_(raw[b])
            dst[b : b + 1].copy_(src)
        return
    dst.index_copy_(0, index, as_remote(raw.index_select(0, index)))


# ---------------------------------------------------------------------------------------------
# Head slices for heterogeneous tensor parallelism (HND)
# ---------------------------------------------------------------------------------------------


def heads_of_rank(*, tp_size: int, tp_rank: int, num_heads_total: int) -> tuple[int, int]:
    """KV heads that a TP rank holds: ``(first_head, count)``.

    Heads split evenly while ``tp_size <= num_heads_total``; beyond that each head is replicated on
    ``tp_size // num_heads_total`` consecutive ranks (vLLM's rule), so every rank holds one head.
    Examples: 8 heads, TP 4, rank 3 -> ``(6, 2)``; 2 heads, TP 8, rank 5 -> ``(1, 1)``.
    """
    if tp_size < 1 or num_heads_total < 1:
        raise LayoutError(f"tp_size {tp_size} and num_heads_total {num_heads_total} must be >= 1")
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    if tp_size <= num_heads_total:
        if num_heads_total % tp_size:
            raise LayoutError(f"{num_heads_total} KV heads do not split over tp_size {tp_size}")
        per_rank = num_heads_total // tp_size
        return tp_rank * per_rank, per_rank
    if tp_size % num_heads_total:
        raise LayoutError(f"tp_size {tp_size} is not a multiple of {num_heads_total} KV heads")
    return tp_rank // (tp_size // num_heads_total), 1


def _tp_ratio(larger: int, smaller: int, larger_name: str, smaller_name: str) -> int:
    if smaller < 1 or larger < smaller or larger % smaller:
        raise LayoutError(
            f"{larger_name} {larger} must be a multiple of {smaller_name} {smaller} (and >= it)"
        )
    return larger // smaller


def head_slice(
    *,
    local_tp_size: int,
    remote_tp_size: int,
    local_tp_rank: int,
    num_heads_total: int,
    block_size: int,
    head_size: int,
    itemsize: int,
) -> tuple[int, int]:
    """Byte range ``(offset, length)`` of one remote HND block region that a local rank reads.

    For local TP >= remote TP: local rank ``r`` reads from remote rank ``r // (local_tp //
    remote_tp)`` only the heads it holds itself. In HND a block region is ``(H, N, C)``, so a head
    range is one contiguous byte range. ``block_size`` is the *remote* block size (the region being
    sliced; with a block-size ratio the slices land in consecutive sub-ranges of the local block
    and ``fix_received`` rearranges them). Replicated KV (TP > heads) follows ``heads_of_rank``.

    Examples (block_size 16, head_size 128, fp16, so one head is 4096 bytes of a region):
    8 heads, remote TP 1, local TP 4, local rank 2 -> ``(16384, 8192)`` (heads 4-5 of 8);
    2 heads, remote TP 1, local TP 4, local rank 3 -> ``(4096, 4096)`` (head 1, held by ranks 2, 3);
    2 heads, remote TP 4, local TP 8, local rank 5 -> ``(0, 4096)`` (remote rank 2 holds one head).
    """
    ratio = _tp_ratio(local_tp_size, remote_tp_size, "local_tp_size", "remote_tp_size")
    local_first, local_count = heads_of_rank(
        tp_size=local_tp_size, tp_rank=local_tp_rank, num_heads_total=num_heads_total
    )
    remote_first, remote_count = heads_of_rank(
        tp_size=remote_tp_size, tp_rank=local_tp_rank // ratio, num_heads_total=num_heads_total
    )
    return _slice(
        (local_first, local_count),
        (remote_first, remote_count),
        n=block_size,
        c=head_size,
        itemsize=itemsize,
    )


def head_slice_target(
    *,
    local_tp_size: int,
    remote_tp_size: int,
    remote_tp_rank: int,
    num_heads_total: int,
    block_size: int,
    head_size: int,
    itemsize: int,
) -> tuple[int, int]:
    """Byte range ``(offset, length)`` of a local HND block region where a remote region lands.

    For remote TP >= local TP: local rank ``q // (remote_tp // local_tp)`` reads remote rank ``q``'s
    whole region (``length`` is all of it) and places it at ``offset`` among its own heads.
    ``block_size`` is the remote block size; with a block-size ratio, remote block ``j`` of the
    group goes to ``j * local_heads * block_size * head_size * itemsize + offset``.

    Examples (block_size 16, head_size 128, fp16, one head = 4096 bytes):
    8 heads, local TP 1, remote TP 4, remote rank 3 -> ``(24576, 8192)`` (heads 6-7);
    2 heads, local TP 1, remote TP 4, remote ranks 2 and 3 -> both ``(4096, 4096)``: replicas of
    head 1, so reading either one is enough.
    """
    ratio = _tp_ratio(remote_tp_size, local_tp_size, "remote_tp_size", "local_tp_size")
    remote_first, remote_count = heads_of_rank(
        tp_size=remote_tp_size, tp_rank=remote_tp_rank, num_heads_total=num_heads_total
    )
    local_first, local_count = heads_of_rank(
        tp_size=local_tp_size, tp_rank=remote_tp_rank // ratio, num_heads_total=num_heads_total
    )
    return _slice(
        (remote_first, remote_count),
        (local_first, local_count),
        n=block_size,
        c=head_size,
        itemsize=itemsize,
    )


def _slice(
    inner: tuple[int, int], outer: tuple[int, int], *, n: int, c: int, itemsize: int
) -> tuple[int, int]:
    """Bytes of heads ``inner`` = (first, count) inside a region holding heads ``outer``."""
    (first, count), (outer_first, outer_count) = inner, outer
    for name, value in (("block_size", n), ("head_size", c), ("itemsize", itemsize)):
        if value < 1:
            raise LayoutError(f"{name} {value} must be >= 1")
    if first < outer_first or first + count > outer_first + outer_count:
        raise LayoutError(
            f"heads {first}..{first + count - 1} are not inside heads "
            f"{outer_first}..{outer_first + outer_count - 1}"
        )
    head_bytes = n * c * itemsize
    return (first - outer_first) * head_bytes, count * head_bytes
