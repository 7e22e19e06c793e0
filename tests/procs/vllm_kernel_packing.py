"""Pack random K and V with vLLM's own CPU kernel and compare with tests/support/vllm_layout.py.

Run with ``.venv-vllm``'s Python and the checkout on ``PYTHONPATH``
(tests/vllm/test_engines.py). For the ISA vLLM picks for the test model's caches (bfloat16, head
size 32, blocks of 32 and 64 tokens) and for ``vec`` (vLLM's portable kernels), on caches of
several shapes, prints one JSON line: ``{"isa": <vLLM's pick>, "checks": [[isa, block size, head
size, heads, arrangement, equal], ...]}``.
"""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.support.vllm_layout import packed_cache

ARRANGEMENT_OF_ISA = {"vec": "vllm_cpu", "amx": "vllm_cpu_amx"}


def kernel_packed(k: torch.Tensor, v: torch.Tensor, n: int, isa: str) -> torch.Tensor:
    """K, V ``(T, H, C)`` written into blocks of ``n`` tokens by vLLM's reshape-and-cache."""
    tokens, heads, c = k.shape
    blocks = -(-tokens // n)
    kv = torch.zeros(blocks, heads, n, 2 * c, dtype=k.dtype)
    key_cache, value_cache = kv.view(blocks, heads, 2 * n, c).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, torch.arange(tokens), isa, kv_cache_dtype="auto"
    )
    return kv


def main() -> None:
    """Print the checks (see the module doc)."""
    picked = _get_attn_isa(torch.bfloat16, 32, 32, "auto")
    checks = []
    for isa in sorted({picked, "vec"}):
        arrangement = ARRANGEMENT_OF_ISA.get(isa)
        for n, c, heads in ((32, 32, 2), (64, 32, 2), (32, 64, 3), (64, 128, 1)):
            gen = torch.Generator().manual_seed(n * 1000 + c * 10 + heads)
            tokens = 2 * n + 7  # two full blocks and part of a third
            k = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
            v = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
            got = kernel_packed(k, v, n, isa)
            equal = arrangement is not None and torch.equal(got, packed_cache(k, v, n, arrangement))
            checks.append([isa, n, c, heads, arrangement, bool(equal)])
    print(json.dumps({"isa": picked, "checks": checks}), flush=True)


if __name__ == "__main__":
    main()
