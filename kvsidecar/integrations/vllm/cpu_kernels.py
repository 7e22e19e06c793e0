"""vLLM's CPU cache, as its kernels pack it: checked with the kernels themselves.

On a CPU vLLM 0.32 gives every layer a 4-D ``(B, H, N, 2C)`` tensor whose packing inside a block
belongs to the attention kernels it picked (`kvsidecar.wire.types.Arrangement`: ``vllm_cpu`` for
the ``vec`` kernels, ``vllm_cpu_amx`` for the ``amx`` ones). `cpu_packing` writes two blocks with
vLLM's own kernel and compares them with each definition, element by element, so that a layout is
never assumed. The kernels come from `kvsidecar.integrations.vllm.connector` (`CpuKernels`):
nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvsidecar.core.layout import CPU_PACKED
from kvsidecar.wire.types import Arrangement

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")


@dataclasses.dataclass(frozen=True)
class CpuKernels:
    """The two functions of vLLM's CPU attention the check uses."""

    isa: Callable[..., Any]
    """``_get_attn_isa(dtype, block_size, head_size, cache_dtype)``: the kernels vLLM picks."""
    reshape_and_cache: Callable[..., Any]
    """``ops.cpu_attn_reshape_and_cache``: writes tokens' K and V into cache blocks."""


def cpu_packing(
    t: torch.Tensor, cache_dtype: str, kernels: CpuKernels | None
) -> Arrangement | None:
    """Return the arrangement whose packing vLLM's CPU kernel writes for this cache, or None.

    Written with the kernel itself (the ISA vLLM picks for this dtype and block size), on a
    scratch cache of two blocks, with values exact in the cache's dtype, and compared element by
    element with each arrangement's definition (`_packed_by_definition`): ``vllm_cpu`` (the
    ``vec`` kernels: K transposed, then V) or ``vllm_cpu_amx`` (the ``amx`` kernels' tiles).
    ``kernels``: vLLM's, None where it has no CPU kernels.
    """
    if kernels is None:
        return None
    _, heads, n, c2 = t.shape
    c = c2 // 2
    isa = kernels.isa(t.dtype, n, c, cache_dtype)
    tokens = n + 3  # one full block and part of a second
    pos = torch.arange(tokens).view(-1, 1, 1)
    val = (pos * 7 + torch.arange(heads).view(1, -1, 1) * 3 + torch.arange(c).view(1, 1, -1)) % 97
    key, value = (val + 1).to(t.dtype), (-val - 1).to(t.dtype)
    kv = torch.zeros(2, heads, n, c2, dtype=t.dtype)
    key_cache, value_cache = kv.view(2, heads, 2 * n, c).chunk(2, dim=2)
    kernels.reshape_and_cache(
        key, value, key_cache, value_cache, torch.arange(tokens), isa, kv_cache_dtype=cache_dtype
    )
    for arrangement in CPU_PACKED:
        want = _packed_by_definition(arrangement, key, value, n)
        if want is not None and torch.equal(kv, want):
            return arrangement
    log.info("kvsidecar: vLLM's %s kernel packs the CPU cache in no known way: opaque", isa)
    return None


def request_amx() -> None:
    """Ask Linux to let this process use AMX tiles, which vLLM's amx attention needs.

    Linux grants AMX to a process only once it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); an
    AMX instruction before that is an illegal instruction. vLLM 0.32's ``amx`` attention kernel
    does not ask: an engine survives only if something asked first, such as a oneDNN bfloat16
    GEMM large enough for AMX. A decode engine whose first forward is a pulled prompt's last
    token got SIGILL in ``cpu_attention_with_kv_cache`` (docs/vllm.md, "AMX"); the same kernel,
    called in a fresh process, dies the same way, and lives once the process has asked.
    """
    init = getattr(torch.cpu, "_init_amx", None)
    if init is None or not init():
        log.warning("kvsidecar: the CPU cache is amx-packed but Linux did not grant AMX")


def _packed_by_definition(
    arrangement: Arrangement, key: torch.Tensor, value: torch.Tensor, n: int
) -> torch.Tensor | None:
    """Pack token-major K, V ``(T, H, C)`` into blocks ``(2, H, n, 2C)`` as ``arrangement`` says.

    The definitions of `kvsidecar.wire.types.Arrangement`; None where they cannot hold ``n``
    tokens of ``C`` channels (the amx tiles need multiples of 16).
    """
    tokens, heads, c = key.shape
    tok = torch.arange(tokens).view(-1, 1)
    ch = torch.arange(c).view(1, -1)
    block, t = tok // n, tok % n
    if arrangement == "vllm_cpu":
        at_k, at_v = ch * n + t, n * c + t * c + ch  # K transposed: row d, column t
    else:
        if n % 16 or c % 16:
            return None
        at_k = ((t // 16) * (c // 2) + ch // 2) * 32 + (t % 16) * 2 + ch % 2
        at_v = n * c + ((ch // 16) * (n // 2) + t // 2) * 32 + (ch % 16) * 2 + t % 2
    want = torch.zeros(2, heads, n * 2 * c, dtype=key.dtype)
    blocks = block.expand(tokens, c)
    # Indexed (tokens, C, heads): the two index tensors broadcast first, the heads slice last.
    want[blocks, :, at_k.expand(tokens, c)] = key.permute(0, 2, 1)
    want[blocks, :, at_v.expand(tokens, c)] = value.permute(0, 2, 1)
    return want.view(2, heads, n, 2 * c)
