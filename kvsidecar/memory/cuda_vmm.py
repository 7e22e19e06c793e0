"""GPU memory that legacy CUDA IPC cannot share, passed as CUDA VMM fds.

Caches allocated with ``cuMemCreate`` (torch's ``expandable_segments``; allocators such as vLLM's
sleep-mode ``CuMemAllocator``) make ``cudaIpcGetMemHandle`` fail. The driver's virtual memory
management API shares them instead: the worker exports each physical allocation under a tensor
as a POSIX fd (``cuMemExportToShareableHandle``), the fds cross on the fd channel like shm fds
(``SCM_RIGHTS``: no ``pidfd_getfd``, no ptrace rights needed), and the daemon imports them
(``cuMemImportFromShareableHandle``), maps them back to back into one reserved address range
(``cuMemAddressReserve`` / ``cuMemMap``) and gives its GPU access (``cuMemSetAccess``).

An allocation can only be exported as a type it was created for: torch's expandable segments ask
for POSIX fds; vLLM's ``CuMemAllocator`` asks for none, so its memory cannot be shared by any
process (`choose_export` says so, naming the setting). The worker sends these handles only to
a daemon that announces the ``cuda_vmm`` capability.

The driver calls are `kvsidecar.memory.cuda_driver`'s; the planning here (`plan_chunks`,
`choose_export`, `FdSource`) is pure and tested without a GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvsidecar.memory import cuda_driver
from kvsidecar.memory.base import HandleError, MappedBuffer, TensorBuffer
from kvsidecar.memory.cuda_ipc import canonical_uuid, device_uuid, local_index
from kvsidecar.memory.fd_client import FdSource
from kvsidecar.memory.shm import byte_span
from kvsidecar.wire.types import CudaVmmRef

__all__ = [
    "MAX_CHUNKS",
    "CudaVmmHandle",
    "Mapping",
    "choose_export",
    "export_vmm_tensors",
    "import_chunks",
    "open_cuda_vmm_all",
    "plan_chunks",
]

CudaVmmHandle = CudaVmmRef
"""A CUDA tensor's VMM export: the wire type `kvsidecar.wire.types.CudaVmmRef`."""

MAX_CHUNKS = 1 << 16
"""Most physical allocations one tensor may span (torch's are 2 or 20 MiB each)."""

ALLOC_SETTINGS = (
    "torch's expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
    "vLLM's sleep mode (enable_sleep_mode=True, its CuMemAllocator) or torch's cudaMallocAsync "
    "backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)"
)
"""The settings that put a KV cache where legacy CUDA IPC cannot share it."""


def choose_export(
    *, legacy_capable: bool, allowed_handle_types: int, daemon_has_vmm: bool
) -> Literal["cuda_ipc", "cuda_vmm"]:
    """Pick how a CUDA storage is shared, or refuse (``not_shareable``) saying which setting.

    ``legacy_capable``: ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``;
    ``allowed_handle_types``: ``CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES``.
    """
    if legacy_capable:
        return "cuda_ipc"
    if not allowed_handle_types & cuda_driver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        raise HandleError(
            "not_shareable",
            "the KV cache is in memory that legacy CUDA IPC cannot share, and it was allocated "
            f"without a shareable handle type (allowed types {allowed_handle_types:#x}), so no "
            f"other process can map it. Causes: {ALLOC_SETTINGS}. vLLM's sleep-mode allocator "
            "requests no handle type: run engines that use kvsidecar without "
            "enable_sleep_mode, or without the setting named",
        )
    if not daemon_has_vmm:
        raise HandleError(
            "not_shareable",
            "the KV cache is in CUDA virtual memory (cuMemCreate) that legacy CUDA IPC cannot "
            f"share ({ALLOC_SETTINGS}), and this daemon does not announce the cuda_vmm "
            "capability that imports it: upgrade the daemon or turn that setting off",
        )
    return "cuda_vmm"


def plan_chunks(
    start: int, end: int, mapping_range: Callable[[int], tuple[int, int]]
) -> list[tuple[int, int]]:
    """Return the physical allocations behind ``[start, end)``, as ``(base, size)`` in order.

    ``mapping_range(ptr)`` answers the mapping ``ptr`` lies in. They must follow each other
    without a gap (one reserved range mapped piece by piece, as torch's expandable segments
    and ``cuMemCreate`` allocators do); the first may begin before ``start``.
    """
    if end <= start:
        raise HandleError("bad_request", "cannot share an empty range of GPU memory")
    chunks: list[tuple[int, int]] = []
    cur = start
    while cur < end:
        base, size = mapping_range(cur)
        if size <= 0 or not base <= cur < base + size:
            raise HandleError(
                "not_shareable",
                f"the driver places address {cur:#x} in a mapping at {base:#x} of {size} bytes",
            )
        if chunks and base != cur:
            raise HandleError("not_shareable", f"the memory at {cur:#x} is not mapped")
        chunks.append((base, size))
        if len(chunks) > MAX_CHUNKS:
            raise HandleError("not_shareable", f"the tensor spans over {MAX_CHUNKS} allocations")
        cur = base + size
    return chunks


def export_vmm_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    first_fd_index: int,
    drv: cuda_driver.Driver | None = None,
    uuid_of: Callable[[int], str] = device_uuid,
) -> tuple[list[CudaVmmHandle], list[FdSource]]:
    """Describe VMM-backed GPU tensors: their handles and the fds to send.

    Each fd is exported when its batch is sent (see `kvsidecar.memory.fd_client.FdSource`).

    Each distinct storage is exported once, chunk by chunk; ``fd_index`` counts from
    ``first_fd_index`` (the fds already in the registration).
    """
    drv = drv or cuda_driver.driver()
    sources: list[FdSource] = []
    spans: dict[int, tuple[int, list[int], int]] = {}  # storage address -> fd index, sizes, base
    uuids: dict[int, str] = {}
    handles = []
    for t in tensors:
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start not in spans:
            chunks = plan_chunks(start, start + storage.nbytes(), drv.mapping_range)
            spans[start] = (first_fd_index + len(sources), [s for _, s in chunks], chunks[0][0])
            sources.extend(_exporter(drv, base) for base, _ in chunks)
        fd_index, sizes, base = spans[start]
        index = t.device.index or 0
        if index not in uuids:
            uuids[index] = uuid_of(index)
        offset, nbytes = byte_span(t)
        handles.append(
            CudaVmmHandle(
                device=index,
                device_uuid=uuids[index],
                fd_index=fd_index,
                chunk_nbytes=sizes,
                offset=start - base + offset,
                nbytes=nbytes,
            )
        )
    return handles, sources


def _exporter(drv: cuda_driver.Driver, base: int) -> Callable[[], int]:
    return lambda: drv.export_fd(base)[0]


# Called by the daemon: import.


@dataclass(eq=False)
class Mapping:
    """Imported chunks mapped back to back at ``base`` (``nbytes`` in all) for one device."""

    drv: cuda_driver.Driver
    ordinal: int
    base: int
    chunk_nbytes: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes mapped."""
        return sum(self.chunk_nbytes)

    def close(self) -> None:
        """Unmap every chunk and give the address range back (the copies on it are done)."""
        _unmap(self.drv, self.ordinal, self.base, list(self.chunk_nbytes), len(self.chunk_nbytes))


def _unmap(drv: cuda_driver.Driver, ordinal: int, base: int, sizes: list[int], mapped: int) -> None:
    drv.use_device(ordinal)
    offset = 0
    for size in sizes[:mapped]:
        with contextlib.suppress(HandleError):  # unmap what can be: the range goes in any case
            drv.unmap(base + offset, size)
        offset += size
    drv.free_address(base, sum(sizes))


def import_chunks(
    drv: cuda_driver.Driver, ordinal: int, fds: Sequence[int], chunk_nbytes: Sequence[int]
) -> Mapping:
    """Import one fd per chunk and map them back to back on device ``ordinal``; all or nothing.

    The fds stay the caller's (imports hold their own references).
    """
    if len(fds) != len(chunk_nbytes) or not fds:
        raise HandleError("bad_handle", f"{len(chunk_nbytes)} chunks but {len(fds)} fds")
    if any(n <= 0 for n in chunk_nbytes):
        raise HandleError("bad_handle", "a VMM chunk of no bytes")
    sizes = list(chunk_nbytes)
    drv.use_device(ordinal)
    base = drv.reserve(sum(sizes))
    mapped = 0
    try:
        offset = 0
        for fd, size in zip(fds, sizes, strict=True):
            handle = drv.import_fd(fd)
            try:
                drv.map(base + offset, size, handle)
            finally:
                drv.release(handle)  # the mapping keeps the memory alive by itself
            mapped += 1
            offset += size
        drv.allow_read_write(base, offset, ordinal)
    except BaseException:
        _unmap(drv, ordinal, base, sizes, mapped)
        raise
    return Mapping(drv, ordinal, base, sizes)


class _CudaArray:
    """``__cuda_array_interface__`` (v2) over a mapping; torch keeps it alive with the storage."""

    def __init__(self, mapping: Mapping) -> None:
        self.__cuda_array_interface__ = {
            "shape": (mapping.nbytes,),
            "typestr": "|u1",
            "data": (mapping.base, False),
            "version": 2,
        }
        # Unmapped once torch frees the storage (the last view of it gone), on whatever thread.
        weakref.finalize(self, mapping.close)


def _as_tensor(mapping: Mapping) -> torch.Tensor:
    """Return the mapping as a flat ``uint8`` CUDA tensor (zero copy)."""
    return torch.as_tensor(_CudaArray(mapping), device=torch.device("cuda", mapping.ordinal))


def open_cuda_vmm_all(
    handles: Sequence[CudaVmmHandle],
    fds: Sequence[int],
    *,
    visible: Sequence[str] | None = None,
    drv: cuda_driver.Driver | None = None,
    wrap: Callable[[Mapping], torch.Tensor] = _as_tensor,
) -> list[MappedBuffer]:
    """Map each distinct set of chunks once; one buffer per handle, in order.

    ``fds`` are all of the registration's fds (borrowed: the caller closes them). Blocking
    (driver calls): call it off the event loop.
    """
    for h in handles:
        _check(h, len(fds))
    if visible is None:
        from kvsidecar.memory.cuda_ipc import visible_device_uuids

        visible = visible_device_uuids()
    drv = drv or cuda_driver.driver()
    flats: dict[tuple[int, int], torch.Tensor] = {}
    for h in handles:
        key = h.span_key()
        if key not in flats:
            ordinal = local_index(h.device_uuid, visible)
            chunk_fds = fds[h.fd_index : h.fd_index + len(h.chunk_nbytes)]
            flats[key] = wrap(import_chunks(drv, ordinal, chunk_fds, h.chunk_nbytes))
    return [
        TensorBuffer(flats[h.span_key()][h.offset : h.offset + h.nbytes], "cuda_vmm")
        for h in handles
    ]


def _check(h: CudaVmmHandle, nfds: int) -> None:
    """Refuse (``bad_handle``) what does not fit its own chunks or the fds sent."""
    canonical_uuid(h.device_uuid)
    if not h.chunk_nbytes or len(h.chunk_nbytes) > MAX_CHUNKS:
        raise HandleError("bad_handle", f"a cuda_vmm handle of {len(h.chunk_nbytes)} chunks")
    if any(n <= 0 for n in h.chunk_nbytes) or h.offset < 0 or h.nbytes < 0:
        raise HandleError("bad_handle", "negative or empty sizes in a cuda_vmm handle")
    if h.offset + h.nbytes > sum(h.chunk_nbytes):
        raise HandleError("bad_handle", "tensor bytes run past the end of its chunks")
    if h.fd_index < 0 or h.fd_index + len(h.chunk_nbytes) > nfds:
        raise HandleError(
            "bad_handle",
            f"chunks at fds {h.fd_index}..{h.fd_index + len(h.chunk_nbytes) - 1}, {nfds} fds sent",
        )
