"""The engine's KV cache as the daemon must see it: arrangement and memory order, never assumed.

vLLM hands its workers plain tensors, one per layer. Their layout is read from the tensors
(shape and strides) and from vLLM's own view of its cache:

- 5 dims ``(2, B, N, H, C)``: FlashAttention's ``kv_first``; ``(B, 2, N, H, C)``: FlashInfer's
  ``blocks_first``; the memory order (NHD or HND) from the strides;
- 3 dims: MLA;
- 4 dims on the CPU (vLLM's ``LBHNC``, ``(B, H, N, 2C)``): ``vllm_cpu`` when the packing inside
  a block is checked to be K transposed then V (vLLM's ``vec`` kernels), ``vllm_cpu_amx`` when it
  is checked to be the ``amx`` kernels' tiles (bfloat16, block sizes a multiple of 32, CPUs with
  AMX); `detect_layout` is given the verdict of the connector's check against vLLM's own
  kernel. Any other packing is *opaque*:
  registered as one dense region per block (``split``, HND, head size ``2C``), which moves whole
  blocks correctly but cannot be re-blocked, so the connector refuses block-size changes for it.

vLLM 0.32+ on GPUs gives every layer a 4-dim ``[B, H, N, C]`` view of one buffer, its strides set
by the ``KVCacheLayout`` the engine core resolved (`paged_views`): each cell's ``C`` channels are
K's then V's (FlashAttention, FlashInfer and Triton split them so), registered as ``kv_cells``;
MLA's ``[B, 1, N, C]`` latent as ``mla``. Only layouts whose layer's blocks are one dense region
each (``LBNHC``, NHD, and ``LBHNC``, HND) can be; the others are refused at start, by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from kvsidecar.core.layout import CPU_PACKED, LayoutError, ShapeOrder, describe_tensor
from kvsidecar.wire.types import Arrangement, MemoryOrder


class LayoutUnknown(ValueError):
    """A cache tensor the connector cannot describe; the message says what it saw."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How to register the engine's layers (`kvsidecar.client.SidecarClient.register_kv_caches`)."""

    arrangement: Arrangement
    memory_order: MemoryOrder | None
    """None: read from the strides."""
    shape_order: ShapeOrder
    name: str
    """What disaggregated prefill tells the other engine: ``vllm_cpu``, ``vllm_cpu_amx``,
    ``opaque``, ``kv_first``, ``blocks_first``, ``kv_cells`` or ``mla``."""


def detect_layout(t: torch.Tensor, *, cpu_packing: Arrangement | None) -> CacheLayout:
    """Describe one layer's tensor (every layer of an engine has the same layout).

    ``cpu_packing``: for a 4-dim CPU tensor, the arrangement whose packing vLLM's kernel was
    checked to write (`CPU_PACKED`), or None when it matched neither.
    """
    shape = tuple(t.shape)
    if t.dim() == 5 and shape[0] == 2:
        return CacheLayout("kv_first", None, "NH", "kv_first")
    if t.dim() == 5 and shape[1] == 2:
        return CacheLayout("blocks_first", None, "NH", "blocks_first")
    if t.dim() == 3:
        return CacheLayout("mla", None, "NH", "mla")
    if t.dim() == 4 and t.device.type == "cpu" and shape[-1] % 2 == 0:
        if cpu_packing in CPU_PACKED:
            return CacheLayout(cpu_packing, "HND", "NH", cpu_packing)
        return CacheLayout("split", "HND", "HN", "opaque")
    raise LayoutUnknown(f"a KV cache tensor of shape {shape} on {t.device} is not a known layout")


PAGED_LAYOUTS: dict[str, MemoryOrder] = {"LBNHC": "NHD", "LBHNC": "HND"}
"""vLLM's ``KVCacheLayout`` names the connector registers, and the memory order of a block in
each: the layer-compact ones, whose layer's blocks are each one dense region."""


def paged_views(
    kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, *, use_mla: bool
) -> tuple[dict[str, torch.Tensor], CacheLayout]:
    """Return vLLM 0.31+'s per-layer views as the daemon registers them, and their layout.

    ``kv_cache_config`` is vLLM's ``KVCacheConfig``: its ``kv_cache_layout`` (the
    ``KVCacheLayout`` the engine resolved; unnamed: read from the strides) and ``num_blocks``
    (the scheduler's blocks per layer). Where the attention kernels split a scheduler block into
    kernel blocks (the views' first dim is a multiple of ``num_blocks``), each scheduler block's
    kernel blocks are viewed as one block, which is exact when they hold consecutive tokens one
    after another (NHD, or one head). Raises `LayoutUnknown`, saying what to change, for
    anything else: other layouts, padded pages, tensors that are not 4-dim attention views (a
    hybrid model's state).
    """
    kv_cache_layout = str(getattr(kv_cache_config, "kv_cache_layout", "") or "")
    num_blocks = int(kv_cache_config.num_blocks)
    if kv_cache_layout and kv_cache_layout not in PAGED_LAYOUTS:
        raise LayoutUnknown(
            f"vLLM's KV cache layout {kv_cache_layout} does not keep a layer's block in one "
            f"dense region, which the daemon copies whole; set VLLM_KV_CACHE_LAYOUT to one of "
            f"{', '.join(PAGED_LAYOUTS)} (or use an attention backend that accepts them)"
        )
    views: dict[str, torch.Tensor] = {}
    for name, t in kv_caches.items():
        if t.dim() != 4:
            raise LayoutUnknown(
                f"layer {name!r} holds a tensor of shape {tuple(t.shape)}, not a [B, H, N, C] "
                "attention view (a hybrid model's state?): only attention KV can be cached"
            )
        views[name] = _scheduler_blocks(name, t, num_blocks)
    first = next(iter(views.values()), None)
    if first is None:
        raise LayoutUnknown("vLLM registered no KV cache layers")
    if use_mla:
        if first.shape[1] != 1:
            raise LayoutUnknown(f"an MLA cache of shape {tuple(first.shape)} has more than 1 head")
        views = {name: t[:, 0] for name, t in views.items()}
        cache_layout = CacheLayout("mla", None, "NH", "mla")
    else:
        order = PAGED_LAYOUTS.get(kv_cache_layout)
        cache_layout = CacheLayout("kv_cells", order, "HN", "kv_cells")
    for name, t in views.items():
        try:
            describe_tensor(
                t,
                arrangement=cache_layout.arrangement,
                memory_order=cache_layout.memory_order,
                shape_order=cache_layout.shape_order,
            )
        except LayoutError as exc:
            raise LayoutUnknown(
                f"layer {name!r} ({kv_cache_layout or 'layout unnamed'}) cannot be registered: "
                f"{exc} (padded pages are not supported)"
            ) from None
    return views, cache_layout


def _scheduler_blocks(name: str, t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View ``t``'s kernel blocks grouped into the scheduler's ``num_blocks`` blocks."""
    kernel_blocks, _, tokens, _ = t.shape
    if num_blocks < 1 or kernel_blocks % num_blocks:
        raise LayoutUnknown(
            f"layer {name!r} has {kernel_blocks} kernel blocks, not a multiple of vLLM's "
            f"{num_blocks} blocks"
        )
    ratio = kernel_blocks // num_blocks
    if ratio == 1:
        return t
    b, h, n, c = t.stride()
    if b != tokens * n and t.shape[1] > 1:
        raise LayoutUnknown(
            f"vLLM splits each block of layer {name!r} into {ratio} kernel blocks of {tokens} "
            "tokens whose heads come first (HND): one block's tokens are not one after another "
            "in memory. Use VLLM_KV_CACHE_LAYOUT=LBNHC, or a --block-size of "
            f"{tokens} (the kernels' own)"
        )
    shape = (num_blocks, t.shape[1], tokens * ratio, t.shape[3])
    return t.as_strided(shape, (b * ratio, h, n, c))


class SharedMemoryTooSmall(RuntimeError):
    """The engine's CPU cache does not fit in ``/dev/shm``; the message says how big each is."""


SHM = "/dev/shm"
"""Where torch puts the shared memory it moves a storage into (``shm_open``)."""


def share_storages(kv_caches: dict[str, torch.Tensor], shm: str = SHM) -> None:
    """Move the CPU layers' storages into shared memory, in place, so the daemon can map them.

    vLLM keeps every layer as a view of one storage; each storage moves once, and every view
    (the attention layers' included) then sees the shared pages: nothing is copied per step.
    Raises `SharedMemoryTooSmall`, before anything moves, when ``shm`` (``/dev/shm``) has less
    room than the storages: a container's default of 64 MiB holds no real cache.
    """
    storages: dict[int, torch.Tensor] = {}
    for t in kv_caches.values():
        storage = t.untyped_storage()
        if t.device.type == "cpu" and not storage.is_shared():
            storages.setdefault(storage.data_ptr() or id(storage), t)
    need = sum(t.untyped_storage().nbytes() for t in storages.values())
    if not need:
        return
    st = os.statvfs(shm)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if need > free:
        raise SharedMemoryTooSmall(_too_small(need, shm, size, free))
    for t in storages.values():
        try:
            t.share_memory_()  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # taken meanwhile by another process
            raise SharedMemoryTooSmall(f"{_too_small(need, shm, size, free)} ({exc})") from None


def _too_small(need: int, shm: str, size: int, free: int) -> str:
    return (
        f"the KV cache ({_size(need)}) does not fit in {shm} ({_size(size)}, {_size(free)} "
        f"free): the daemon cannot map it. Give the engine a {shm} of at least {_size(need)} "
        "(docker run --shm-size; Kubernetes: an emptyDir with medium Memory and a sizeLimit), "
        "or a smaller cache (VLLM_CPU_KVCACHE_SPACE)"
    )


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
