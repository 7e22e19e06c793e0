"""An independent model of vLLM's CPU KV-cache block (the ``vllm_cpu`` arrangement).

Per block and head: K transposed ``(head_size, block_size)``, then V ``(block_size, head_size)``,
packed as ``(blocks, heads, block_size, 2 * head_size)``. Written element by element from that
description, so the daemon's layout code is checked against something it does not share.
"""

from __future__ import annotations

import itertools

import torch


def write_token(block: torch.Tensor, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store token ``t``'s K and V ``(H, C)`` in one block ``(H, N, 2C)``, element by element."""
    heads, n, two_c = block.shape
    c = two_c // 2
    flat = block.reshape(heads, n * two_c)
    for h, d in itertools.product(range(heads), range(c)):
        flat[h, d * n + t] = k[h, d]  # K transposed: row d, column t
        flat[h, n * c + t * c + d] = v[h, d]  # V: row t, column d


def packed_cache(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token-major K, V ``(T, H, C)`` as vllm_cpu blocks of ``block_size`` tokens."""
    tokens, heads, c = k.shape
    blocks = torch.zeros(-(-tokens // block_size), heads, block_size, 2 * c, dtype=k.dtype)
    for t in range(tokens):
        write_token(blocks[t // block_size], t % block_size, k[t], v[t])
    return blocks


def packed_cache_from_block(block: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K, V ``(N, H, C)`` back from one block, element by element."""
    heads, _, two_c = block.shape
    c = two_c // 2
    flat = block.reshape(heads, n * two_c)
    k = torch.zeros(n, heads, c, dtype=block.dtype)
    v = torch.zeros(n, heads, c, dtype=block.dtype)
    for t, h, d in itertools.product(range(n), range(heads), range(c)):
        k[t, h, d] = flat[h, d * n + t]
        v[t, h, d] = flat[h, n * c + t * c + d]
    return k, v
