"""GPU tensors shared with the daemon through legacy CUDA IPC handles, the way torch shares them.

The worker calls torch's ``_share_cuda_()`` on the tensor's storage: that yields a CUDA IPC memory
handle plus a slot in a shared reference counter. The daemon opens it with
``UntypedStorage._new_shared_cuda`` (what ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
does, without its multiprocessing reducer). While the daemon's storage lives, the worker's torch
keeps the memory allocated even if the worker frees its tensor; closing the daemon's buffer drops
the count.

What this module adds to torch's own path, because engines and daemons live in different
containers:

- **Device identity.** A handle names its GPU by UUID (``device_uuid``); the daemon opens it on
  its own index of that GPU (`local_index`), and refuses it (``device_not_visible``) when it
  cannot see that GPU, instead of opening it on whatever GPU has the worker's index here.
- **One open, one release per storage.** Every ``_share_cuda_()`` call takes one count, so each
  export must be opened (or released) exactly once: `export_cuda_tensors` shares each storage
  once, `open_cuda_ipc_all` opens each storage once and gives back the counts of duplicates at
  once, as torch's own rebuild does. The storage's count is dropped once, when its last view here
  is freed.
- **Handles that survive a torch upgrade on one side.** torch >= 2.3 wraps the 64-byte
  ``cudaIpcMemHandle_t`` in a versioned string; the wire carries the bare 64 bytes
  (`legacy_ipc_handle`), which every torch version opens.
- **Typed refusals.** A malformed handle (sizes, a missing event handle) is ``bad_handle``
  before any CUDA call, also on a daemon without CUDA; memory that legacy IPC cannot share is
  ``not_shareable`` with the setting that caused it (see `kvsidecar.memory.cuda_vmm`).

The CUDA calls themselves go through an `IpcBackend` (torch's, `TorchIpc`), so that the
bookkeeping above is exercised on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import torch

from kvsidecar.memory.base import HandleError, MappedBuffer, TensorBuffer
from kvsidecar.memory.shm import _as_flat, byte_span
from kvsidecar.wire.types import CudaIpcRef

__all__ = [
    "IPC_HANDLE_BYTES",
    "CudaIpcHandle",
    "IpcBackend",
    "TorchIpc",
    "canonical_uuid",
    "check_cuda_handle",
    "device_uuid",
    "export_cuda_tensor",
    "export_cuda_tensors",
    "legacy_ipc_handle",
    "local_index",
    "open_cuda_ipc",
    "open_cuda_ipc_all",
    "plan_opens",
    "visible_device_uuids",
]

_Storage: Any = torch.UntypedStorage
"""torch's private storage APIs behind one untyped name (torch has no stubs for them)."""
_cuda: Any = torch.cuda

IPC_HANDLE_BYTES = 64
"""Size of ``cudaIpcMemHandle_t`` and ``cudaIpcEventHandle_t``."""
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

CudaIpcHandle = CudaIpcRef
"""A CUDA tensor's IPC export: the wire type `kvsidecar.wire.types.CudaIpcRef`."""


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise HandleError("cuda_unavailable", "this torch has no usable CUDA device")


def canonical_uuid(text: str) -> str:
    """Return a GPU UUID as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower case).

    Accepts nvidia-smi's form, torch's (no ``GPU-`` prefix) and bare hex; ``bad_handle`` for
    anything that is not 16 bytes of hex.
    """
    digits = text.strip().lower()
    if digits.startswith("gpu-"):
        digits = digits[4:]
    digits = digits.replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        raise HandleError("bad_handle", f"not a GPU UUID: {text!r}")
    d = digits
    return f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def device_uuid(index: int) -> str:
    """Return the UUID of this process's CUDA device ``index`` (`canonical_uuid` form)."""
    raw: Any = torch.cuda.get_device_properties(index).uuid
    # torch gives the 16 bytes as a list of ints (also for MIG instances, whose text form is
    # not a GPU UUID); its text form is the fallback.
    data = getattr(raw, "bytes", None)
    if data is not None and len(data) == 16:
        return canonical_uuid(bytes(data).hex())
    return canonical_uuid(str(raw))


def local_index(uuid: str, visible: Sequence[str]) -> int:
    """Return the local index of the GPU ``uuid``, given the UUIDs seen here in index order.

    Raises ``device_not_visible`` when it is not among them: the daemon must not open another
    GPU's memory (or another pod's) because it happens to have the same index.
    """
    want = canonical_uuid(uuid)
    for index, seen in enumerate(visible):
        if canonical_uuid(seen) == want:
            return index
    raise HandleError(
        "device_not_visible",
        f"the daemon cannot see GPU {want} (it sees {len(visible)}: "
        f"{', '.join(visible) or 'none'}); give the daemon that GPU (see docs/operations.md)",
    )


def visible_device_uuids() -> list[str]:
    """Return the UUIDs of the CUDA devices seen here, by index (initialises CUDA once)."""
    return list(_visible_device_uuids())


@functools.cache
def _visible_device_uuids() -> tuple[str, ...]:
    _require_cuda()  # raises, and an exception is not cached
    return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))


# Called by the worker: export.


def legacy_ipc_handle(handle: bytes) -> bytes:
    """Return the bare 64-byte ``cudaIpcMemHandle_t`` inside torch's shareable handle.

    torch >= 2.3 sends ``version byte, type byte, handle``; older torch the bare handle. Type
    ``e`` (an expandable segment) is refused: it is not a legacy IPC handle at all.
    """
    if len(handle) == IPC_HANDLE_BYTES:
        return handle
    if len(handle) >= 2 and handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise HandleError(
            "not_shareable",
            "the storage is in an expandable segment, which legacy CUDA IPC cannot share",
        )
    if len(handle) == IPC_HANDLE_BYTES + 2 and handle[1] == _SHAREABLE_CUDA_MALLOC:
        return handle[2:]
    raise HandleError("bad_handle", f"a {len(handle)}-byte CUDA IPC handle is not one torch makes")


def export_cuda_tensors(tensors: Sequence[torch.Tensor]) -> list[CudaIpcHandle]:
    """Describe GPU tensors for the daemon, sharing each distinct storage once."""
    _require_cuda()
    shared: dict[int, tuple[Any, ...]] = {}
    uuids: dict[int, str] = {}
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
            shared[key] = tuple(_Storage._share_cuda_(storage))
        device, ipc, size, st_off, rc, rc_off, event, event_sync = shared[key]
        index = int(device)
        if index not in uuids:
            uuids[index] = device_uuid(index)
        offset, nbytes = byte_span(t)
        handles.append(
            CudaIpcHandle(
                device=index,
                ipc_handle=legacy_ipc_handle(bytes(ipc)),
                storage_nbytes=int(size),
                storage_offset=int(st_off),
                ref_counter_handle=bytes(rc),
                ref_counter_offset=int(rc_off),
                event_handle=None if event is None else bytes(event),
                event_sync_required=bool(event_sync),
                offset=offset,
                nbytes=nbytes,
                device_uuid=uuids[index],
            )
        )
    return handles


def export_cuda_tensor(t: torch.Tensor) -> CudaIpcHandle:
    """Describe one GPU tensor for the daemon (see `export_cuda_tensors`)."""
    return export_cuda_tensors([t])[0]


# Called by the daemon: open.


def check_cuda_handle(handle: CudaIpcHandle) -> CudaIpcHandle:
    """Check a handle from the wire without touching CUDA; returns it with a bare IPC handle.

    Everything torch's ``_new_shared_cuda`` would trip over with a ``TypeError`` or worse is a
    ``bad_handle`` here.
    """
    if handle.storage_nbytes <= 0 or handle.offset < 0 or handle.nbytes < 0:
        raise HandleError("bad_handle", "negative or empty sizes in a cuda_ipc handle")
    if handle.storage_offset < 0 or handle.ref_counter_offset < 0 or handle.device < 0:
        raise HandleError("bad_handle", "negative offset or device in a cuda_ipc handle")
    if handle.offset + handle.nbytes > handle.storage_nbytes:
        raise HandleError("bad_handle", "tensor bytes run past the end of its storage")
    if not handle.ref_counter_handle or b"\0" in handle.ref_counter_handle:
        raise HandleError("bad_handle", "the reference-counter name is empty or not a file name")
    if handle.event_sync_required and (
        handle.event_handle is None or len(handle.event_handle) != IPC_HANDLE_BYTES
    ):
        raise HandleError(
            "bad_handle",
            f"event_sync_required needs a {IPC_HANDLE_BYTES}-byte event_handle, got "
            f"{'none' if handle.event_handle is None else len(handle.event_handle)}",
        )
    if handle.device_uuid:
        canonical_uuid(handle.device_uuid)
    bare = legacy_ipc_handle(handle.ipc_handle)
    return handle if bare is handle.ipc_handle else msgspec.structs.replace(handle, ipc_handle=bare)


class IpcBackend(Protocol):
    """The CUDA calls of opening handles (`TorchIpc`; tests without a GPU bring their own)."""

    def visible_uuids(self) -> list[str]:
        """UUIDs of this process's CUDA devices, by index (initialises CUDA)."""
        ...

    def open_storage(self, index: int, handle: CudaIpcHandle) -> torch.Tensor:
        """Open a storage on device ``index``: a flat ``uint8`` tensor over all of it.

        Its reference count is dropped when the last tensor viewing it is freed.
        """
        ...

    def release_counter(self, handle: CudaIpcHandle) -> None:
        """Give back the reference count of an export that is not opened."""
        ...


class TorchIpc:
    """`IpcBackend` through torch's private storage APIs (what ``rebuild_cuda_tensor`` uses)."""

    def visible_uuids(self) -> list[str]:
        """See `IpcBackend.visible_uuids`."""
        return visible_device_uuids()

    def open_storage(self, index: int, handle: CudaIpcHandle) -> torch.Tensor:
        """See `IpcBackend.open_storage`."""
        _cuda._lazy_init()
        try:
            storage = _Storage._new_shared_cuda(
                index,
                handle.ipc_handle,
                handle.storage_nbytes,
                handle.storage_offset,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle if handle.event_sync_required else None,
                handle.event_sync_required,
            )
        except (RuntimeError, TypeError) as e:
            raise HandleError("bad_handle", f"could not open the CUDA IPC handle: {e}") from None
        return _as_flat(storage)

    def release_counter(self, handle: CudaIpcHandle) -> None:
        """See `IpcBackend.release_counter`."""
        # Best effort, as in torch: the worker may have exited and taken the counter file.
        with contextlib.suppress(RuntimeError):
            _Storage._release_ipc_counter_cuda(handle.ref_counter_handle, handle.ref_counter_offset)


def plan_opens(handles: Sequence[CudaIpcHandle]) -> tuple[list[int], list[int]]:
    """Decide which handles open a storage and which only give their count back.

    Returns ``(opens, releases)``, indexes into ``handles``: the first handle of each storage
    opens it; a later handle with another reference-counter slot is a second export of the same
    storage and releases its slot at once; a later handle with the same slot (a view of one
    export) does neither.
    """
    opens: list[int] = []
    releases: list[int] = []
    seen_storage: set[tuple[bytes, int]] = set()
    seen_counter: set[tuple[bytes, int]] = set()
    for i, h in enumerate(handles):
        counter = (h.ref_counter_handle, h.ref_counter_offset)
        if h.storage_key() not in seen_storage:
            seen_storage.add(h.storage_key())
            opens.append(i)
        elif counter not in seen_counter:
            releases.append(i)
        seen_counter.add(counter)
    return opens, releases


def open_cuda_ipc_all(
    handles: Sequence[CudaIpcHandle], backend: IpcBackend | None = None
) -> list[MappedBuffer]:
    """Open each distinct storage once and return one buffer per handle, in order.

    Every handle is checked before any CUDA call. The storage (and the worker's memory) stays
    alive until the last buffer over it is closed. Open each export once only: its count is
    dropped when its storage here is freed, and a second open would drop it twice. Blocking
    (CUDA initialisation, ``cudaIpcOpenMemHandle``): call it off the event loop.
    """
    checked = [check_cuda_handle(h) for h in handles]
    if backend is None:
        _require_cuda()
        backend = TorchIpc()
    visible = backend.visible_uuids()
    indexes = [_index_of(h, visible) for h in checked]
    opens, releases = plan_opens(checked)
    opened: dict[tuple[bytes, int], torch.Tensor] = {}
    try:
        for i in opens:
            opened[checked[i].storage_key()] = backend.open_storage(indexes[i], checked[i])
    except BaseException:
        # A storage that opened gives its count back when it is freed; every other export's
        # count is given back here, or the worker's torch would keep that memory forever.
        done = {checked[i].storage_key() for i in opens if checked[i].storage_key() in opened}
        opened.clear()
        for i in opens:
            if checked[i].storage_key() not in done:
                backend.release_counter(checked[i])
        for i in releases:
            backend.release_counter(checked[i])
        raise
    for i in releases:
        backend.release_counter(checked[i])
    return [
        TensorBuffer(opened[h.storage_key()][h.offset : h.offset + h.nbytes], "cuda_ipc")
        for h in checked
    ]


def _index_of(handle: CudaIpcHandle, visible: Sequence[str]) -> int:
    if handle.device_uuid:
        return local_index(handle.device_uuid, visible)
    # An older client: its index is all there is, right only where both see the same GPUs.
    if handle.device >= len(visible):
        raise HandleError("device_not_visible", f"no CUDA device {handle.device} here")
    return handle.device


def open_cuda_ipc(handle: CudaIpcHandle, backend: IpcBackend | None = None) -> MappedBuffer:
    """Open one handle (see `open_cuda_ipc_all`)."""
    return open_cuda_ipc_all([handle], backend)[0]
