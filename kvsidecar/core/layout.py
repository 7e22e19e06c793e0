"""KV-cache layouts: descriptors, zero-copy views of mapped bytes and TP head slices.

Vocabulary (the same as ``types.BufferDescriptor``):

- ``B`` blocks, ``N`` tokens per block, ``H`` KV heads, ``C`` head size.
- The *logical shape* is what the engine indexes: ``(2, B, N, H, C)`` (``kv_first``,
  FlashAttention), ``(B, 2, N, H, C)`` (``blocks_first``, FlashInfer), ``(B, N, H, C)`` (``split``,
  one tensor for K and one for V) or ``(B, N, C)`` (``mla``). ``vllm_cpu`` is vLLM's CPU attention
  cache, ``(B, H, N, 2C)``: per block and head, K stored transposed as ``(C, N)``, then V as
  ``(N, C)``. Its K and V are interleaved head by head, so its one *region* is the whole block.
  ``vllm_cpu_amx`` is the same tensor as vLLM's AMX kernels pack it (K and V in tiles of 16
  tokens or channels, see ``types.Arrangement``); it is described and moved the same way.
  ``kv_cells`` (vLLM 0.31+'s GPU cache) is ``split`` whose cells hold K's channels, then V's.
- The *memory order* says how one block's K or V region sits in memory: NHD is ``(N, H, C)``,
  HND is ``(H, N, C)``. Blocks are always the slowest dim inside their region.
- A *region* is one block's K part or V part (or its whole latent for MLA): ``block_len`` bytes.

Two conventions exist for handing over an HND tensor: the reference's ``(B, N, H, C)`` shape with
HND strides, and vLLM 0.33's contiguous ``(B, H, N, C)``. They hold the same bytes. Functions that
take a tensor accept both through ``shape_order``: ``"NH"`` (the default) when the shape lists
tokens before heads, ``"HN"`` when it lists heads before tokens. Everything here works from the
memory order, so both register and fix identically.

The copy engine moves raw bytes (``block_views``); whatever a remote engine with another memory
order or block size wrote is then put right in place by `kvsidecar.core.fixes.fix_received`, which
shares this module's checks and memory-order views (``check_*``, ``to_memory_order``,
``dense_from``, ``layout_hint``).
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

import torch

from kvsidecar.wire.types import Arrangement, BufferDescriptor, MemoryOrder

__all__ = [
    "CPU_PACKED",
    "LayoutError",
    "ShapeOrder",
    "block_bytes",
    "block_len",
    "block_views",
    "buffer_nbytes",
    "check_arrangement",
    "check_memory_order",
    "check_rank",
    "check_shape_order",
    "dense_from",
    "describe_tensor",
    "head_slice",
    "head_slice_target",
    "heads_of_rank",
    "layout_hint",
    "logical_shape",
    "memory_shape",
    "to_memory_order",
    "torch_dtype",
    "view_buffer",
]

ShapeOrder: TypeAlias = Literal["NH", "HN"]
"""Order in which a tensor's *shape* lists tokens (N) and heads (H); independent of memory order."""

_ARRANGEMENTS: tuple[Arrangement, ...] = get_args(Arrangement)
_MEMORY_ORDERS: tuple[MemoryOrder, ...] = ("NHD", "HND")
_RANK = dict(zip(_ARRANGEMENTS, (5, 5, 4, 3, 4, 4, 4), strict=True))
"""Dims of each arrangement's tensor, in `Arrangement`'s order."""
CPU_PACKED: tuple[Arrangement, ...] = ("vllm_cpu", "vllm_cpu_amx")
"""vLLM's CPU caches ``(B, H, N, 2C)``: K and V of a head packed inside each block, by the ``vec``
kernels (``vllm_cpu``) or the ``amx`` ones (``vllm_cpu_amx``). Alike everywhere but in how
packed blocks are re-blocked (`kvsidecar.core.fixes`), and never exchanged with each other."""


class LayoutError(ValueError):
    """A tensor, descriptor or request does not fit a supported KV layout; the message says why."""


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


def check_arrangement(arrangement: str) -> None:
    """Raise `LayoutError` unless ``arrangement`` is one of the KV arrangements."""
    if arrangement not in _RANK:
        raise LayoutError(f"unknown arrangement {arrangement!r}, expected one of {_ARRANGEMENTS}")


def check_memory_order(value: str, name: str = "memory_order") -> None:
    """Raise `LayoutError` unless ``value`` (the argument ``name``) is NHD or HND."""
    if value not in _MEMORY_ORDERS:
        raise LayoutError(f"unknown {name} {value!r}, expected NHD or HND")


def check_shape_order(shape_order: str) -> None:
    """Raise `LayoutError` unless ``shape_order`` is ``"NH"`` or ``"HN"``."""
    if shape_order not in ("NH", "HN"):
        raise LayoutError(f"unknown shape_order {shape_order!r}, expected 'NH' or 'HN'")


def check_rank(t: torch.Tensor, arrangement: Arrangement, what: str) -> None:
    """Raise `LayoutError` unless ``t`` has the dim count of ``arrangement`` (a known one).

    ``what`` names the tensor in the message (``"tensor"``, ``"cache"``).
    """
    if t.dim() != _RANK[arrangement]:
        raise LayoutError(
            f"{arrangement} {what} must have {_RANK[arrangement]} dims, got shape {tuple(t.shape)}"
        )


def _check_descriptor(desc: BufferDescriptor) -> torch.dtype:
    # Structs built in-process skip msgspec's validation, so check what decoding would have.
    check_arrangement(desc.arrangement)
    check_memory_order(desc.memory_order)
    for field in ("num_blocks", "block_size", "num_heads", "head_size"):
        value = getattr(desc, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"descriptor {field}={value!r}: must be a positive int")
    if desc.arrangement == "mla" and desc.num_heads != 1:
        raise LayoutError(f"mla descriptor has num_heads={desc.num_heads}, must be 1")
    return torch_dtype(desc.dtype)


def logical_shape(desc: BufferDescriptor) -> tuple[int, ...]:
    """Return the shape the engine indexes, tokens before heads.

    ``kv_first`` ``(2, B, N, H, C)``, ``blocks_first`` ``(B, 2, N, H, C)``, ``split`` and
    ``kv_cells`` ``(B, N, H, C)``, ``mla`` ``(B, N, C)``; ``vllm_cpu`` ``(B, H, N, 2C)``, the shape
    vLLM's CPU backend allocates (its last dim packs K transposed and V, see the module doc).
    """
    _check_descriptor(desc)
    b, n, h, c = desc.num_blocks, desc.block_size, desc.num_heads, desc.head_size
    if desc.arrangement in CPU_PACKED:
        return (b, h, n, 2 * c)
    if desc.arrangement == "kv_first":
        return (2, b, n, h, c)
    if desc.arrangement == "blocks_first":
        return (b, 2, n, h, c)
    if desc.arrangement in ("split", "kv_cells"):
        return (b, n, h, c)
    return (b, n, c)


def memory_shape(desc: BufferDescriptor) -> tuple[int, ...]:
    """Return the shape in which the buffer's bytes are C-contiguous.

    That is ``logical_shape`` with N and H swapped for HND (MLA has no heads, never swapped;
    ``vllm_cpu``'s shape is its memory order already).
    """
    shape = logical_shape(desc)
    if desc.memory_order == "HND" and desc.arrangement not in ("mla", *CPU_PACKED):
        return (*shape[:-3], shape[-2], shape[-3], shape[-1])
    return shape


def block_len(desc: BufferDescriptor) -> int:
    """Bytes of one block's K region (or V region, or MLA latent): the reference's ``block_len``.

    A ``vllm_cpu`` block interleaves K and V head by head: its one region is the whole block.
    """
    itemsize = _check_descriptor(desc).itemsize
    regions_per_block = 2 if desc.arrangement in CPU_PACKED else 1
    return regions_per_block * desc.block_size * desc.num_heads * desc.head_size * itemsize


def block_bytes(desc: BufferDescriptor) -> int:
    """Bytes that one block id owns in this tensor: K and V together for kv_first/blocks_first."""
    regions = 2 if desc.arrangement in ("kv_first", "blocks_first") else 1
    return regions * block_len(desc)


def buffer_nbytes(desc: BufferDescriptor) -> int:
    """Size in bytes of the whole registered tensor."""
    return desc.num_blocks * block_bytes(desc)


def to_memory_order(
    t: torch.Tensor, arrangement: Arrangement, memory_order: MemoryOrder, shape_order: ShapeOrder
) -> torch.Tensor:
    """Return a view of ``t`` whose dims follow memory order (``memory_shape``); no stride check."""
    if arrangement in ("mla", *CPU_PACKED):
        return t
    heads_first_in_memory = memory_order == "HND"
    heads_first_in_shape = shape_order == "HN"
    if heads_first_in_memory != heads_first_in_shape:
        return t.transpose(-3, -2)
    return t


def dense_from(t: torch.Tensor, first_dim: int) -> bool:
    """Return whether dims ``first_dim..`` of ``t`` are C-contiguous among themselves.

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


def layout_hint(t: torch.Tensor, memory_order: str, shape_order: str) -> str:
    """Say why ``t`` is not laid out ``memory_order``: the end of a `LayoutError` message."""
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
    check_arrangement(arrangement)
    check_shape_order(shape_order)
    check_rank(t, arrangement, "tensor")
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
            raise LayoutError(f"mla tensor {layout_hint(t, 'contiguous', shape_order)}")
        b, n, c = t.shape
        return BufferDescriptor("mla", "NHD", _dtype_name(t.dtype), b, n, 1, c)
    if arrangement in CPU_PACKED:
        return _describe_vllm_cpu(t, arrangement)
    if memory_order is None:
        # Prefer the order the shape suggests; with H == 1 or N == 1 both fit, with the same bytes.
        preferred: tuple[MemoryOrder, ...] = (
            ("HND", "NHD") if shape_order == "HN" else ("NHD", "HND")
        )
        candidates = [
            m for m in preferred if to_memory_order(t, arrangement, m, shape_order).is_contiguous()
        ]
        if not candidates:
            raise LayoutError(f"tensor {layout_hint(t, 'NHD or HND', shape_order)}")
        memory_order = candidates[0]
    else:
        check_memory_order(memory_order)
        if not to_memory_order(t, arrangement, memory_order, shape_order).is_contiguous():
            raise LayoutError(f"tensor {layout_hint(t, memory_order, shape_order)}")
    shape = t.shape
    n, h = (shape[-3], shape[-2]) if shape_order == "NH" else (shape[-2], shape[-3])
    b = shape[1] if arrangement == "kv_first" else shape[0]
    return BufferDescriptor(arrangement, memory_order, _dtype_name(t.dtype), b, n, h, shape[-1])


def _describe_vllm_cpu(t: torch.Tensor, arrangement: Arrangement) -> BufferDescriptor:
    """Describe vLLM's CPU cache tensor ``(B, H, N, 2C)``: dense, an even last dim (K and V)."""
    b, h, n, c2 = t.shape
    shape = tuple(t.shape)
    if c2 % 2:
        raise LayoutError(f"{arrangement} tensor needs an even last dim (K and V), got {shape}")
    if not t.is_contiguous():
        raise LayoutError(
            f"{arrangement} tensor {layout_hint(t, 'contiguous (B, H, N, 2C)', 'HN')}"
        )
    if arrangement == "vllm_cpu_amx" and (n % 16 or (c2 // 2) % 16):  # 16-wide tiles of K and V
        raise LayoutError(f"vllm_cpu_amx needs 16 | block size and 16 | head size, got {shape}")
    # HND by convention: heads are the outer dim inside a block, as in an HND region.
    return BufferDescriptor(arrangement, "HND", _dtype_name(t.dtype), b, n, h, c2 // 2)


def view_buffer(
    flat: torch.Tensor, desc: BufferDescriptor, *, shape_order: ShapeOrder = "NH"
) -> torch.Tensor:
    """View raw bytes (a 1-D uint8 tensor of ``buffer_nbytes(desc)``) as the engine's KV tensor.

    No copy: writes through the result land in ``flat``. With HND and the default
    ``shape_order="NH"`` the result has shape ``(..., N, H, C)`` and HND strides (the reference's
    convention); ``shape_order="HN"`` gives the contiguous ``(..., H, N, C)`` tensor instead.
    """
    dtype = _check_descriptor(desc)
    check_shape_order(shape_order)
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
    return to_memory_order(in_memory, desc.arrangement, desc.memory_order, shape_order)


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
    if desc.arrangement not in ("mla", *CPU_PACKED) and tuple(cache_logical.shape) == swapped:
        orders.append("HN")
    if not orders:
        raise LayoutError(
            f"tensor shape {tuple(cache_logical.shape)} does not match descriptor shape {logical}"
        )
    # Dims from here on hold one block id's bytes (kv_first: one K or V region), so must be dense.
    first_dense = 2 if desc.arrangement == "kv_first" else 1
    for order in orders:
        mem = to_memory_order(cache_logical, desc.arrangement, desc.memory_order, order)
        if dense_from(mem, first_dense):
            break
    else:
        raise LayoutError(
            f"tensor {layout_hint(cache_logical, desc.memory_order, orders[0])}: a block's bytes "
            "are not dense"
        )
    raw = mem.view(torch.uint8)  # same strides in bytes; last dim grows by itemsize
    if desc.arrangement == "kv_first":
        return [raw[0].flatten(1), raw[1].flatten(1)]
    return [raw.flatten(1)]


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
    narrow, wide = ("local_tp_size", local_tp_size), ("remote_tp_size", remote_tp_size)
    sizes = (block_size, head_size, itemsize)
    return _heads_in_wider_rank(narrow, wide, local_tp_rank, num_heads_total, sizes)


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
    narrow, wide = ("remote_tp_size", remote_tp_size), ("local_tp_size", local_tp_size)
    sizes = (block_size, head_size, itemsize)
    return _heads_in_wider_rank(narrow, wide, remote_tp_rank, num_heads_total, sizes)


def _heads_in_wider_rank(
    narrow: tuple[str, int],
    wide: tuple[str, int],
    narrow_rank: int,
    num_heads_total: int,
    sizes: tuple[int, int, int],
) -> tuple[int, int]:
    """Bytes of rank ``narrow_rank``'s heads inside the region of the rank that holds them all.

    ``narrow`` and ``wide`` are ``(argument name, TP size)``: the narrow side has the larger TP
    size (fewer heads per rank), and its rank ``q`` pairs with wide rank ``q // ratio``.
    ``sizes`` is ``(block_size, head_size, itemsize)`` of the region.
    """
    (narrow_name, narrow_tp), (wide_name, wide_tp) = narrow, wide
    ratio = _tp_ratio(narrow_tp, wide_tp, narrow_name, wide_name)
    first, count = heads_of_rank(
        tp_size=narrow_tp, tp_rank=narrow_rank, num_heads_total=num_heads_total
    )
    outer_first, outer_count = heads_of_rank(
        tp_size=wide_tp, tp_rank=narrow_rank // ratio, num_heads_total=num_heads_total
    )
    n, c, itemsize = sizes
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
