"""KV caches for tests: shared-memory tensors of random bits that tell every block apart."""

from __future__ import annotations

import torch

from kvsidecar.memory.shm import allocate_kv_caches


def random_caches(layers: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """``layers`` float16 tensors of ``shape`` in shared memory, each element random bits.

    Random bits include NaN patterns: compare them bit for bit (``view(torch.int16)``).
    """
    caches = allocate_kv_caches(layers, shape, torch.float16)
    gen = torch.Generator().manual_seed(seed)
    for t in caches:
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, generator=gen))
    return caches
