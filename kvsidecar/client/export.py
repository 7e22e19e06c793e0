"""Tensor export for a registration.

Each KV tensor is described from its shape and strides and handed over by handle, never copied:
CPU tensors in shared memory by fd (shm), GPU tensors by legacy CUDA IPC where the driver says it
can share them, else by CUDA VMM fds when the daemon imports those (`choose_export` refuses,
naming the allocator setting, when neither works).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from kvsidecar.core import layout
from kvsidecar.memory import cuda_driver
from kvsidecar.memory.cuda_ipc import export_cuda_tensors
from kvsidecar.memory.cuda_vmm import choose_export, export_vmm_tensors
from kvsidecar.memory.fd_client import FdSource
from kvsidecar.memory.shm import export_tensors
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import Arrangement, HandleRef, LayerSpec, MemoryOrder


def export_layers(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    arrangement: Arrangement,
    memory_order: MemoryOrder | None,
    shape_order: layout.ShapeOrder,
    capabilities: Collection[str] = (),
) -> tuple[list[LayerSpec], list[FdSource]]:
    """Describe and export every tensor: the layer specs, and the fds to send.

    CPU tensors must live in shared memory (`kvsidecar.memory.allocate_kv_caches`, or
    ``share_memory_()`` under torch's file_descriptor strategy); CUDA tensors go by CUDA IPC,
    or by CUDA VMM fds when ``capabilities`` (the daemon's) has ``cuda_vmm``.
    """
    if not kv_caches:
        raise SidecarError("invalid_message", "kv_caches is empty")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    descs = [
        layout.describe_tensor(
            t, arrangement=arrangement, memory_order=memory_order, shape_order=shape_order
        )
        for t in tensors
    ]
    cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    gpu = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
    if len(cpu) + len(gpu) != len(tensors):
        raise SidecarError("invalid_message", "KV tensors must be on the CPU or a CUDA device")
    # The memory modules' handles are the wire types (ShmHandle is ShmRef, CudaIpcHandle is
    # CudaIpcRef, CudaVmmHandle is CudaVmmRef): they go into the request as they are.
    handles: dict[int, HandleRef] = {}
    sources: list[FdSource] = []
    if cpu:
        shm, fds = export_tensors([tensors[i] for i in cpu])
        handles.update(zip(cpu, shm, strict=True))
        sources += fds
    if gpu:
        ipc, vmm = _split_gpu(tensors, gpu, daemon_has_vmm="cuda_vmm" in capabilities)
        if ipc:
            handles.update(zip(ipc, export_cuda_tensors([tensors[i] for i in ipc]), strict=True))
        if vmm:
            vmm_handles, chunk_fds = export_vmm_tensors(
                [tensors[i] for i in vmm], first_fd_index=len(sources)
            )
            handles.update(zip(vmm, vmm_handles, strict=True))
            sources += chunk_fds
    specs = [LayerSpec(n, d, handles[i]) for i, (n, d) in enumerate(zip(names, descs, strict=True))]
    return specs, sources


def _split_gpu(
    tensors: list[torch.Tensor], gpu: list[int], *, daemon_has_vmm: bool
) -> tuple[list[int], list[int]]:
    """Sort GPU tensors by how their storage can be shared: ``(legacy IPC, VMM)`` indexes."""
    drv = cuda_driver.driver()
    how: dict[int, str] = {}
    ipc: list[int] = []
    vmm: list[int] = []
    for i in gpu:
        ptr = tensors[i].untyped_storage().data_ptr()
        if ptr not in how:
            drv.use_device(tensors[i].device.index or 0)  # the driver asks this thread's context
            legacy = drv.legacy_ipc_capable(ptr)
            how[ptr] = choose_export(
                legacy_capable=legacy,
                allowed_handle_types=0 if legacy else drv.allowed_handle_types(ptr),
                daemon_has_vmm=daemon_has_vmm,
            )
        (ipc if how[ptr] == "cuda_ipc" else vmm).append(i)
    return ipc, vmm
