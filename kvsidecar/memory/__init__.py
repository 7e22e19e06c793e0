"""Buffer handles: how a worker's KV cache (or the daemon's host pool) becomes a `MappedBuffer`.

A worker exports its tensors as handles (`ShmHandle` for CPU shared memory, whose fds go over the
fd channel; `CudaIpcHandle` for GPU memory that legacy CUDA IPC shares; `CudaVmmHandle` for GPU
memory from ``cuMemCreate``, whose fds also go over the fd channel) that travel inside the
registration message. The
daemon opens them by kind with `open_handles` and from then on only sees flat byte views. The
daemon's own host memory comes from `HostPool` and is a `MappedBuffer` of kind ``"host_pool"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.memory.base import (
    BufferKind,
    HandleError,
    HandleErrorCode,
    MappedBuffer,
    TensorBuffer,
)
from kvsidecar.memory.cuda_ipc import (
    CudaIpcHandle,
    IpcBackend,
    export_cuda_tensor,
    export_cuda_tensors,
    open_cuda_ipc,
    open_cuda_ipc_all,
)
from kvsidecar.memory.cuda_vmm import CudaVmmHandle, open_cuda_vmm_all
from kvsidecar.memory.fd_channel import FdChannelServer, FdConnection
from kvsidecar.memory.fd_client import (
    MAX_FDS,
    FdChannelClient,
    PeerCred,
    new_token,
    recv_fds,
    send_fds,
)
from kvsidecar.memory.host_pool import BlockIdAllocator, Extent, HostPool, layer_views
from kvsidecar.memory.shm import (
    ShmHandle,
    allocate_kv_caches,
    allocate_shared,
    byte_span,
    export_tensor,
    export_tensors,
    open_shm,
    open_shm_all,
)

BufferHandle = ShmHandle | CudaIpcHandle | CudaVmmHandle
"""Any handle a worker can send; a tagged union on the wire (tag field ``kind``)."""

__all__ = [
    "MAX_FDS",
    "BlockIdAllocator",
    "BufferHandle",
    "BufferKind",
    "CudaIpcHandle",
    "CudaVmmHandle",
    "Extent",
    "FdChannelClient",
    "FdChannelServer",
    "FdConnection",
    "HandleError",
    "HandleErrorCode",
    "HostPool",
    "IpcBackend",
    "MappedBuffer",
    "PeerCred",
    "ShmHandle",
    "TensorBuffer",
    "allocate_kv_caches",
    "allocate_shared",
    "byte_span",
    "export_cuda_tensor",
    "export_cuda_tensors",
    "export_tensor",
    "export_tensors",
    "layer_views",
    "new_token",
    "open_cuda_ipc",
    "open_cuda_ipc_all",
    "open_handle",
    "open_handles",
    "open_shm",
    "open_shm_all",
    "recv_fds",
    "send_fds",
]


def open_handles(
    handles: Sequence[BufferHandle],
    fds: Sequence[int] = (),
    *,
    cuda_backend: IpcBackend | None = None,
) -> list[MappedBuffer]:
    """Open a registration's handles by kind; one buffer per handle, in order.

    ``fds`` are the fds received under the registration's tokens; ownership passes here and every
    one of them is closed before returning, also on error. Each shared storage is mapped once.
    On error nothing stays open. Blocking (mapping; CUDA initialisation and IPC opens): the
    daemon calls it off its event loop. ``cuda_backend``: see `IpcBackend` (default torch's).
    """
    shm = [h for h in handles if isinstance(h, ShmHandle)]
    cuda = [h for h in handles if isinstance(h, CudaIpcHandle)]
    vmm = [h for h in handles if isinstance(h, CudaVmmHandle)]
    try:
        # VMM chunks only borrow their fds; open_shm_all below closes every fd it is given.
        vmm_buffers = open_cuda_vmm_all(vmm, fds) if vmm else []
    except BaseException:
        open_shm_all(fds, [])
        raise
    opened: list[MappedBuffer] = list(vmm_buffers)
    try:
        shm_buffers = open_shm_all(fds, shm)
        opened += shm_buffers
        cuda_buffers = open_cuda_ipc_all(cuda, cuda_backend) if cuda else []
    except BaseException:
        for b in opened:
            b.close()
        raise
    by_kind = {
        "shm": iter(shm_buffers),
        "cuda_ipc": iter(cuda_buffers),
        "cuda_vmm": iter(vmm_buffers),
    }
    return [next(by_kind[h.kind]) for h in handles]


def open_handle(handle: BufferHandle, fd: int | None = None) -> MappedBuffer:
    """Open one handle by kind; an `ShmHandle` needs its ``fd`` (taken over and closed)."""
    match handle:
        case ShmHandle():
            if fd is None:
                raise HandleError("bad_handle", "an shm handle needs its fd")
            return open_shm(fd, handle)
        case CudaIpcHandle():
            if fd is not None:
                raise HandleError("bad_handle", "a cuda_ipc handle takes no fd")
            return open_cuda_ipc(handle)
        case CudaVmmHandle():
            fds = [] if fd is None else [fd]
            return open_handles([handle], fds)[0]
