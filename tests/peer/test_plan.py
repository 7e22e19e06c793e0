"""The transfer plan of a pull (`kvsidecar.peer.plan.plan_rank`), checked byte by byte.

Each case builds a producer and a consumer engine the way the handshake describes them, fills
every producer rank's layer buffers with distinct values (a value says which layer, K or V, block,
token, head and channel it is, and for DCP which token shard), applies the byte ranges of each
consumer rank's plan to zeroed consumer buffers, and compares them with what that rank should hold,
computed here from first principles:

- a consumer rank holds its own heads (a range of the model's heads, or one replica of a head when
  the TP size exceeds the head count; MLA and DCP ranks hold all of them);
- a consumer block with ``r`` times the producer's block size is filled as ``r`` sub-regions in
  token order, each the producer block's tokens of the consumer's heads in the producer's memory
  order (`kvsidecar.core.layout.fix_received` rearranges them afterwards; the plan says when);
- with DCP (same TP and DCP sizes on both sides), rank ``q`` reads producer rank ``q``'s shard.

Also checked: no consumer byte is written twice (replicated heads are read once), the bytes the
plan moves, which producer ranks are notified, how many readers each has, and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np
import pytest

from kvsidecar.core.topology import EngineTransferInfo
from kvsidecar.peer.messages import CompatInfo, PeerEngine, PeerWorker
from kvsidecar.peer.plan import PlanError, RankPlan, plan_rank
from kvsidecar.wire.types import BufferDescriptor

ITEM = np.dtype("<u4")
"""The element the test's buffers hold: a 4-byte value tag, declared as float32 to the plan."""
HEAD_SIZE = 4


@dataclass(frozen=True)
class Side:
    """One engine's sizes, as a test case states them."""

    tp: int
    heads: int
    """KV heads of the whole model (1 for MLA)."""
    block_size: int
    order: str = "HND"
    arrangement: str = "kv_first"
    dcp: int = 1
    pp: int = 1
    blocks: int = 12
    layers: tuple[str, ...] = ("l0", "l1")

    @property
    def mla(self) -> bool:
        return self.arrangement == "mla"

    def heads_of(self, rank: int) -> list[int]:
        """The model heads rank ``rank`` holds."""
        if self.mla or self.dcp > 1:
            return list(range(self.heads))
        if self.tp <= self.heads:
            per = self.heads // self.tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank // (self.tp // self.heads)]  # replicas: tp / heads ranks per head

    def layers_of(self, pp_rank: int) -> list[str]:
        per = len(self.layers) // self.pp
        return list(self.layers[pp_rank * per : (pp_rank + 1) * per])

    def descriptor(self, rank: int) -> BufferDescriptor:
        heads = 1 if self.mla else len(self.heads_of(rank))
        order = "NHD" if self.mla else self.order
        return BufferDescriptor(
            self.arrangement,  # type: ignore[arg-type]
            order,  # type: ignore[arg-type]
            "float32",
            self.blocks,
            self.block_size,
            heads,
            HEAD_SIZE,
        )

    def engine(self, engine_id: str) -> PeerEngine:
        """The engine as a handshake describes it."""
        workers = []
        for pp in range(self.pp):
            names = self.layers_of(pp)
            for rank in range(self.tp):
                desc = self.descriptor(rank)
                region = desc.block_size * desc.num_heads * HEAD_SIZE * ITEM.itemsize
                transfer = EngineTransferInfo(
                    remote_tp_size=self.tp,
                    remote_block_len=region,
                    remote_block_size=self.block_size,
                    remote_physical_blocks_per_logical=1,
                    remote_pp_rank=pp,
                    remote_dcp_size=self.dcp,
                )
                workers.append(
                    PeerWorker(
                        tp_rank=rank,
                        pp_rank=pp,
                        dcp_rank=rank % self.dcp,
                        layers=names,
                        descriptors=[desc] * len(names),
                        transfer=transfer,
                    )
                )
        compat = CompatInfo(
            model_hash="m",
            cache_dtype="float32",
            head_size=HEAD_SIZE,
            total_kv_heads=self.heads,
            num_layers=len(self.layers),
            is_mla=self.mla,
        )
        return PeerEngine(
            engine_id=engine_id,
            compat=compat,
            compat_hash="same",
            tp_size=self.tp,
            pp_size=self.pp,
            dcp_size=self.dcp,
            arrangement=self.arrangement,  # type: ignore[arg-type]
            memory_order="NHD" if self.mla else self.order,  # type: ignore[arg-type]
            block_size=self.block_size,
            workers=workers,
        )


# --------------------------------------------------------------------------------------------
# The model: values, memory images, what a consumer rank should hold


def model_values(side: Side, layer: int, shard: int = 0) -> np.ndarray:
    """Every producer value of one layer (and DCP token shard), all heads, each one distinct.

    Shape ``(2, B, N, H, C)``, or ``(B, N, C)`` for MLA; zero is never a value (it means "not
    written" in the consumer's buffers).
    """
    shape = (
        (side.blocks, side.block_size, HEAD_SIZE)
        if side.mla
        else (2, side.blocks, side.block_size, side.heads, HEAD_SIZE)
    )
    n = int(np.prod(shape))
    first = (layer * side.dcp + shard) * n + 1
    return np.arange(first, first + n, dtype=ITEM).reshape(shape)


def rank_values(side: Side, rank: int, layer: int) -> np.ndarray:
    """What producer rank ``rank`` holds of one layer, in logical shape."""
    values = model_values(side, layer, shard=rank % side.dcp)
    return values if side.mla else values[:, :, :, side.heads_of(rank)]


def memory_image(side: Side, logical: np.ndarray) -> np.ndarray:
    """A rank's layer buffer (as ITEMs) holding ``logical`` ((2, B, N, h, C) or (B, N, C))."""
    if side.mla:
        return np.ascontiguousarray(logical).reshape(-1)
    blocks = logical.transpose(0, 1, 3, 2, 4) if side.order == "HND" else logical
    if side.arrangement == "blocks_first":
        blocks = blocks.transpose(1, 0, 2, 3, 4)
    return np.ascontiguousarray(blocks).reshape(-1)


def region_start(side: Side, kv: int, block: int, region: int) -> int:
    """Where region ``kv`` (K or V) of ``block`` starts in a buffer, in ITEMs."""
    if side.mla:
        return block * region
    if side.arrangement == "blocks_first":
        return (block * 2 + kv) * region
    return (kv * side.blocks + block) * region


def wanted_heads(remote: Side, local: Side, rank: int) -> list[int]:
    """The model heads a consumer rank receives, as indexes into a producer rank's values."""
    if local.mla or local.dcp > 1:
        return list(range(remote.heads))
    return local.heads_of(rank)


def received(
    remote: Side, local: Side, rank: int, layer: int, remote_ids: list[int], local_ids: list[int]
) -> list[tuple[int, int, np.ndarray]]:
    """Per producer block pulled: the consumer block, the sub-block (token range) it fills, and
    its values of the consumer rank's heads ((2, N, h, C), or (N, C) for MLA)."""
    ratio = local.block_size // remote.block_size
    source = model_values(remote, layer, shard=rank % remote.dcp)
    heads = wanted_heads(remote, local, rank)
    return [
        (local_ids[i // ratio], i % ratio, source[rb] if local.mla else source[:, rb][:, :, heads])
        for i, rb in enumerate(remote_ids)
    ]


def packed(remote: Side, local: Side, rank: int, blocks: list[Any]) -> np.ndarray:
    """A consumer rank's layer buffer right after the plan's reads (before any layout fix)."""
    ratio = local.block_size // remote.block_size
    heads = 1 if local.mla else len(wanted_heads(remote, local, rank))
    region = local.block_size * heads * HEAD_SIZE
    out = np.zeros(local.blocks * region * (1 if local.mla else 2), dtype=ITEM)
    for lb, sub, values in blocks:
        for kv in range(1 if local.mla else 2):
            block = values if local.mla else values[kv]  # MLA: (N, C), one order only
            if not local.mla and remote.order == "HND":
                block = block.transpose(1, 0, 2)
            start = region_start(local, kv, lb, region) + sub * (region // ratio)
            out[start : start + block.size] = block.reshape(-1)
    return out


def final(remote: Side, local: Side, rank: int, blocks: list[Any]) -> np.ndarray:
    """The same buffer once it reads right: the consumer's layout of the tokens it received."""
    n = remote.block_size
    heads = 1 if local.mla else len(wanted_heads(remote, local, rank))
    shape = (2, local.blocks, local.block_size, heads, HEAD_SIZE)
    logical = np.zeros(shape[1:3] + shape[4:] if local.mla else shape, dtype=ITEM)
    for lb, sub, values in blocks:
        if local.mla:
            logical[lb, sub * n : (sub + 1) * n] = values
        else:
            logical[:, lb, sub * n : (sub + 1) * n] = values
    return memory_image(local, logical)


def notified(remote: Side, local: Side, rank: int) -> list[tuple[int, int]]:
    """The producer workers (tp rank, pp rank) a consumer rank reports to: those it maps to."""
    if local.dcp > 1:
        ranks = [rank]
    elif local.tp >= remote.tp:
        ranks = [rank // (local.tp // remote.tp)]
    else:
        per = remote.tp // local.tp
        ranks = list(range(rank * per, (rank + 1) * per))
    return sorted((q, pp) for q in ranks for pp in range(remote.pp))


def readers(remote: Side, local: Side) -> int:
    """How many consumer ranks read each producer rank."""
    if local.dcp > 1:
        return 1  # rank to rank
    return max(1, local.tp // remote.tp)


# --------------------------------------------------------------------------------------------
# Applying a plan to buffers


def producer_buffers(remote: Side) -> dict[tuple[int, int, str], np.ndarray]:
    """Every producer worker's layer buffers, as bytes, keyed (tp rank, pp rank, layer)."""
    out = {}
    for pp in range(remote.pp):
        for rank in range(remote.tp):
            for name in remote.layers_of(pp):
                layer = remote.layers.index(name)
                image = memory_image(remote, rank_values(remote, rank, layer))
                out[(rank, pp, name)] = image.view(np.uint8)
    return out


def run_plan(
    plan: RankPlan,
    sources: dict[tuple[int, int, str], np.ndarray],
    sizes: dict[str, int],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Copy every range of ``plan`` into zeroed buffers; the buffers and how often each byte
    was written."""
    buffers = {name: np.zeros(size, dtype=ITEM) for name, size in sizes.items()}
    writes = {name: np.zeros(size * ITEM.itemsize, dtype=np.int32) for name, size in sizes.items()}
    for read in plan.reads:
        assert read.ranges.shape[0] == read.dest.shape[0]
        for (r_layer, r_off, length), (l_layer, l_off) in zip(
            read.ranges.tolist(), read.dest.tolist(), strict=True
        ):
            source = sources[
                (read.remote_tp_rank, read.remote_pp_rank, read.remote_layers[r_layer])
            ]
            name = read.local_layers[l_layer]
            assert r_off >= 0 and l_off >= 0 and length > 0
            assert r_off + length <= source.size, "read past the producer's buffer"
            target = buffers[name].view(np.uint8)
            assert l_off + length <= target.size, "write past the consumer's buffer"
            target[l_off : l_off + length] = source[r_off : r_off + length]
            writes[name][l_off : l_off + length] += 1
    return buffers, writes


# --------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    remote: Side
    local: Side
    remote_ids: list[int] = field(default_factory=lambda: [7, 2, 3, 11, 0, 5])
    local_ids: list[int] = field(default_factory=lambda: [4, 0, 9, 6, 1, 3])
    max_frame: int = 1 << 20

    def ids(self) -> tuple[list[int], list[int]]:
        """The case's ids cut to the block-size ratio: every local block gets ``ratio`` blocks."""
        ratio = self.local.block_size // self.remote.block_size
        local = self.local_ids[: len(self.remote_ids) // ratio]
        return self.remote_ids[: len(local) * ratio], local


CASES: dict[str, Case] = {
    "same_tp": Case(Side(2, 4, 4), Side(2, 4, 4)),
    "hnd_to_nhd": Case(Side(2, 4, 4), Side(2, 4, 4, order="NHD")),
    "nhd_to_nhd_bs2": Case(Side(1, 2, 4, order="NHD"), Side(1, 2, 8, order="NHD")),
    "head_slice_tp1_to_2": Case(Side(1, 4, 4), Side(2, 4, 4)),
    "head_slice_bs2_to_nhd": Case(Side(2, 4, 4), Side(4, 4, 8, order="NHD")),
    "assembled_tp4_to_2": Case(Side(4, 4, 4), Side(2, 4, 4, arrangement="blocks_first")),
    "assembled_tp4_to_1_bs2": Case(Side(4, 4, 4), Side(1, 4, 8)),
    # Replicated heads: more ranks than the model's 2 KV heads.
    "replicas_read_once_tp4_to_1": Case(Side(4, 2, 4), Side(1, 2, 4)),
    "replicas_read_once_tp4_to_2": Case(Side(4, 2, 4), Side(2, 2, 4)),
    "local_replicas_tp1_to_4": Case(Side(1, 2, 4), Side(4, 2, 4)),
    "both_replicated_tp4_to_8": Case(Side(4, 2, 4), Side(8, 2, 4)),
    "replicated_nhd_tp2_to_4": Case(Side(2, 2, 4, order="NHD"), Side(4, 2, 4, order="NHD")),
    "mla_tp2_to_1_bs2": Case(Side(2, 1, 4, arrangement="mla"), Side(1, 1, 8, arrangement="mla")),
    "mla_tp1_to_4": Case(Side(1, 1, 4, arrangement="mla"), Side(4, 1, 4, arrangement="mla")),
    "dcp_mla": Case(
        Side(2, 1, 4, arrangement="mla", dcp=2), Side(2, 1, 4, arrangement="mla", dcp=2)
    ),
    "dcp_gathered_heads": Case(Side(2, 2, 4, dcp=2), Side(2, 2, 4, dcp=2, order="NHD")),
    "pp2_producer": Case(
        Side(2, 4, 4, pp=2, layers=("l0", "l1", "l2", "l3")),
        Side(2, 4, 4, layers=("l0", "l1", "l2", "l3")),
    ),
    # Runs contiguous on both sides coalesce, but never past max_frame (here two blocks' worth).
    "small_frames": Case(
        Side(1, 4, 4), Side(1, 4, 4), [2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8], max_frame=600
    ),
    "partial_last_block": Case(
        Side(1, 4, 4, order="NHD"), Side(1, 4, 8, order="NHD"), remote_ids=[1, 2, 3, 4, 5]
    ),
}


def _plan(case: Case, rank: int, remote_ids: list[int], local_ids: list[int]) -> RankPlan:
    local = case.local.engine("consumer")
    return plan_rank(
        local,
        local.workers[rank],
        case.remote.engine("producer"),
        np.array(remote_ids, dtype=np.int64),
        np.array(local_ids, dtype=np.int64),
        max_frame=case.max_frame,
    )


@pytest.mark.parametrize("name", CASES)
def test_every_byte_lands_where_first_principles_put_it(name: str) -> None:
    case = CASES[name]
    remote, local = case.remote, case.local
    if name == "partial_last_block":
        remote_ids, local_ids = case.remote_ids, [6, 2, 0]
    else:
        remote_ids, local_ids = case.ids()
    sources = producer_buffers(remote)
    ratio = local.block_size // remote.block_size
    for rank in range(local.tp):
        plan = _plan(case, rank, remote_ids, local_ids)
        heads = 1 if local.mla else len(wanted_heads(remote, local, rank))
        region = local.block_size * heads * HEAD_SIZE
        size = local.blocks * region * (1 if local.mla else 2)
        buffers, writes = run_plan(plan, sources, dict.fromkeys(local.layers, size))
        for layer, name_ in enumerate(local.layers):
            blocks = received(remote, local, rank, layer, remote_ids, local_ids)
            want = packed(remote, local, rank, blocks)
            np.testing.assert_array_equal(buffers[name_], want, err_msg=f"rank {rank} {name_}")
            assert writes[name_].max() <= 1, f"rank {rank} {name_}: bytes written twice"
            # Layers whose packed bytes are not yet the consumer's layout are named for a fix.
            fixed = dict(plan.fixes)
            if np.array_equal(want, final(remote, local, rank, blocks)):
                assert name_ not in fixed, f"rank {rank} {name_}: a fix where none is needed"
            else:
                assert fixed.get(name_) == ("NHD" if remote.mla else remote.order), (
                    f"rank {rank} {name_}: fix missing"
                )
        moved = len(remote_ids) * (1 if local.mla else 2) * (region // ratio) * ITEM.itemsize
        assert plan.nbytes == moved * len(local.layers)
        assert plan.notify == notified(remote, local, rank)
        assert plan.expected_readers == readers(remote, local)
        assert plan.block_size_ratio == ratio
        if case.max_frame < region * ITEM.itemsize:
            unit = (region // ratio) * ITEM.itemsize
            assert all(
                length <= max(case.max_frame, unit)
                for read in plan.reads
                for length in read.ranges[:, 2].tolist()
            )


def test_replicated_heads_are_read_from_one_replica_each() -> None:
    """Producer ranks 0/1 and 2/3 hold the same head: one read from each pair, all notified."""
    case = CASES["replicas_read_once_tp4_to_1"]
    plan = _plan(case, 0, *case.ids())
    read_from = sorted(r.remote_tp_rank for r in plan.reads)
    assert len(read_from) == 2 and {q // 2 for q in read_from} == {0, 1}
    assert plan.notify == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_mla_reads_one_rank_and_notifies_every_target() -> None:
    case = CASES["mla_tp2_to_1_bs2"]
    plan = _plan(case, 0, *case.ids())
    assert [r.remote_tp_rank for r in plan.reads] == [0]
    assert plan.notify == [(0, 0), (1, 0)]


def test_dcp_reads_rank_to_rank() -> None:
    case = CASES["dcp_gathered_heads"]
    for rank in range(2):
        plan = _plan(case, rank, *case.ids())
        assert [r.remote_tp_rank for r in plan.reads] == [rank]


def test_empty_request_plans_nothing() -> None:
    plan = _plan(CASES["same_tp"], 0, [], [])
    assert plan.nbytes == 0
    assert all(len(r.ranges) == 0 for r in plan.reads)


# --------------------------------------------------------------------------------------------
# Errors

ERRORS: dict[str, tuple[Case, list[int], list[int], str]] = {
    "dcp_sizes_differ": (
        Case(Side(2, 2, 4), Side(2, 2, 4, dcp=2)),
        [1],
        [1],
        "DCP transfers need equal TP and DCP sizes",
    ),
    "dcp_tp_differ": (
        Case(Side(4, 4, 4, dcp=4), Side(2, 4, 4, dcp=2)),
        [1],
        [1],
        "DCP transfers need equal TP and DCP sizes",
    ),
    "local_dcp_not_tp": (Case(Side(4, 4, 4), Side(4, 4, 4, dcp=2)), [1], [1], "DCP size 2"),
    "block_size_not_multiple": (Case(Side(1, 4, 4), Side(1, 4, 6)), [1], [1], "not a multiple"),
    "too_many_remote_blocks": (Case(Side(1, 4, 4), Side(1, 4, 8)), [1, 2, 3], [1], "do not fill"),
    "too_few_remote_blocks": (Case(Side(1, 4, 4), Side(1, 4, 8)), [1, 2], [1, 2], "do not fill"),
    "local_id_out_of_range": (Case(Side(1, 4, 4), Side(1, 4, 4)), [1], [12], "local block ids"),
    "negative_local_id": (Case(Side(1, 4, 4), Side(1, 4, 4)), [1], [-1], "local block ids"),
    "remote_id_out_of_range": (Case(Side(1, 4, 4), Side(1, 4, 4)), [12], [1], "remote block ids"),
    "tp_not_divisible": (Case(Side(2, 6, 4), Side(3, 6, 4)), [1], [1], "not divisible"),
    "nhd_producer_head_slice": (
        Case(Side(1, 4, 4, order="NHD"), Side(2, 4, 4)),
        [1],
        [1],
        "needs HND memory order",
    ),
    "nhd_producer_assembly": (
        Case(Side(2, 4, 4, order="NHD"), Side(1, 4, 4)),
        [1],
        [1],
        "needs HND memory order",
    ),
    "regions_differ": (
        Case(Side(1, 4, 4, arrangement="split"), Side(1, 4, 4)),
        [1],
        [1],
        "regions differ",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_unservable_pulls_raise_plan_error(name: str) -> None:
    case, remote_ids, local_ids, message = ERRORS[name]
    with pytest.raises(PlanError, match=message):
        _plan(case, 0, remote_ids, local_ids)


def test_missing_layer_rank_and_heads_raise_plan_error() -> None:
    local = Side(2, 4, 4)
    remote = Side(2, 4, 4)
    consumer = local.engine("consumer")
    ids = np.array([1], dtype=np.int64)

    def plan(producer: PeerEngine, rank: int = 0) -> Any:
        return plan_rank(consumer, consumer.workers[rank], producer, ids, ids)

    no_layer = replace(remote, layers=("l0", "other")).engine("producer")
    with pytest.raises(PlanError, match="has no layer 'l1'"):
        plan(no_layer)
    full = remote.engine("producer")
    one_rank = PeerEngine(**{**_fields(full), "workers": full.workers[:1]})
    with pytest.raises(PlanError, match="no rank tp1"):
        plan(one_rank, rank=1)
    # A handshake whose ranks disagree on the layers (rank 1 lacks one that rank 0 has): a typed
    # refusal of the pull, not an exception out of the planner.
    lacking = msgspec.structs.replace(full.workers[1], layers=["l0", "other"])
    uneven = PeerEngine(**{**_fields(full), "workers": [full.workers[0], lacking]})
    with pytest.raises(PlanError, match=r"tp1\.pp0 has no layer 'l1'"):
        plan(uneven, rank=1)
    # Lists of one rank that disagree in length (a descriptor or a NIXL address short).
    for short in (
        msgspec.structs.replace(full.workers[1], descriptors=full.workers[1].descriptors[:1]),
        msgspec.structs.replace(full.workers[1], layer_addrs=[4096]),
    ):
        ragged = PeerEngine(**{**_fields(full), "workers": [full.workers[0], short]})
        with pytest.raises(PlanError, match=r"rank tp1\.pp0 with 2 layers"):
            plan(ragged, rank=1)
    # A descriptor past the first that no buffer can have (the first is checked with the
    # topology): refused when the planner first uses it.
    second = full.workers[1].descriptors[1]
    for bad in ({"dtype": "bogus"}, {"num_heads": 0}, {"block_size": 0}, {"num_blocks": -1}):
        rank1 = msgspec.structs.replace(
            full.workers[1],
            descriptors=[full.workers[1].descriptors[0], msgspec.structs.replace(second, **bad)],
        )
        odd = PeerEngine(**{**_fields(full), "workers": [full.workers[0], rank1]})
        with pytest.raises(PlanError, match="layer 'l1': "):
            plan(odd, rank=1)
    # The consumer believes in 4 heads; the producer's ranks hold 4 each (8 in all).
    wide = Side(2, 8, 4).engine("producer")
    narrow = Side(1, 4, 4).engine("consumer")
    with pytest.raises(PlanError, match="do not fit"):
        plan_rank(narrow, narrow.workers[0], wide, ids, ids)


def _fields(engine: PeerEngine) -> dict[str, Any]:
    return {f: getattr(engine, f) for f in engine.__struct_fields__}
