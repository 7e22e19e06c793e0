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
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvsidecar.core.layout import CPU_PACKED, ShapeOrder
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
    ``opaque``, ``kv_first``, ``blocks_first`` or ``mla``."""


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
