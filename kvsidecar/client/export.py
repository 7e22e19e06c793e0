"""Tensor export for a registration.

Each KV tensor is described from its shape and strides and handed over by handle (shm fd or CUDA
IPC), never copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvsidecar.core import layout
from kvsidecar.memory.cuda_ipc import export_cuda_tensors
from kvsidecar.memory.shm import export_tensors
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import Arrangement, HandleRef, LayerSpec, MemoryOrder


def export_layers(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    arrangement: Arrangement,
    memory_order: MemoryOrder | None,
    shape_order: layout.ShapeOrder,
) -> tuple[list[LayerSpec], list[int]]:
    """Describe and export every tensor: the layer specs, and the shm fds to send (not owned).

    CPU tensors must live in shared memory (`kvsidecar.memory.allocate_kv_caches`, or
    ``share_memory_()`` under torch's file_descriptor strategy); CUDA tensors go by CUDA IPC.
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
    # CudaIpcRef): they go into the request as they are.
    handles: dict[int, HandleRef] = {}
    fds: list[int] = []
    if cpu:
        shm, fds = export_tensors([tensors[i] for i in cpu])
        handles.update(zip(cpu, shm, strict=True))
    if gpu:
        handles.update(zip(gpu, export_cuda_tensors([tensors[i] for i in gpu]), strict=True))
    specs = [LayerSpec(n, d, handles[i]) for i, (n, d) in enumerate(zip(names, descs, strict=True))]
    return specs, fds
