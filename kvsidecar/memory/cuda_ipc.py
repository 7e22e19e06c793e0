"""GPU tensors shared with the daemon through CUDA IPC handles, the way torch shares them.

The worker calls torch's ``_share_cuda_()`` on the tensor's storage: that yields a CUDA IPC memory
handle plus a slot in a shared reference counter. The daemon opens it with
``UntypedStorage._new_shared_cuda`` (what ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
does, without its multiprocessing reducer). While the daemon's storage lives, the worker's torch
keeps the memory allocated even if the worker frees its tensor; closing the daemon's buffer drops
the count.

Every ``_share_cuda_()`` call takes one count, so each export must be opened (or released) exactly
once: `export_cuda_tensors` shares each storage once, `open_cuda_ipc_all` opens each storage once
and releases the counts of duplicates, as torch's own rebuild does.

On a CPU-only torch every function here raises `HandleError` with code ``"cuda_unavailable"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvsidecar.memory.base import HandleError, MappedBuffer, TensorBuffer
from kvsidecar.memory.shm import _as_flat, byte_span
from kvsidecar.wire.types import CudaIpcRef

_Storage: Any = torch.UntypedStorage
"""torch's private storage APIs behind one untyped name (torch has no stubs for them)."""
_cuda: Any = torch.cuda


CudaIpcHandle = CudaIpcRef
"""A CUDA tensor's IPC export: the wire type `kvsidecar.wire.types.CudaIpcRef`."""


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise HandleError("cuda_unavailable", "this torch has no usable CUDA device")


def export_cuda_tensors(tensors: Sequence[torch.Tensor]) -> list[CudaIpcHandle]:
    """Describe GPU tensors for the daemon, sharing each distinct storage once."""
    _require_cuda()
    shared: dict[int, Any] = {}
    handles = []
    for t in tensors:
        if t.device.type != "cuda":
            raise HandleError(
                "wrong_device", f"cuda_ipc handles are for CUDA tensors, not {t.device}"
            )
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            raise HandleError("bad_request", "cannot share an empty storage")
        # Keyed by the storage's address: views of one storage take one reference count.
        key = storage.data_ptr()
        if key not in shared:
            shared[key] = _Storage._share_cuda_(storage)
        device, ipc, size, st_off, rc, rc_off, event, event_sync = shared[key]
        offset, nbytes = byte_span(t)
        handles.append(
            CudaIpcHandle(
                device=int(device),
                ipc_handle=bytes(ipc),
                storage_nbytes=int(size),
                storage_offset=int(st_off),
                ref_counter_handle=bytes(rc),
                ref_counter_offset=int(rc_off),
                event_handle=None if event is None else bytes(event),
                event_sync_required=bool(event_sync),
                offset=offset,
                nbytes=nbytes,
            )
        )
    return handles


def export_cuda_tensor(t: torch.Tensor) -> CudaIpcHandle:
    """Describe one GPU tensor for the daemon (see `export_cuda_tensors`)."""
    return export_cuda_tensors([t])[0]


def _check(handle: CudaIpcHandle) -> None:
    if handle.storage_nbytes <= 0 or handle.offset < 0 or handle.nbytes < 0:
        raise HandleError("bad_handle", "negative or empty sizes in a cuda_ipc handle")
    if handle.offset + handle.nbytes > handle.storage_nbytes:
        raise HandleError("bad_handle", "tensor bytes run past the end of its storage")
    if not 0 <= handle.device < torch.cuda.device_count():
        raise HandleError("bad_handle", f"no CUDA device {handle.device} here")


def open_cuda_ipc_all(handles: Sequence[CudaIpcHandle]) -> list[MappedBuffer]:
    """Open each distinct storage once and return one buffer per handle, in order.

    The storage (and the worker's memory) stays alive until the last buffer over it is closed.
    Open each export once only: its count is dropped when its storage here is freed, and a second
    open would drop it twice.
    """
    _require_cuda()
    for h in handles:
        _check(h)
    _cuda._lazy_init()
    opened: dict[tuple[bytes, int], torch.Tensor] = {}
    counters: set[tuple[bytes, int]] = set()
    buffers: list[MappedBuffer] = []
    for h in handles:
        key = h.storage_key()
        counter = (h.ref_counter_handle, h.ref_counter_offset)
        if key not in opened:
            try:
                storage = _Storage._new_shared_cuda(
                    h.device,
                    h.ipc_handle,
                    h.storage_nbytes,
                    h.storage_offset,
                    h.ref_counter_handle,
                    h.ref_counter_offset,
                    h.event_handle,
                    h.event_sync_required,
                )
            except RuntimeError as e:
                raise HandleError(
                    "bad_handle", f"could not open the CUDA IPC handle: {e}"
                ) from None
            opened[key] = _as_flat(storage)
        elif counter not in counters:
            # A second export of the same storage took its own count: give it back now, as
            # torch's rebuild_cuda_tensor does for a storage it already has open.
            _Storage._release_ipc_counter_cuda(h.ref_counter_handle, h.ref_counter_offset)
        counters.add(counter)
        flat = opened[key]
        buffers.append(TensorBuffer(flat[h.offset : h.offset + h.nbytes], "cuda_ipc"))
    return buffers


def open_cuda_ipc(handle: CudaIpcHandle) -> MappedBuffer:
    """Open one handle (see `open_cuda_ipc_all`)."""
    return open_cuda_ipc_all([handle])[0]
