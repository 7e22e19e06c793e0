"""TransferTopology against first-principles models: who owns which heads, slices and tokens.

The models below never call the code under test: they enumerate every local/remote rank pair and
decide from ownership alone which remote ranks a local rank needs, then the tests compare.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.core.topology import (
    EngineTransferInfo,
    TopologyError,
    TransferTopology,
    UnknownEngineError,
)

SIZES = range(1, 17)


# ---- independent models ----


def heads_of(rank: int, tp_size: int, num_heads: int) -> set[int]:
    """KV heads a rank holds: an equal split, or one replicated head when ranks outnumber heads."""
    if tp_size <= num_heads:
        per_rank = num_heads // tp_size
        return set(range(rank * per_rank, (rank + 1) * per_rank))
    return {rank // (tp_size // num_heads)}


def slice_of(rank: int, tp_size: int, units: int) -> set[int]:
    """Units of the KV cache a rank holds when the cache is cut into tp_size equal slices."""
    per_rank = units // tp_size
    return set(range(rank * per_rank, (rank + 1) * per_rank))


def model_tp_targets(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """Remote ranks whose slice overlaps the local rank's slice."""
    units = local_tp * remote_tp
    mine = slice_of(local_rank, local_tp, units)
    return [r for r in range(remote_tp) if slice_of(r, remote_tp, units) & mine]


def tokens_of(rank: int, dcp_size: int, positions: int) -> set[int]:
    """Token positions (mod ``positions``) a rank holds under DCP interleaving."""
    return {t for t in range(positions) if t % dcp_size == rank % dcp_size}


def model_dcp_targets(
    local_rank: int, local_dcp: int, remote_tp: int, remote_dcp: int
) -> list[int]:
    """Remote ranks whose token shard overlaps the local rank's token shard."""
    positions = math.lcm(local_dcp, remote_dcp)
    mine = tokens_of(local_rank, local_dcp, positions)
    return [r for r in range(remote_tp) if tokens_of(r, remote_dcp, positions) & mine]


def divides_one_way(a: int, b: int) -> bool:
    return max(a, b) % min(a, b) == 0


def valid_heads(tp_size: int, num_heads: int) -> bool:
    """Head counts an engine can run with: heads split evenly, or ranks replicate heads evenly."""
    return num_heads % tp_size == 0 if tp_size <= num_heads else tp_size % num_heads == 0


def info(remote_tp: int, **kwargs: int) -> EngineTransferInfo:
    return EngineTransferInfo(
        remote_tp_size=remote_tp,
        remote_block_len=kwargs.pop("remote_block_len", 4096),
        remote_block_size=kwargs.pop("remote_block_size", 16),
        remote_physical_blocks_per_logical=kwargs.pop("remote_physical_blocks_per_logical", 1),
        **kwargs,
    )


def topo(
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    block_size: int = 16,
    engine_id: str = "local",
    is_mla: bool = False,
    is_mamba: bool = False,
    heads: int = 8,
    dcp_size: int = 1,
) -> TransferTopology:
    return TransferTopology(
        tp_rank, tp_size, block_size, engine_id, is_mla, is_mamba, heads, dcp_size=dcp_size
    )


# ---- TP mapping, exhaustive over 1..16 both ways ----


def test_tp_ratio_exhaustive() -> None:
    for local_tp in SIZES:
        t = topo(0, local_tp)
        for remote_tp in SIZES:
            if local_tp >= remote_tp and local_tp % remote_tp == 0:
                assert t.tp_ratio(remote_tp) == local_tp // remote_tp
            elif remote_tp > local_tp and remote_tp % local_tp == 0:
                assert t.tp_ratio(remote_tp) == -(remote_tp // local_tp)
            elif local_tp >= remote_tp:
                with pytest.raises(TopologyError, match="Local tensor parallel size"):
                    t.tp_ratio(remote_tp)
            else:
                with pytest.raises(TopologyError, match="Remote tensor parallel size"):
                    t.tp_ratio(remote_tp)


def test_tp_error_messages_name_both_sizes() -> None:
    with pytest.raises(TopologyError) as e:
        topo(0, 6).tp_ratio(4)
    assert str(e.value) == (
        "Local tensor parallel size 6 is not divisible by remote tensor parallel size 4."
    )
    with pytest.raises(TopologyError) as e:
        topo(0, 4).tp_ratio(6)
    assert str(e.value) == (
        "Remote tensor parallel size 6 is not divisible by local tensor parallel size 4."
    )


def test_tp_targets_match_slice_and_head_models_exhaustively() -> None:
    for local_tp in SIZES:
        for remote_tp in SIZES:
            if not divides_one_way(local_tp, remote_tp):
                continue
            for local_rank in range(local_tp):
                t = topo(local_rank, local_tp)
                t.register_remote_engine("remote", info(remote_tp))
                expected = model_tp_targets(local_rank, local_tp, remote_tp)
                assert t.target_remote_ranks("remote") == expected
                assert t.handshake_target_ranks(remote_tp) == expected
                assert t.handshake_target_ranks(remote_tp, 1) == expected


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16])
def test_tp_targets_hold_exactly_the_heads_needed(num_heads: int) -> None:
    """Targets cover every head the local rank holds, and each target holds one of them."""
    for local_tp in SIZES:
        for remote_tp in SIZES:
            if not (
                divides_one_way(local_tp, remote_tp)
                and valid_heads(local_tp, num_heads)
                and valid_heads(remote_tp, num_heads)
            ):
                continue
            for local_rank in range(local_tp):
                t = topo(local_rank, local_tp, heads=num_heads)
                mine = heads_of(local_rank, local_tp, num_heads)
                targets = t.handshake_target_ranks(remote_tp)
                held = [heads_of(r, remote_tp, num_heads) for r in targets]
                assert set().union(*held) >= mine
                assert all(h & mine for h in held)
                assert t.local_physical_heads == len(mine)


def test_tp_consumer_count_is_readers_per_remote_rank() -> None:
    for local_tp in SIZES:
        for remote_tp in SIZES:
            if not divides_one_way(local_tp, remote_tp):
                continue
            readers = [0] * remote_tp
            for local_rank in range(local_tp):
                for r in model_tp_targets(local_rank, local_tp, remote_tp):
                    readers[r] += 1
            for local_rank in range(local_tp):
                for local_dcp in {1, local_tp}:
                    t = topo(local_rank, local_tp, dcp_size=local_dcp)
                    assert [t.dcp_consumer_count(remote_tp, 1)] * remote_tp == readers


# ---- DCP ----


def test_dcp_targets_match_token_model_exhaustively() -> None:
    for local_tp in SIZES:
        for local_dcp in {1, local_tp}:
            for remote_tp in range(2, 17):
                remote_dcp = remote_tp
                ok = divides_one_way(local_dcp, remote_dcp)
                readers = [0] * remote_tp
                for local_rank in range(local_tp):
                    t = topo(local_rank, local_tp, dcp_size=local_dcp, is_mla=True, heads=1)
                    assert t.dcp_rank == local_rank % local_dcp
                    if not ok:
                        for method in (
                            t.dcp_source_ranks,
                            t.handshake_target_ranks,
                            t.dcp_consumer_count,
                        ):
                            with pytest.raises(TopologyError, match="do not divide one another"):
                                method(remote_tp, remote_dcp)
                        continue
                    expected = model_dcp_targets(local_rank, local_dcp, remote_tp, remote_dcp)
                    assert t.dcp_source_ranks(remote_tp, remote_dcp) == expected
                    assert t.handshake_target_ranks(remote_tp, remote_dcp) == expected
                    # Coverage: together the targets hold every token this rank needs.
                    positions = math.lcm(local_dcp, remote_dcp)
                    got = set().union(*(tokens_of(r, remote_dcp, positions) for r in expected))
                    assert got >= tokens_of(local_rank, local_dcp, positions)
                    for r in expected:
                        readers[r] += 1
                if ok:
                    count = topo(0, local_tp, dcp_size=local_dcp).dcp_consumer_count(
                        remote_tp, remote_dcp
                    )
                    assert readers == [count] * remote_tp


@given(remote_tp=st.integers(2, 16), remote_dcp=st.integers(2, 16))
def test_remote_dcp_must_be_one_or_remote_tp(remote_tp: int, remote_dcp: int) -> None:
    t = topo(0, 1)
    if remote_dcp == remote_tp:
        assert t.dcp_source_ranks(remote_tp, remote_dcp) == list(range(remote_tp))
        return
    with pytest.raises(TopologyError, match="must be 1 or the remote TP size"):
        t.dcp_source_ranks(remote_tp, remote_dcp)
    with pytest.raises(TopologyError, match="must be 1 or the remote TP size"):
        t.handshake_target_ranks(remote_tp, remote_dcp)
    with pytest.raises(TopologyError, match="must be 1 or the remote TP size"):
        t.dcp_consumer_count(remote_tp, remote_dcp)
    with pytest.raises(TopologyError, match="must be 1 or the remote TP size"):
        t.register_remote_engine("r", info(remote_tp, remote_dcp_size=remote_dcp))


@given(tp_size=st.integers(2, 16), dcp_size=st.integers(2, 16))
def test_local_dcp_must_be_one_or_tp_size(tp_size: int, dcp_size: int) -> None:
    if dcp_size == tp_size:
        assert topo(tp_size - 1, tp_size, dcp_size=dcp_size).dcp_rank == tp_size - 1
        return
    with pytest.raises(TopologyError, match="must be 1 or the local TP size"):
        topo(0, tp_size, dcp_size=dcp_size)


def test_dcp_remote_unsharded_reduces_to_tp() -> None:
    t = topo(3, 4, dcp_size=4, is_mla=True, heads=1)
    assert t.dcp_source_ranks(2, 1) == [0]
    assert t.handshake_target_ranks(2, 1) == [1]
    assert t.dcp_consumer_count(2, 1) == 2


# ---- replication ----


@given(
    local_tp=st.sampled_from([1, 2, 4, 8, 16]),
    remote_tp=st.sampled_from([1, 2, 4, 8, 16]),
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    is_mla=st.booleans(),
)
def test_replication_matches_head_ownership(
    local_tp: int, remote_tp: int, heads: int, is_mla: bool
) -> None:
    def replicated(tp_size: int) -> bool:
        owners: dict[int, int] = {}
        for rank in range(tp_size):
            for h in heads_of(rank, tp_size, heads):
                owners[h] = owners.get(h, 0) + 1
        return any(n > 1 for n in owners.values())

    t = topo(0, local_tp, heads=heads, is_mla=is_mla)
    t.register_remote_engine("r", info(remote_tp))
    assert t.is_kv_replicated("r") == replicated(remote_tp)
    assert t.replicates_kv_cache("r") == (is_mla or replicated(remote_tp))
    assert t.local_replicates_kv_cache == (is_mla or replicated(local_tp))


# ---- block sizes ----


@given(local=st.integers(1, 256), remote=st.integers(1, 256))
def test_block_size_ratio(local: int, remote: int) -> None:
    t = topo(block_size=local)
    if local % remote == 0:
        assert t.block_size_ratio(remote) * remote == local
    else:
        with pytest.raises(TopologyError) as e:
            t.block_size_ratio(remote)
        assert str(e.value) == (
            f"Local block size {local} is not divisible "
            f"by remote block size {remote} or vice versa."
        )


@given(bad=st.integers(-5, 0))
def test_nonpositive_remote_sizes_are_rejected(bad: int) -> None:
    t = topo()
    for call in (
        lambda: t.block_size_ratio(bad),
        lambda: t.tp_ratio(bad),
        lambda: t.handshake_target_ranks(bad),
        lambda: t.handshake_target_ranks(2, bad),
        lambda: t.dcp_source_ranks(bad, 1),
        lambda: t.dcp_consumer_count(2, bad),
        lambda: t.dcp_consumer_count(bad, 1),
    ):
        with pytest.raises(TopologyError, match=">= 1"):
            call()


# ---- constructor ----


@given(
    tp_size=st.integers(-2, 16),
    tp_rank=st.integers(-2, 17),
    block_size=st.integers(-2, 4),
    heads=st.integers(-2, 4),
    dcp_size=st.integers(-2, 4),
)
def test_constructor_validation(
    tp_size: int, tp_rank: int, block_size: int, heads: int, dcp_size: int
) -> None:
    valid = (
        tp_size >= 1
        and 0 <= tp_rank < tp_size
        and block_size >= 1
        and heads >= 1
        and dcp_size in (1, tp_size)
    )
    if valid:
        t = topo(tp_rank, tp_size, block_size=block_size, heads=heads, dcp_size=dcp_size)
        assert (t.tp_rank, t.tp_size, t.block_size) == (tp_rank, tp_size, block_size)
        assert t.local_physical_heads == max(1, heads // tp_size)
        assert t.dcp_rank == tp_rank % dcp_size
    else:
        with pytest.raises(TopologyError):
            topo(tp_rank, tp_size, block_size=block_size, heads=heads, dcp_size=dcp_size)


# ---- registry ----


def test_register_first_wins_and_keys_by_pp_rank() -> None:
    t = topo(0, 2)
    first = info(2, remote_block_len=100)
    assert t.register_remote_engine("r", first) is first
    assert t.register_remote_engine("r", info(2, remote_block_len=200)) is first
    pp1 = info(4, remote_pp_rank=1, start_layer=10, end_layer=20)
    assert t.register_remote_engine("r", pp1) is pp1
    assert t.get_engine_info("r") is first
    assert t.get_engine_info("r", 1) is pp1
    assert t.target_remote_ranks("r", 1) == [0, 1]
    t.unregister_remote_engine("r")
    for pp in (0, 1):
        with pytest.raises(UnknownEngineError):
            t.get_engine_info("r", pp)
    t.unregister_remote_engine("never-registered")


def test_register_local_engine_is_rejected() -> None:
    t = topo(engine_id="me")
    with pytest.raises(TopologyError, match="Cannot register local engine me as remote"):
        t.register_remote_engine("me", info(1))


def test_register_rejects_unservable_remote() -> None:
    t = topo(0, 4)
    with pytest.raises(TopologyError, match="not divisible"):
        t.register_remote_engine("r", info(3))
    with pytest.raises(UnknownEngineError):
        t.get_engine_info("r")
    # A DCP-sharded remote needs only DCP compatibility, not a TP ratio.
    t1 = topo(0, 3, is_mla=True, heads=1)
    t1.register_remote_engine("r", info(4, remote_dcp_size=4))
    assert t1.handshake_target_ranks(4, 4) == [0, 1, 2, 3]
    assert "tp_ratio=n/a" in t1.describe("r")


def test_unknown_engine_errors_are_key_and_topology_errors() -> None:
    t = topo()
    calls = (
        lambda: t.get_engine_info("x"),
        lambda: t.is_kv_replicated("x"),
        lambda: t.replicates_kv_cache("x"),
        lambda: t.target_remote_ranks("x"),
        lambda: t.describe("x"),
    )
    for call in calls:
        with pytest.raises(KeyError):
            call()
        with pytest.raises(TopologyError) as e:
            call()
        assert isinstance(e.value, UnknownEngineError)
        assert str(e.value) == "Remote engine 'x' (pp_rank 0) is not registered."


def test_describe() -> None:
    t = topo(1, 4, heads=8, dcp_size=4)
    t.register_remote_engine("r", info(2, remote_block_len=512, remote_pp_rank=1))
    assert t.describe("r", 1) == (
        "TransferTopology(tp_ratio=2, num_kv_heads=8, local_tp=4, remote_tp=2, remote_pp=1, "
        "local_dcp=4, remote_dcp=1, local_rank=1, remote_block_len=512)"
    )
    mla = topo(0, 2, is_mla=True, heads=8)
    mla.register_remote_engine("r", info(2))
    assert "num_kv_heads=1," in mla.describe("r")


def test_identity_is_read_only_for_type_checkers_and_readers() -> None:
    t = topo(1, 2)
    assert (t.engine_id, t.is_mla, t.is_mamba, t.total_num_kv_heads, t.dcp_size) == (
        "local",
        False,
        False,
        8,
        1,
    )


# ---- EngineTransferInfo ----

INFO_FIELDS = (
    "remote_tp_size",
    "remote_block_len",
    "remote_block_size",
    "remote_physical_blocks_per_logical",
    "remote_dcp_size",
)


@given(
    st.builds(
        EngineTransferInfo,
        remote_tp_size=st.integers(1, 64),
        remote_block_len=st.integers(1, 1 << 40),
        remote_block_size=st.integers(1, 1024),
        remote_physical_blocks_per_logical=st.integers(1, 8),
        remote_pp_rank=st.integers(0, 8),
        start_layer=st.integers(0, 10),
        end_layer=st.integers(10, 100),
        remote_dcp_size=st.integers(1, 64),
    )
)
def test_info_round_trips_msgpack(value: EngineTransferInfo) -> None:
    wire = msgspec.msgpack.encode(value)
    assert msgspec.msgpack.decode(wire, type=EngineTransferInfo) == value


@given(field=st.sampled_from(INFO_FIELDS), bad=st.integers(-3, 0))
def test_info_rejects_nonpositive_sizes(field: str, bad: int) -> None:
    with pytest.raises(TopologyError, match=field):
        msgspec.structs.replace(info(2), **{field: bad})
    raw = msgspec.msgpack.encode(msgspec.structs.asdict(info(2)) | {field: bad})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(raw, type=EngineTransferInfo)


def test_info_rejects_bad_pp_rank_and_layer_range() -> None:
    with pytest.raises(TopologyError, match="remote_pp_rank"):
        info(2, remote_pp_rank=-1)
    with pytest.raises(TopologyError, match="Layer range"):
        info(2, start_layer=5, end_layer=4)
    with pytest.raises(TopologyError, match="Layer range"):
        info(2, start_layer=-1)


def test_info_is_frozen() -> None:
    value = info(2)
    with pytest.raises(AttributeError):
        value.remote_tp_size = 4  # type: ignore[misc]
