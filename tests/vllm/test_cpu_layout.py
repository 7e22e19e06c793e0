"""vLLM's CPU cache layouts (``vllm_cpu``, ``vllm_cpu_amx``): descriptors, views, the block-size
fix, a daemon move.

The layouts (checked against vLLM 0.32's own ``cpu_attn_reshape_and_cache`` kernel by the
connector at start-up, and in tests/vllm/test_engines.py): a layer is ``(B, H, N, 2C)``; per
block and head the first ``N*C`` elements hold K, the next ``N*C`` V: for ``vllm_cpu`` (the ``vec``
kernels) K transposed ``(C, N)`` and V ``(N, C)``, for ``vllm_cpu_amx`` (the ``amx`` kernels)
tiles of 16 tokens (K) or 16 channels (V), see tests/support/vllm_layout.py. The expectations
here are written token by token from those definitions, not from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsidecar.client import BufferSetRef, SidecarClient
from kvsidecar.core import layout
from kvsidecar.core.fixes import fix_received
from kvsidecar.core.layout import LayoutError
from kvsidecar.memory import allocate_kv_caches
from kvsidecar.peer.handshake import IncompatiblePeer, check_compatible, compat_hash
from kvsidecar.peer.messages import CompatInfo, PeerEngine
from kvsidecar.wire.types import Arrangement, BufferDescriptor
from tests.support.daemons import daemon_process, make_config
from tests.support.vllm_layout import packed_cache, packed_cache_from_block

pytestmark = pytest.mark.timeout(120)


def test_describe_view_and_block_rows() -> None:
    t = torch.arange(5 * 3 * 4 * 6, dtype=torch.float32).view(5, 3, 4, 6)
    desc = layout.describe_tensor(t, arrangement="vllm_cpu")
    assert desc == BufferDescriptor("vllm_cpu", "HND", "float32", 5, 4, 3, 3)
    assert layout.block_bytes(desc) == layout.block_len(desc) == 3 * 4 * 6 * 4
    assert layout.buffer_nbytes(desc) == t.numel() * 4
    view = layout.view_buffer(t.view(-1).view(torch.uint8), desc)
    assert view.shape == t.shape and torch.equal(view, t)
    (rows,) = layout.block_views(t, desc)
    for b in range(5):
        assert torch.equal(rows[b], t[b].reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("shape", "why"),
    [((5, 3, 4, 5), "even last dim"), ((5, 3, 4), "4 dims")],
)
def test_describe_refuses_what_is_not_the_layout(shape: tuple[int, ...], why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        layout.describe_tensor(torch.zeros(shape), arrangement="vllm_cpu")
    with pytest.raises(LayoutError, match="contiguous"):
        layout.describe_tensor(torch.zeros(3, 5, 4, 6).transpose(0, 1), arrangement="vllm_cpu")


@pytest.mark.parametrize(
    ("arrangement", "remote_n", "ratio", "heads", "head_size", "dtype"),
    [
        ("vllm_cpu", 4, 2, 2, 4, torch.bfloat16),
        ("vllm_cpu", 4, 4, 3, 2, torch.float16),
        ("vllm_cpu", 4, 2, 1, 8, torch.float32),
        ("vllm_cpu", 4, 1, 2, 4, torch.float32),
        # The amx tiles: 16 tokens of K, 16 channels of V.
        ("vllm_cpu_amx", 32, 2, 2, 32, torch.bfloat16),
        ("vllm_cpu_amx", 16, 4, 3, 16, torch.bfloat16),
        ("vllm_cpu_amx", 32, 3, 1, 48, torch.float16),
        ("vllm_cpu_amx", 32, 1, 2, 16, torch.bfloat16),
    ],
)
def test_fix_reblocks_packed_remote_blocks(
    arrangement: Arrangement,
    remote_n: int,
    ratio: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> None:
    local_n = remote_n * ratio
    tokens = 3 * local_n - remote_n + 1  # the last local block is partly filled
    gen = torch.Generator().manual_seed(ratio * 100 + heads)
    k = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    v = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    remote = packed_cache(k, v, remote_n, arrangement)
    want = packed_cache(k, v, local_n, arrangement)
    local = torch.full((6, heads, local_n, 2 * head_size), 7.0, dtype=dtype)
    targets = [4, 1, 5]
    # A raw copy: remote blocks in token order, ``ratio`` of them per local block.
    rows = local.view(6, -1)
    per = remote[0].numel()
    for j, b in enumerate(targets):
        for i in range(ratio):
            src = j * ratio + i
            if src < len(remote):
                rows[b, i * per : (i + 1) * per] = remote[src].reshape(-1)
            else:
                rows[b, i * per : (i + 1) * per] = 0
    untouched = local[[0, 2, 3]].clone()
    fix_received(
        local,
        targets,
        remote_layout="HND",
        local_layout="HND",
        block_size_ratio=ratio,
        arrangement=arrangement,
    )
    for j, b in enumerate(targets):
        # Tokens past the end are zero in both (the padding of the last remote block).
        assert torch.equal(local[b], want[j]), f"local block {b}"
    assert torch.equal(local[[0, 2, 3]], untouched)


def test_fix_refuses_a_ratio_that_does_not_divide() -> None:
    cache = torch.zeros(2, 2, 6, 8)
    with pytest.raises(LayoutError, match="divide"):
        fix_received(
            cache, [0], remote_layout="HND", local_layout="HND", block_size_ratio=4,
            arrangement="vllm_cpu",
        )  # fmt: skip


@pytest.mark.parametrize("arrangement", ["vllm_cpu", "vllm_cpu_amx"])
def test_daemon_moves_between_block_sizes_32_and_64(arrangement: Arrangement) -> None:
    """Two engines of vLLM's CPU layout on one daemon: blocks of 32 tokens land in blocks of 64."""
    heads, c, layers = 2, 16, 2
    gen = torch.Generator().manual_seed(5)
    src_caches = allocate_kv_caches(layers, (12, heads, 32, 2 * c), torch.bfloat16)
    dst_caches = allocate_kv_caches(layers, (8, heads, 64, 2 * c), torch.bfloat16)
    tokens = 150  # 5 source blocks (the last partly filled), 3 destination blocks
    kvs = []
    src_ids = [3, 7, 1, 10, 5]
    for cache in src_caches:
        k = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
        v = torch.randn(tokens, heads, c, generator=gen).to(torch.bfloat16)
        blocks = packed_cache(k, v, 32, arrangement)
        for j, b in enumerate(src_ids):
            cache[b].copy_(blocks[j])
        kvs.append((k, v))
    dst_ids = [6, 2, 4]
    src_ids_padded = [*src_ids, 0]  # the destination's last block takes 2 source blocks
    with daemon_process(make_config()) as d, SidecarClient(d.config.endpoint) as client:
        client.register_kv_caches(
            {f"l{i}": t for i, t in enumerate(src_caches)},
            engine_id="p",
            arrangement=arrangement,
        )
        src = BufferSetRef(client.worker)
        with SidecarClient(d.config.endpoint) as other:
            other.register_kv_caches(
                {f"l{i}": t for i, t in enumerate(dst_caches)},
                engine_id="d",
                arrangement=arrangement,
            )
            client.grant("d", read=True)
            moved = other.move(src, BufferSetRef(other.worker), src_ids_padded, dst_ids)
            assert moved.fixed and moved.blocks == 3
            for (k, v), cache in zip(kvs, dst_caches, strict=True):
                want = packed_cache(k, v, 64, arrangement)
                got = cache[dst_ids]
                # Tokens 150..159 of the last block come from source block 0, not from the
                # request: only the request's tokens are compared there.
                np.testing.assert_array_equal(got[:2].float().numpy(), want[:2].float().numpy())
                last = packed_cache(k[128:], v[128:], 32, arrangement)[0]  # tokens 128..149 of 22
                got_tail = packed_cache_from_block(got[2], 64, arrangement)
                want_tail = packed_cache_from_block(last, 32, arrangement)
                for t in range(22):
                    assert torch.equal(got_tail[0][t], want_tail[0][t])
                    assert torch.equal(got_tail[1][t], want_tail[1][t])


def test_the_amx_layout_needs_its_tiles_and_is_never_read_as_the_vec_one() -> None:
    with pytest.raises(LayoutError, match="16"):
        layout.describe_tensor(torch.zeros(4, 2, 24, 64), arrangement="vllm_cpu_amx")
    desc = layout.describe_tensor(torch.zeros(4, 2, 32, 64), arrangement="vllm_cpu_amx")
    assert desc == BufferDescriptor("vllm_cpu_amx", "HND", "float32", 4, 32, 2, 32)
    # Two engines whose blocks are packed by different vLLM CPU kernels: one region per block
    # each, but never compatible (the daemon's moves refuse them on the arrangement too).
    compat = CompatInfo("m", "bfloat16", 32, 2, 1, False)

    def engine(arrangement: Arrangement) -> PeerEngine:
        return PeerEngine(
            engine_id=arrangement,
            compat=compat,
            compat_hash=compat_hash(compat),
            tp_size=1,
            pp_size=1,
            dcp_size=1,
            arrangement=arrangement,
            memory_order="HND",
            block_size=32,
            workers=[],
        )

    check_compatible(engine("vllm_cpu_amx"), engine("vllm_cpu_amx"))
    with pytest.raises(IncompatiblePeer, match="pack a block differently"):
        check_compatible(engine("vllm_cpu_amx"), engine("vllm_cpu"))
    with pytest.raises(IncompatiblePeer, match="pack a block differently"):
        check_compatible(engine("split"), engine("vllm_cpu_amx"))
