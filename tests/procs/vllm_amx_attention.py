"""Run vLLM's amx attention kernel once, in a fresh process, and check what it computes.

Run with ``.venv-vllm``'s Python and the checkout on ``PYTHONPATH`` (tests/vllm/test_engines.py), as
``python -m tests.procs.vllm_amx_attention ask|no-ask``. With ``ask`` the process first calls the
connector's `kvsidecar.integrations.vllm.cpu_kernels.request_amx` (Linux's permission to use AMX
tiles); with ``no-ask`` nothing in it has asked. Then K and V of 130 tokens go into a bfloat16 cache
of 64-token blocks through ``cpu_attn_reshape_and_cache`` (isa ``amx``), and one query token attends
to them through ``cpu_attention_with_kv_cache``, as a decode engine's first step after a pulled
prompt does. The output is compared with softmax(q K^T / sqrt(C)) V computed here in float32; prints
one JSON line ``{"max_error": ...}``. Without the permission, the kernel's first AMX instruction
kills the process (SIGILL) before it prints."""

from __future__ import annotations

import json
import sys

import torch
from vllm import _custom_ops as ops

from kvsidecar.integrations.vllm.cpu_kernels import request_amx

HEADS, C, N, TOKENS = 2, 32, 64, 130


def main() -> None:
    """Run the kernel (see the module doc) and print its error against the reference."""
    if sys.argv[1] == "ask":
        request_amx()
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(TOKENS, HEADS, C, generator=gen).to(torch.bfloat16)
    v = torch.randn(TOKENS, HEADS, C, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, HEADS, C, generator=gen).to(torch.bfloat16)
    blocks = -(-TOKENS // N)
    kv = torch.zeros(blocks, HEADS, N, 2 * C, dtype=torch.bfloat16)
    key_cache, value_cache = kv.view(blocks, HEADS, 2 * N, C).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, torch.arange(TOKENS), "amx", kv_cache_dtype="auto"
    )
    out = torch.zeros_like(q)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([TOKENS], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    meta = ops.cpu_attn_get_scheduler_metadata(
        1, HEADS, HEADS, C, seq_lens, torch.bfloat16, starts, True, -1, "amx", False
    )
    scale = C**-0.5
    ops.cpu_attention_with_kv_cache(
        q,
        key_cache,
        value_cache,
        out,
        starts,
        seq_lens,
        scale,
        True,
        None,
        -1,
        table,
        0.0,
        meta,
        None,
    )
    # The reference: the query is the last token, so it sees all of them (causal or not).
    scores = torch.einsum("hc,thc->ht", q[0].float(), k.float()) * scale
    want = torch.einsum("ht,thc->hc", scores.softmax(dim=-1), v.float())
    print(json.dumps({"max_error": float((out[0].float() - want).abs().max())}), flush=True)


if __name__ == "__main__":
    main()
