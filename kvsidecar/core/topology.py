"""Which remote ranks a local rank talks to, and how many local readers each remote rank has.

Two engines with different tensor-parallel (TP) sizes split their KV heads differently. Think of
each engine's KV cache as the interval ``[0, 1)`` cut into ``tp_size`` equal slices, one per rank
(a slice is a range of heads, or one replica of a head when there are more ranks than heads):

- local TP >= remote TP: ``tp_ratio`` consecutive local ranks each read a part of one remote slice;
- remote TP > local TP: each local rank reads ``|tp_ratio|`` whole remote slices.

Decode context parallelism (DCP) shards the *tokens* instead: with ``dcp_size > 1`` rank ``r``
holds the tokens ``t`` with ``t % dcp_size == r % dcp_size``. As in the engine this mirrors, DCP
is supported for ``dcp_size in (1, tp_size)`` on each side, with DCP sizes that divide one another,
and it assumes every rank holds all heads of its tokens (MLA, or heads gathered across DCP).

Everything here is pure arithmetic over sizes plus a registry of remote engines; it raises
`TopologyError` (a `ValueError`) for configurations the transfer path cannot serve, and
`UnknownEngineError` (both a `TopologyError` and a `KeyError`) for lookups of an engine that was
never registered.
"""

from __future__ import annotations

from typing import Final

import msgspec

EngineId = str
"""Identifier of one engine instance (the reference's ``EngineId``)."""


class TopologyError(ValueError):
    """A configuration the transfer path does not support, or an invalid size or rank."""


class UnknownEngineError(TopologyError, KeyError):
    """No remote engine is registered under the requested ``(engine_id, pp_rank)``.

    It is a `KeyError` too, so code written against a plain mapping lookup keeps working.
    """

    def __str__(self) -> str:
        # KeyError would quote the message; this is a sentence, not a key.
        return str(self.args[0]) if self.args else ""


class EngineTransferInfo(msgspec.Struct, frozen=True):
    """What a remote engine's rank told us at handshake: sizes needed to address its blocks.

    Stored per ``(engine_id, remote_pp_rank)`` in `TransferTopology`. It is a msgspec struct so
    that it can travel in the handshake unchanged; construction and decoding both validate it
    (decoding turns a violation into `msgspec.ValidationError`).
    """

    remote_tp_size: int
    """Tensor-parallel size of the remote engine."""
    remote_block_len: int
    """Bytes of one remote block (per layer, per K or V)."""
    remote_block_size: int
    """Tokens per remote block."""
    remote_physical_blocks_per_logical: int
    """Physical blocks that make up one logical block on the remote side."""
    remote_pp_rank: int = 0
    """Pipeline-parallel rank of the remote producer."""
    start_layer: int = 0
    """Global index of the first layer owned by that PP rank."""
    end_layer: int = 0
    """Global index one past the last layer owned by that PP rank."""
    remote_dcp_size: int = 1
    """Decode-context-parallel size of the remote engine."""

    def __post_init__(self) -> None:
        """Reject sizes and ranks that no engine can have."""
        for name in (
            "remote_tp_size",
            "remote_block_len",
            "remote_block_size",
            "remote_physical_blocks_per_logical",
            "remote_dcp_size",
        ):
            value = getattr(self, name)
            if value < 1:
                raise TopologyError(f"{name} must be >= 1, got {value}.")
        if self.remote_pp_rank < 0:
            raise TopologyError(f"remote_pp_rank must be >= 0, got {self.remote_pp_rank}.")
        if not 0 <= self.start_layer <= self.end_layer:
            raise TopologyError(
                f"Layer range [{self.start_layer}, {self.end_layer}) is not a valid range."
            )


class TransferTopology:
    """One local rank's view of the transfer topology: its identity and the remote engines.

    The identity (``tp_rank``, ``tp_size``, ``block_size``, ``engine_id``, ``is_mla``,
    ``is_mamba``, ``total_num_kv_heads``, ``dcp_size``) is validated once here and fixed; remote
    engines are added with `register_remote_engine` after their handshake.
    """

    def __init__(  # noqa: PLR0917 - positional, as in the engine this mirrors
        self,
        tp_rank: int,
        tp_size: int,
        block_size: int,
        engine_id: EngineId,
        is_mla: bool,
        is_mamba: bool,
        total_num_kv_heads: int,
        dcp_size: int = 1,
    ) -> None:
        for name, value in (
            ("tp_size", tp_size),
            ("block_size", block_size),
            ("total_num_kv_heads", total_num_kv_heads),
            ("dcp_size", dcp_size),
        ):
            if value < 1:
                raise TopologyError(f"{name} must be >= 1, got {value}.")
        if not 0 <= tp_rank < tp_size:
            raise TopologyError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}.")
        if dcp_size not in (1, tp_size):
            raise TopologyError(
                f"Local DCP size {dcp_size} must be 1 or the local TP size {tp_size}."
            )
        self.tp_rank: Final = tp_rank
        """This rank's index in its TP group."""
        self.tp_size: Final = tp_size
        """Local tensor-parallel size."""
        self.block_size: Final = block_size
        """Local tokens per block."""
        self.engine_id: Final = engine_id
        """The local engine's id; it can never be registered as a remote."""
        self.is_mla: Final = is_mla
        """Whether the model uses MLA (one latent vector per token, replicated on every rank)."""
        self.is_mamba: Final = is_mamba
        """Whether the model has Mamba (SSM state) layers."""
        self.total_num_kv_heads: Final = total_num_kv_heads
        """KV heads of the whole model, before TP splits them."""
        self.dcp_size: Final = dcp_size
        """Local decode-context-parallel size (1 or ``tp_size``)."""
        self.local_physical_heads: Final = max(1, total_num_kv_heads // tp_size)
        """KV heads held by one local rank (at least one: replicas when TP exceeds heads)."""
        self._engines: dict[tuple[EngineId, int], EngineTransferInfo] = {}

    def register_remote_engine(
        self, remote_engine_id: EngineId, info: EngineTransferInfo
    ) -> EngineTransferInfo:
        """Store a remote engine's info under ``(remote_engine_id, info.remote_pp_rank)``.

        The first registration wins: registering the same key again returns the stored info and
        ignores the new one. Raises `TopologyError` for the local engine's own id, and when the
        remote sizes cannot be served (the checks of `handshake_target_ranks`), so that nothing
        unusable is ever stored.
        """
        if remote_engine_id == self.engine_id:
            raise TopologyError(
                f"Cannot register local engine {self.engine_id} as remote. "
                f"Local identity is set via the TransferTopology constructor."
            )
        key = (remote_engine_id, info.remote_pp_rank)
        stored = self._engines.get(key)
        if stored is not None:
            return stored
        self.handshake_target_ranks(info.remote_tp_size, info.remote_dcp_size)
        self._engines[key] = info
        return info

    def get_engine_info(
        self, remote_engine_id: EngineId, remote_pp_rank: int = 0
    ) -> EngineTransferInfo:
        """Return the info registered for a remote engine; `UnknownEngineError` if there is none."""
        info = self._engines.get((remote_engine_id, remote_pp_rank))
        if info is None:
            raise UnknownEngineError(
                f"Remote engine {remote_engine_id!r} (pp_rank {remote_pp_rank}) is not registered."
            )
        return info

    def unregister_remote_engine(self, remote_engine_id: EngineId) -> None:
        """Forget every PP rank of a remote engine; an unknown engine is a no-op."""
        for key in [key for key in self._engines if key[0] == remote_engine_id]:
            del self._engines[key]

    @property
    def dcp_rank(self) -> int:
        """DCP rank of this rank: which token shard it holds (``tp_rank % dcp_size``)."""
        return self.tp_rank % self.dcp_size

    def tp_ratio(self, remote_tp_size: int) -> int:
        """Ratio of local to remote TP size; negative when the remote TP size is larger.

        Positive ``n``: groups of ``n`` consecutive local ranks read from the same remote rank.
        Negative ``-n``: each local rank reads from ``n`` remote ranks. Raises `TopologyError`
        when neither size divides the other.
        """
        _check_positive("remote_tp_size", remote_tp_size)
        if self.tp_size >= remote_tp_size:
            if self.tp_size % remote_tp_size:
                raise TopologyError(
                    f"Local tensor parallel size {self.tp_size} is not divisible "
                    f"by remote tensor parallel size {remote_tp_size}."
                )
            return self.tp_size // remote_tp_size
        if remote_tp_size % self.tp_size:
            raise TopologyError(
                f"Remote tensor parallel size {remote_tp_size} is not divisible "
                f"by local tensor parallel size {self.tp_size}."
            )
        return -(remote_tp_size // self.tp_size)

    def block_size_ratio(self, remote_block_size: int) -> int:
        """How many remote blocks make one local block; the local size must be a multiple."""
        _check_positive("remote_block_size", remote_block_size)
        if self.block_size % remote_block_size:
            raise TopologyError(
                f"Local block size {self.block_size} is not divisible "
                f"by remote block size {remote_block_size} or vice versa."
            )
        return self.block_size // remote_block_size

    def is_kv_replicated(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        """Whether the remote engine replicates KV heads: more remote TP ranks than KV heads."""
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        return info.remote_tp_size > self.total_num_kv_heads

    def replicates_kv_cache(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        """Whether every remote rank holds the same KV: MLA, or replicated heads."""
        # MLA's latent vector cannot be split across ranks, so it is always replicated.
        return self.is_mla or self.is_kv_replicated(remote_engine_id, remote_pp_rank)

    @property
    def local_replicates_kv_cache(self) -> bool:
        """Whether the local engine's ranks hold replicated KV: MLA, or more ranks than heads."""
        return self.is_mla or self.tp_size > self.total_num_kv_heads

    def dcp_source_ranks(self, remote_tp_size: int, remote_dcp_size: int) -> list[int]:
        """Remote ranks whose DCP token shard overlaps this rank's shard, ascending.

        When the local shard is coarser or equal (``local dcp <= remote dcp``), that is every
        remote rank whose shard lies inside this one (all remote ranks when the local side is not
        sharded); when the local shard is finer, the single remote rank that contains it. For a
        sharded remote this answers both "whom to handshake with" and "whom to read from".
        """
        _check_dcp_pair(self.dcp_size, remote_tp_size, remote_dcp_size)
        if self.dcp_size <= remote_dcp_size:
            return [r for r in range(remote_tp_size) if r % self.dcp_size == self.dcp_rank]
        return [self.dcp_rank % remote_dcp_size]

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        """Remote TP ranks to handshake with, before the remote engine is registered.

        With a DCP-sharded remote (``remote_dcp_size > 1``) these are `dcp_source_ranks`;
        otherwise the TP mapping of `target_remote_ranks`. Raises `TopologyError` when the sizes
        cannot be served.
        """
        _check_positive("remote_dcp_size", remote_dcp_size)
        if remote_dcp_size > 1:
            return self.dcp_source_ranks(remote_tp_size, remote_dcp_size)
        return self._tp_targets(remote_tp_size)

    def dcp_consumer_count(self, remote_tp_size: int, remote_dcp_size: int) -> int:
        """How many local ranks read from each remote rank.

        The producer waits for this many reader notifications before freeing a request's blocks.
        """
        _check_positive("remote_dcp_size", remote_dcp_size)
        if remote_dcp_size > 1:
            _check_dcp_pair(self.dcp_size, remote_tp_size, remote_dcp_size)
            if self.dcp_size == 1:
                # Not sharded locally: every local rank reads every remote shard.
                return self.tp_size
            return max(1, self.dcp_size // remote_dcp_size)
        # A sharded local side has tp_size == dcp_size, so the TP formula already holds.
        return max(1, self.tp_ratio(remote_tp_size))

    def target_remote_ranks(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> list[int]:
        """Remote TP ranks this rank reads from, by TP ratio alone (ascending).

        One rank when local TP >= remote TP, ``|tp_ratio|`` consecutive ranks otherwise. DCP is
        not considered here (as in the engine); for a DCP-sharded remote use `dcp_source_ranks`.
        """
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        return self._tp_targets(info.remote_tp_size)

    def describe(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> str:
        """One-line summary of the transfer configuration towards a remote engine, for logs."""
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        try:
            tp_ratio: int | str = self.tp_ratio(info.remote_tp_size)
        except TopologyError:
            # A DCP-sharded remote may not fit a TP ratio; a log line must not raise.
            tp_ratio = "n/a"
        return (
            f"TransferTopology("
            f"tp_ratio={tp_ratio}, "
            f"num_kv_heads={1 if self.is_mla else self.total_num_kv_heads}, "
            f"local_tp={self.tp_size}, "
            f"remote_tp={info.remote_tp_size}, "
            f"remote_pp={remote_pp_rank}, "
            f"local_dcp={self.dcp_size}, "
            f"remote_dcp={info.remote_dcp_size}, "
            f"local_rank={self.tp_rank}, "
            f"remote_block_len={info.remote_block_len})"
        )

    def _tp_targets(self, remote_tp_size: int) -> list[int]:
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        return list(range(self.tp_rank * -ratio, (self.tp_rank + 1) * -ratio))


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise TopologyError(f"{name} must be >= 1, got {value}.")


def _check_dcp_pair(local_dcp_size: int, remote_tp_size: int, remote_dcp_size: int) -> None:
    """Raise `TopologyError` unless the remote DCP size is in scope for the DCP paths."""
    _check_positive("remote_tp_size", remote_tp_size)
    _check_positive("remote_dcp_size", remote_dcp_size)
    if remote_dcp_size not in (1, remote_tp_size):
        raise TopologyError(
            f"Remote DCP size {remote_dcp_size} must be 1 or the remote TP size {remote_tp_size}."
        )
    small, large = sorted((local_dcp_size, remote_dcp_size))
    if large % small:
        raise TopologyError(
            f"Local DCP size {local_dcp_size} and remote DCP size {remote_dcp_size} "
            f"do not divide one another."
        )
