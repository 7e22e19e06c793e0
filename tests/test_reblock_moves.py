"""Moves and local pulls between caches of different block sizes, for every dense arrangement.

One daemon process, engines registered from this process over real shared memory. A source
engine with 4-token blocks is moved (``move``, and ``move_batch`` with checksums) and pulled
(a local pull through the same daemon) into engines with 4-, 8- and 16-token blocks, in every
memory-order pair. Each destination block is compared, element by element, with the source
blocks laid end to end along the token dim of the logical tensors: plain indexing here, none
of kvsidecar's layout code. ``blocks_first`` holds K and V in one row per block; re-blocked
moves once wrote the source's K and V both into the destination's K half (the pull was right).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvsidecar.client import BatchMove, BufferSetRef, SidecarClient, WorkerRef
from kvsidecar.memory import allocate_kv_caches
from tests.support.daemons import DaemonProcess, daemon_process, make_config

pytestmark = pytest.mark.timeout(180)

HEADS, HEAD_SIZE, BLOCKS, SRC_TOKENS = 2, 4, 12, 4
ORDERS = [("NHD", "NHD"), ("HND", "HND"), ("HND", "NHD"), ("NHD", "HND")]
CASES = [(arr, *orders) for arr in ("kv_first", "blocks_first", "split") for orders in ORDERS]
CASES.append(("mla", "NHD", "NHD"))
_counter = iter(range(10_000))


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process(make_config(peer_lease_s=30.0)) as d:
        yield d


def _memory_shape(arrangement: str, tokens: int, order: str) -> list[int]:
    """The tensor as allocated: the logical shape with N and H swapped for HND."""
    if arrangement == "mla":
        return [BLOCKS, tokens, HEAD_SIZE]
    shape = {"kv_first": [2, BLOCKS], "blocks_first": [BLOCKS, 2]}.get(arrangement, [BLOCKS])
    shape += [HEADS, tokens, HEAD_SIZE] if order == "HND" else [tokens, HEADS, HEAD_SIZE]
    return shape


def _logical(cache: torch.Tensor, arrangement: str, order: str) -> torch.Tensor:
    """(..., N, H, C) whatever the memory order; mla as it is."""
    return cache.transpose(-3, -2) if arrangement != "mla" and order == "HND" else cache


def _block(logical: torch.Tensor, arrangement: str, b: int) -> torch.Tensor:
    """Block ``b``'s K and V (or latent) with tokens in dim 1: ``(2 or 1, N, ...)``."""
    if arrangement == "kv_first":
        return logical[:, b]
    if arrangement == "blocks_first":
        return logical[b]
    return logical[b].unsqueeze(0)


class _Engine:
    """A registered engine: its client, its one layer and how to read that layer's blocks."""

    def __init__(
        self, endpoint: str, arrangement: str, tokens: int, order: str, dtype: torch.dtype
    ) -> None:
        index = next(_counter)
        self.name = f"e{index}"
        self.arrangement, self.order = arrangement, order
        self.cache = allocate_kv_caches(1, _memory_shape(arrangement, tokens, order), dtype)[0]
        gen = torch.Generator().manual_seed(index)  # every engine's values differ
        self.cache.copy_(torch.randn(self.cache.shape, generator=gen).to(dtype))
        self.client = SidecarClient(endpoint, name=self.name)
        self.client.register_kv_caches(
            {"layer0": self.cache},
            engine_id=self.name,
            arrangement=arrangement,  # type: ignore[arg-type]
            memory_order=order,  # type: ignore[arg-type]
            shape_order="HN" if order == "HND" and arrangement != "mla" else "NH",
        )
        self.ref = BufferSetRef(WorkerRef(self.name))

    def block(self, b: int) -> torch.Tensor:
        return _block(_logical(self.cache, self.arrangement, self.order), self.arrangement, b)

    def close(self) -> None:
        self.client.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits: compared exactly (a 0.0 where -0.0 was written would not pass)."""
    return t.contiguous().view(torch.int16)


def _check(src: _Engine, dst: _Engine, src_ids: list[int], dst_ids: list[int], how: str) -> None:
    ratio = len(src_ids) // len(dst_ids)
    for j, d in enumerate(dst_ids):
        want = torch.cat([src.block(s) for s in src_ids[j * ratio : (j + 1) * ratio]], dim=1)
        assert torch.equal(_bits(dst.block(d)), _bits(want)), (
            f"{how}: {src.arrangement} {src.order} -> {dst.order}, ratio {ratio}, block {d}"
        )


@pytest.mark.parametrize(("arrangement", "src_order", "dst_order"), CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reblocked_moves_and_pulls_lay_tokens_end_to_end(
    daemon: DaemonProcess, arrangement: str, src_order: str, dst_order: str, dtype: torch.dtype
) -> None:
    endpoint = daemon.config.endpoint
    src = _Engine(endpoint, arrangement, SRC_TOKENS, src_order, dtype)
    engines: list[_Engine] = [src]
    try:
        with SidecarClient(endpoint) as admin:
            for ratio in (1, 2, 4):
                src_ids = [9, 2, 3, 11, 0, 5, 7, 4][: 2 * ratio]  # two destination blocks' worth
                for how in ("move", "move_batch", "pull"):
                    dst = _Engine(endpoint, arrangement, SRC_TOKENS * ratio, dst_order, dtype)
                    engines.append(dst)
                    dst_ids = [6, 1]
                    if how == "move":
                        moved = admin.move(src.ref, dst.ref, src_ids, dst_ids)
                        assert moved.blocks == 2
                    elif how == "move_batch":
                        batch = admin.move_batch(
                            [BatchMove(src.ref, dst.ref, src_ids, dst_ids)], checksum=True
                        )
                        result = batch.results[0]
                        assert not result.error_code and not result.invalid_block_ids, result
                    else:
                        src.client.publish(src.name, f"r{dst.name}", src_ids)
                        pulled = dst.client.submit_pull(
                            dst.name, "", src.name, {f"r{dst.name}": (src_ids, dst_ids)}, tp_rank=0
                        ).result()
                        assert pulled.finished == [f"r{dst.name}"], pulled
                    _check(src, dst, src_ids, dst_ids, how)
    finally:
        for engine in engines:
            engine.close()
