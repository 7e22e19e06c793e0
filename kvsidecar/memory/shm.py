"""CPU shared memory between a worker and the daemon, by file descriptor.

The worker's tensors live in a memfd sealed against shrinking (`allocate_shared`; a storage that
torch's ``file_descriptor`` strategy put in an unlinked ``/dev/shm`` file is moved into one at
export). Such a file has no name: nothing can be left behind in ``/dev/shm`` whichever process
dies, and the kernel frees the pages when the last fd and the last mapping are gone. The seal is
what the daemon insists on: memory that its sender could truncate would SIGBUS the daemon's
copies. The fd itself crosses to the daemon over the fd channel (`fd_channel`); the
`ShmHandle` that travels in the registration message says which part of that file a tensor covers.

torch's private storage APIs are used here and nowhere else in the package.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import stat
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from kvsidecar.memory.base import HandleError, MappedBuffer, TensorBuffer
from kvsidecar.wire.types import ShmRef

_Storage: Any = torch.UntypedStorage
"""torch's private storage APIs behind one untyped name (torch has no stubs for them)."""

_PAGE = os.sysconf("SC_PAGE_SIZE")

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""A sealed memfd cannot be shrunk under the daemon's mapping (which would SIGBUS its copies)."""


ShmHandle = ShmRef
"""One CPU tensor's place inside a shared storage: the wire type `types.ShmRef`."""


def _as_flat(storage: torch.UntypedStorage) -> torch.Tensor:
    """View a whole storage as a 1-D uint8 tensor, without copying."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Return ``(offset, nbytes)``: the bytes of its storage that a (possibly strided) view reaches.

    Views such as a permuted HND cache or one layer of a big region are not contiguous in shape
    order but still cover one contiguous byte range, from the first element to the last.
    """
    itemsize = t.element_size()
    offset = int(t.storage_offset()) * itemsize
    if t.numel() == 0:
        return offset, 0
    if any(s < 0 for s in t.stride()):
        raise HandleError("bad_handle", "tensors with negative strides cannot be registered")
    last = sum((int(size) - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return offset, (last + 1) * itemsize


def allocate_shared(nbytes: int) -> torch.Tensor:
    """Allocate ``nbytes`` of shareable CPU memory as a flat ``uint8`` tensor, pages touched.

    The memory is a sealed memfd: it has no name anywhere (independent of torch's sharing
    strategy and of the size of ``/dev/shm``), and it cannot shrink under a mapping. Pages are
    written once here because first touch runs at a fraction of copy speed: the cost is paid at
    start-up instead of in the first transfer.
    """
    if nbytes <= 0:
        raise HandleError("bad_request", f"cannot allocate {nbytes} bytes")
    flat = _as_flat(_sealed_storage(nbytes))
    flat.zero_()
    return flat


def _sealed_storage(nbytes: int) -> torch.UntypedStorage:
    """Return a storage of ``nbytes`` in a new memfd sealed against shrinking and growing."""
    fd = os.memfd_create("kvsidecar", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        # torch dup()s the fd and keeps the dup for export, so ours is closed in any case.
        storage: torch.UntypedStorage = _Storage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    return storage


def _is_sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


def _reseal(storage: torch.UntypedStorage) -> int:
    """Move an fd-shared storage into a sealed memfd, in place; return the new fd.

    torch's file_descriptor strategy keeps shared storages in unlinked ``/dev/shm`` files, which
    cannot be sealed, and the daemon refuses memory that can shrink under it (a truncation would
    SIGBUS its copies). The bytes are copied once into a sealed memfd and the storage's data
    pointer is swapped, just as ``share_memory_()`` itself moves a storage: every tensor that
    views the storage follows. Processes that mapped the old file keep the old memory, so
    register before sharing the cache elsewhere (or allocate it with `allocate_kv_caches`).
    """
    swap = getattr(storage, "_swap_data_ptr_", None)
    if swap is None:  # torch too old to move a storage in place
        raise HandleError(
            "not_shared",
            "torch's fd-strategy memory can shrink and this torch cannot move it into a sealed "
            "memfd: allocate the cache with kvsidecar.memory.allocate_kv_caches()",
        )
    fresh = _sealed_storage(storage.nbytes())
    _as_flat(fresh).copy_(_as_flat(storage))
    swap(fresh)  # ``fresh`` now holds the old memory, freed with it
    fd: int = _Storage._get_shared_fd(storage)
    return fd


def allocate_kv_caches(
    num_layers: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    align: int = 4096,
) -> list[torch.Tensor]:
    """Allocate ``num_layers`` contiguous tensors of ``shape`` in ONE shared storage.

    Each layer starts on an ``align``-byte boundary. The whole region is exported with one fd, so
    the daemon maps it once however many layers it holds.
    """
    if num_layers <= 0 or align <= 0 or align & (align - 1):
        raise HandleError("bad_request", "num_layers must be > 0 and align a power of two")
    layer_nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if layer_nbytes == 0:
        raise HandleError("bad_request", f"empty layer shape {tuple(shape)}")
    pitch = -(-layer_nbytes // align) * align
    flat = allocate_shared(pitch * num_layers)
    return [
        flat[i * pitch : i * pitch + layer_nbytes].view(dtype).view(tuple(shape))
        for i in range(num_layers)
    ]


def _shared_fd(t: torch.Tensor) -> int:
    """Return the fd behind a tensor's storage; refuse anything but fd-shared CPU memory."""
    if t.device.type != "cpu":
        raise HandleError("wrong_device", f"shm handles are for CPU tensors, not {t.device}")
    storage = t.untyped_storage()
    # is_shared() first: _share_fd_cpu_() would silently move a private tensor into new memory.
    if storage.nbytes() == 0 or not storage.is_shared():
        raise HandleError(
            "not_shared",
            "the tensor is not in shared memory: allocate it with allocate_shared() or call "
            "share_memory_() under torch's file_descriptor strategy",
        )
    try:
        fd: int = _Storage._get_shared_fd(storage)
    except RuntimeError:
        # Shared by name (torch's file_system strategy): _share_fd_cpu_() would copy it into new
        # memory behind the engine's back, so refuse instead.
        raise HandleError(
            "not_shared",
            "the tensor is shared by file name (torch's file_system strategy); use the "
            "file_descriptor strategy or allocate_shared()",
        ) from None
    return fd if _is_sealed(fd) else _reseal(storage)


def export_tensor(t: torch.Tensor) -> tuple[ShmHandle, int]:
    """Describe a shared CPU tensor for the daemon: its handle and the fd to send with it.

    The fd belongs to the tensor's storage: it stays valid while the storage lives and must not
    be closed by the caller. Sending it (SCM_RIGHTS) gives the daemon its own copy.
    """
    fd = _shared_fd(t)
    offset, nbytes = byte_span(t)
    return ShmHandle(0, t.untyped_storage().nbytes(), offset, nbytes), fd


def export_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[ShmHandle], list[int]]:
    """Describe many shared CPU tensors; tensors of one storage share one entry of the fd list.

    Returns one handle per tensor (in order) and the distinct fds, each sent once.
    """
    handles: list[ShmHandle] = []
    fds: list[int] = []
    index_of: dict[tuple[int, int], int] = {}
    for t in tensors:
        handle, fd = export_tensor(t)
        st = os.fstat(fd)
        # Keyed by file identity, not fd number: two storages over one file still map once.
        key = (st.st_dev, st.st_ino)
        if key not in index_of:
            index_of[key] = len(fds)
            fds.append(fd)
        handles.append(msgspec.structs.replace(handle, fd_index=index_of[key]))
    return handles, fds


def _check_handle(handle: ShmHandle) -> None:
    if handle.storage_nbytes <= 0 or handle.offset < 0 or handle.nbytes < 0:
        raise HandleError("bad_handle", f"negative or empty sizes in {handle}")
    if handle.offset + handle.nbytes > handle.storage_nbytes:
        raise HandleError("bad_handle", f"tensor bytes run past the end of its storage: {handle}")


def _require_unshrinkable(fd: int, st: os.stat_result) -> None:
    """Refuse memory whose sender could still take pages away from under the daemon's mapping.

    Truncating a mapped file makes the next access to the lost pages raise SIGBUS, which would
    kill the daemon and every engine with it. Only a memfd sealed with ``F_SEAL_SHRINK`` is
    guaranteed to keep its size; files on disk or on tmpfs (torch's own fd-strategy storages are
    unlinked ``/dev/shm`` files) cannot be sealed. Huge-page memfds are refused too: a fault
    on a hole punched into one fails with SIGBUS when no huge page is free.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd at all: a file on disk
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise HandleError(
            "bad_fd",
            "the memory can shrink under the daemon (only a memfd sealed with F_SEAL_SHRINK is "
            "accepted; kvsidecar.memory.allocate_shared makes one, and the client seals "
            "share_memory_() storages at registration)",
        )
    if st.st_blksize != _PAGE:
        raise HandleError("bad_fd", f"huge-page memory (block size {st.st_blksize}) is refused")


def _map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """Map ``nbytes`` of a received fd; the fd is only borrowed (torch keeps its own dup)."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise HandleError("bad_fd", f"fd {fd} is not open: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HandleError("bad_fd", "the fd is not a shared-memory file")
    _require_unshrinkable(fd, st)
    if st.st_size < nbytes:
        # Mapping past the end of the file would SIGBUS the first copy that touches it.
        raise HandleError("bad_fd", f"file has {st.st_size} bytes, handle claims {nbytes}")
    try:
        storage = _Storage._new_shared_fd_cpu(fd, nbytes)
    except RuntimeError as e:
        raise HandleError("bad_fd", f"could not map the fd: {e}") from None
    return _as_flat(storage)


def open_shm(fd: int, handle: ShmHandle) -> MappedBuffer:
    """Map one received fd and return the buffer the handle describes (``fd_index`` ignored).

    Takes ownership of ``fd``: it is closed before returning, also on error. The mapping lasts
    until the buffer is closed (and no other view of it is alive).
    """
    return open_shm_all([fd], [msgspec.structs.replace(handle, fd_index=0)])[0]


def open_shm_all(fds: Sequence[int], handles: Sequence[ShmHandle]) -> list[MappedBuffer]:
    """Map every fd of a registration once and return one buffer per handle, in order.

    Takes ownership of all ``fds``: each is closed before returning, also on error, and also if
    no handle names it. Handles that share an fd share its one mapping; it is unmapped when the
    last of their buffers is closed.
    """
    try:
        needed: dict[int, int] = {}
        for h in handles:
            _check_handle(h)
            if not 0 <= h.fd_index < len(fds):
                raise HandleError("bad_handle", f"fd_index {h.fd_index} but {len(fds)} fds sent")
            needed[h.fd_index] = max(needed.get(h.fd_index, 0), h.storage_nbytes)
        regions = {index: _map_fd(fds[index], nbytes) for index, nbytes in needed.items()}
    finally:
        for fd in fds:
            _close_quietly(fd)
    return [
        TensorBuffer(regions[h.fd_index][h.offset : h.offset + h.nbytes], "shm") for h in handles
    ]


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
