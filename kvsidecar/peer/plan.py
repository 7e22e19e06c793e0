"""The transfer plan of one pull: which remote ranks, which byte ranges, landing where. Pure.

Everything is expressed as byte ranges of registered layer buffers (each layer is one dense
buffer, `kvsidecar.core.layout.buffer_nbytes` long), so both data planes execute the same plan: the
ZMQ plane sends the remote ranges as frames and receives them into the local ranges, the NIXL
plane turns both into address descriptors of one READ.

Geometry of a layer buffer: it holds one or two *regions* per block (K and V, or one MLA latent,
or one of a ``split`` pair), each ``block_len`` bytes; region ``k`` of block ``b`` starts at
``base[k] + b * stride``. A local block with ``r`` times the remote block size is filled as
``r`` sub-regions of ``block_len / r`` bytes, in token order; `kvsidecar.core.fixes.fix_received`
then turns the packed remote blocks into the local layout (the reference's receive-side fixes).

Rank mapping follows `kvsidecar.core.topology.TransferTopology`:

- local TP >= remote TP: local rank ``l`` reads one remote rank; with a TP ratio above 1 only its
  own heads, a contiguous byte range of an HND remote region (`layout.head_slice`);
- remote TP > local TP: local rank ``l`` reads ``|ratio|`` remote ranks' whole regions, each
  landing at its heads' offset in the local region (`layout.head_slice_target`), the assembled
  region being the remote (HND) layout with the local head count; replicas are read once;
- MLA: the latent is replicated, so one remote rank is read and every target rank notified;
- DCP: rank to rank between engines with the same TP and DCP sizes (other DCP combinations
  need a token re-interleave that is not implemented: `PlanError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvsidecar.core import layout
from kvsidecar.core.fixes import needs_fix
from kvsidecar.core.layout import CPU_PACKED
from kvsidecar.core.mover import MoveError, check_range
from kvsidecar.core.topology import EngineTransferInfo, TopologyError, TransferTopology
from kvsidecar.peer.messages import PeerEngine, PeerWorker
from kvsidecar.wire.types import BufferDescriptor, MemoryOrder

I64 = npt.NDArray[np.int64]


class PlanError(Exception):
    """The pull cannot be planned (unsupported combination, ids out of range); says why."""


@dataclass(frozen=True)
class Geometry:
    """Where the regions of each block sit in one layer buffer."""

    bases: tuple[int, ...]
    stride: int
    block_len: int
    num_blocks: int


def geometry(desc: BufferDescriptor) -> Geometry:
    """Region bases, block stride and region length of a dense buffer with this descriptor."""
    bl = layout.block_len(desc)
    b = desc.num_blocks
    if desc.arrangement == "kv_first":
        return Geometry((0, b * bl), bl, bl, b)
    if desc.arrangement == "blocks_first":
        return Geometry((0, bl), 2 * bl, bl, b)
    return Geometry((0,), bl, bl, b)


@dataclass(frozen=True)
class ReadPlan:
    """Byte ranges to read from one remote worker and where each lands locally.

    ``ranges`` rows are ``(remote layer index, remote offset, length)`` (the `ReadBlocks` frame);
    ``dest`` rows are ``(local layer index, local offset)``, row for row.
    """

    remote_tp_rank: int
    remote_pp_rank: int
    remote_layers: list[str]
    local_layers: list[str]
    ranges: I64
    dest: I64

    @property
    def nbytes(self) -> int:
        """Bytes this read moves."""
        return int(self.ranges[:, 2].sum()) if len(self.ranges) else 0


@dataclass(frozen=True)
class RankPlan:
    """Everything one local rank does for one request: reads, notifications, layout fixes."""

    reads: list[ReadPlan]
    notify: list[tuple[int, int]]
    """Remote workers ``(tp_rank, pp_rank)`` to notify once every read succeeded."""
    expected_readers: int
    """Consumer ranks per producer rank (``dcp_consumer_count``), sent with each notification."""
    fixes: list[tuple[str, MemoryOrder]]
    """Local layers whose received blocks need a layout fix (`kvsidecar.core.fixes.fix_received`),
    with the remote order."""
    block_size_ratio: int

    @property
    def nbytes(self) -> int:
        """Bytes all reads move."""
        return sum(r.nbytes for r in self.reads)


def _coalesce(ro: I64, lo: I64, length: int, max_frame: int) -> tuple[I64, I64, I64]:
    """Merge consecutive ranges contiguous on both sides into runs of at most ``max_frame``."""
    n = ro.size
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    start = np.ones(n, dtype=bool)
    start[1:] = (np.diff(ro) != length) | (np.diff(lo) != length)
    cap = max(1, max_frame // length)
    if cap < n:
        run_id = np.cumsum(start) - 1
        run_first = np.flatnonzero(start)
        pos = np.arange(n) - run_first[run_id]
        start |= pos % cap == 0
    first = np.flatnonzero(start)
    counts = np.diff(np.append(first, n))
    return ro[first], lo[first], counts.astype(np.int64) * length


def _topology(local: PeerEngine, worker: PeerWorker, remote: PeerEngine) -> TransferTopology:
    try:
        topo = TransferTopology(
            tp_rank=worker.tp_rank,
            tp_size=local.tp_size,
            block_size=local.block_size,
            # Engines on two nodes may share a name; the topology only refuses its own id.
            engine_id=f"local:{local.engine_id}",
            is_mla=local.compat.is_mla,
            is_mamba=False,
            total_num_kv_heads=local.compat.total_kv_heads,
            dcp_size=local.dcp_size,
        )
        first = remote.workers[0].transfer
        topo.register_remote_engine(
            remote.engine_id,
            EngineTransferInfo(
                remote_tp_size=remote.tp_size,
                remote_block_len=first.remote_block_len,
                remote_block_size=remote.block_size,
                remote_physical_blocks_per_logical=1,
                remote_dcp_size=remote.dcp_size,
            ),
        )
    except TopologyError as exc:
        raise PlanError(str(exc)) from None
    return topo


Source = tuple[int, int, int, int]
"""(remote tp rank, offset in the remote region, length, offset in the local sub-region)."""


class _HeadShape(NamedTuple):
    """The sizes that place heads in an HND region (`layout.head_slice` and its target)."""

    local_tp_size: int
    remote_tp_size: int
    num_heads_total: int
    block_size: int
    """The remote block size: the region that is sliced, or assembled from."""
    head_size: int
    itemsize: int


def _sources(
    local: PeerEngine,
    worker: PeerWorker,
    remote: PeerEngine,
    ldesc: BufferDescriptor,
    rdesc: BufferDescriptor,
) -> tuple[list[Source], list[int], int]:
    """Which remote ranks give which bytes of a region; whom to notify; readers per rank."""
    topo = _topology(local, worker, remote)
    shape = _HeadShape(
        local_tp_size=local.tp_size,
        remote_tp_size=remote.tp_size,
        num_heads_total=local.compat.total_kv_heads,
        block_size=remote.block_size,
        head_size=rdesc.head_size,
        itemsize=layout.torch_dtype(rdesc.dtype).itemsize,
    )
    rbl = layout.block_len(rdesc)
    lsub = layout.block_len(ldesc) // (local.block_size // remote.block_size)
    try:
        if local.dcp_size > 1 or remote.dcp_size > 1:
            if (local.tp_size, local.dcp_size) != (remote.tp_size, remote.dcp_size):
                raise PlanError(
                    f"DCP transfers need equal TP and DCP sizes on both sides (rank to rank); "
                    f"local tp/dcp {local.tp_size}/{local.dcp_size}, remote "
                    f"{remote.tp_size}/{remote.dcp_size}"
                )
            expected = topo.dcp_consumer_count(remote.tp_size, remote.dcp_size)
            return [(worker.tp_rank, 0, rbl, 0)], [worker.tp_rank], expected
        targets = topo.target_remote_ranks(remote.engine_id)
        expected = topo.dcp_consumer_count(remote.tp_size, 1)
        if local.compat.is_mla:
            return [(targets[0], 0, rbl, 0)], targets, expected
        ratio = topo.tp_ratio(remote.tp_size)
        if ratio != 1 and {ldesc.arrangement, rdesc.arrangement} & set(CPU_PACKED):
            raise PlanError(
                "heterogeneous TP is not supported for vLLM's CPU cache layouts (vllm_cpu*): "
                f"local TP {local.tp_size}, remote TP {remote.tp_size}"
            )
        if ratio == 1:
            return [(targets[0], 0, rbl, 0)], targets, expected
        if ratio > 1:
            return [_own_heads(shape, worker.tp_rank, targets[0], rdesc)], targets, expected
        return _assembled_heads(shape, targets, rdesc, lsub), targets, expected
    except (TopologyError, layout.LayoutError) as exc:
        raise PlanError(str(exc)) from None


def _own_heads(
    shape: _HeadShape, local_tp_rank: int, remote_tp_rank: int, rdesc: BufferDescriptor
) -> Source:
    """Local TP > remote TP: this rank's own heads, one byte range of one remote region."""
    off, length = layout.head_slice(local_tp_rank=local_tp_rank, **shape._asdict())
    if length != layout.block_len(rdesc) and rdesc.memory_order != "HND":
        raise PlanError(
            f"local TP {shape.local_tp_size} > remote TP {shape.remote_tp_size} reads a head "
            "slice of each remote block, which needs HND memory order on the producer "
            f"(it is {rdesc.memory_order})"
        )
    return (remote_tp_rank, off, length, 0)


def _assembled_heads(
    shape: _HeadShape, targets: list[int], rdesc: BufferDescriptor, lsub: int
) -> list[Source]:
    """Remote TP > local TP: whole remote regions, each at its heads' offset in the local one."""
    rbl = layout.block_len(rdesc)
    sources: list[Source] = []
    seen: set[int] = set()
    for q in targets:
        off, _ = layout.head_slice_target(remote_tp_rank=q, **shape._asdict())
        if off not in seen:  # replicated heads: one replica is enough
            seen.add(off)
            sources.append((q, 0, rbl, off))
    if len(sources) > 1 and rdesc.memory_order != "HND":
        raise PlanError(
            f"remote TP {shape.remote_tp_size} > local TP {shape.local_tp_size} assembles each "
            "local block from several remote ranks' heads, which needs HND memory order on the "
            f"producer (it is {rdesc.memory_order})"
        )
    if any(off + length > lsub for _, _, length, off in sources):
        raise PlanError("remote regions do not fit the local region (head counts disagree)")
    return sources


def _block_ratio(local: PeerEngine, remote: PeerEngine, n_remote: int, n_local: int) -> int:
    """Remote blocks per local block; refuses sizes that do not divide and ids that do not fill."""
    if local.block_size % remote.block_size:
        raise PlanError(
            f"local block size {local.block_size} is not a multiple of the remote "
            f"{remote.block_size}"
        )
    bs = local.block_size // remote.block_size
    if not (bs * (n_local - 1) < n_remote <= bs * n_local) and (n_remote or n_local):
        raise PlanError(
            f"{n_remote} remote blocks do not fill {n_local} local blocks "
            f"of {bs} remote blocks each"
        )
    return bs


class _RemoteRanks:
    """The remote engine's workers by pipeline stage, and the stage that holds each layer."""

    def __init__(self, remote: PeerEngine) -> None:
        self.engine_id = remote.engine_id
        self.by_pp: dict[int, dict[int, PeerWorker]] = {}
        for rw in remote.workers:
            # The handshake is another daemon's word: a rank whose lists disagree in length
            # would index past them later (on the NIXL plane, ``layer_addrs`` by layer).
            n = len(rw.layers)
            if len(rw.descriptors) != n or len(rw.layer_addrs) not in (0, n):
                raise PlanError(
                    f"remote engine {self.engine_id!r} describes rank tp{rw.tp_rank}.pp"
                    f"{rw.pp_rank} with {n} layers, {len(rw.descriptors)} descriptors and "
                    f"{len(rw.layer_addrs)} addresses"
                )
            self.by_pp.setdefault(rw.pp_rank, {})[rw.tp_rank] = rw
        self.layer_home: dict[str, int] = {}
        for pp, ranks in self.by_pp.items():
            for name in next(iter(ranks.values())).layers:
                self.layer_home[name] = pp
        self._layer_index: dict[tuple[int, int], dict[str, int]] = {}
        self._first: dict[int, BufferDescriptor] = {}

    def layer_index(self, rw: PeerWorker) -> dict[str, int]:
        """Return layer name -> its place in ``rw.layers`` (made once per worker)."""
        key = (rw.tp_rank, rw.pp_rank)
        found = self._layer_index.get(key)
        if found is None:
            found = self._layer_index[key] = {name: i for i, name in enumerate(rw.layers)}
        return found

    def home(self, name: str) -> int:
        """Return the pipeline stage that holds layer ``name``."""
        pp = self.layer_home.get(name)
        if pp is None:
            raise PlanError(f"remote engine {self.engine_id!r} has no layer {name!r}")
        return pp

    def first_descriptor(self, pp: int) -> BufferDescriptor:
        """Return the first layer descriptor of the lowest TP rank of stage ``pp``."""
        found = self._first.get(pp)
        if found is None:
            ranks = self.by_pp[pp]
            found = self._first[pp] = ranks[min(ranks)].descriptors[0]
        return found

    def worker(self, tp: int, pp: int) -> PeerWorker:
        """Return remote rank ``tp``, ``pp``; refuse one that is not registered."""
        found = self.by_pp[pp].get(tp)
        if found is None:
            raise PlanError(
                f"remote engine {self.engine_id!r} has no rank tp{tp}.pp{pp} registered"
            )
        return found


@dataclass(frozen=True)
class _Blocks:
    """One request's block ids on both sides, and where each remote block lands locally."""

    remote_ids: I64
    local_ids: I64
    ratio: int
    """Remote blocks per local block."""
    local_rows: I64
    """Per remote block: ``local block * ratio + its place in that local block``."""

    @classmethod
    def of(cls, remote_ids: I64, local_ids: I64, ratio: int) -> _Blocks:
        """Index the ids of one request (remote blocks fill the local ones in order)."""
        sub = np.arange(remote_ids.size, dtype=np.int64)
        rows = local_ids.astype(np.int64)[sub // ratio] * ratio + sub % ratio
        return cls(remote_ids.astype(np.int64), local_ids, ratio, rows)


def _check_ids(ids: I64, geo: Geometry, side: str) -> None:
    """Refuse block ids (``side``: local or remote) outside a buffer of geometry ``geo``.

    The check is `check_range`'s; the refusal is a plan that does not fit (`PlanError`).
    """
    try:
        check_range(ids, geo.num_blocks, side)
    except MoveError:
        raise PlanError(f"{side} block ids out of range 0..{geo.num_blocks - 1}") from None


Runs = tuple[I64, I64, I64]
"""Coalesced runs of one K/V region: (remote starts, local starts, lengths)."""


@dataclass(eq=False)
class _Reads:
    """The rows gathered for one remote worker until they become its `ReadPlan`."""

    rows: list[tuple[int, int, Runs]] = field(default_factory=list)
    """(remote layer index, local layer index, runs), in the order they were added."""
    layers: dict[str, int] = field(default_factory=dict)
    """Remote layer name -> its index, in the order first added (a dict: a list search per row
    added up over many layers)."""

    def add(self, name: str, local_index: int, runs: Runs) -> None:
        """Add coalesced runs of layer ``name`` (kept as they are: arrays are built once)."""
        self.rows.append((self.layers.setdefault(name, len(self.layers)), local_index, runs))

    def plan(self, tp: int, pp: int, local_layers: list[str]) -> ReadPlan:
        """Return the read of remote worker ``tp``, ``pp`` with every row gathered."""
        counts = [runs[0].size for _, _, runs in self.rows]
        remote_index = np.repeat(np.array([r for r, _, _ in self.rows], np.int64), counts)
        local_index = np.repeat(np.array([li for _, li, _ in self.rows], np.int64), counts)
        starts_r, starts_l, lengths = (
            np.concatenate([runs[k] for _, _, runs in self.rows]).astype(np.int64) for k in range(3)
        )
        return ReadPlan(
            remote_tp_rank=tp,
            remote_pp_rank=pp,
            remote_layers=list(self.layers),
            local_layers=list(local_layers),
            ranges=np.ascontiguousarray(np.stack([remote_index, starts_r, lengths], 1)),
            dest=np.ascontiguousarray(np.stack([local_index, starts_l], 1)),
        )


def _source_runs(
    source: Source,
    rdesc: BufferDescriptor,
    ldesc: BufferDescriptor,
    blocks: _Blocks,
    *,
    name: str,
    max_frame: int,
) -> list[Runs]:
    """Return the runs that bring one source's bytes of a layer, one entry per K/V region.

    They depend on the layer only through its two descriptors: `plan_rank` computes them once
    per distinct pair, not once per layer.
    """
    _, roff, length, loff = source
    try:  # the remote descriptor is another daemon's word, checked here on its first use
        rgeo, lgeo = geometry(rdesc), geometry(ldesc)
    except layout.LayoutError as exc:
        raise PlanError(f"layer {name!r}: {exc}") from None
    _check_ids(blocks.remote_ids, rgeo, "remote")
    if len(rgeo.bases) != len(lgeo.bases):
        raise PlanError(f"layer {name!r}: K/V regions differ between the engines")
    rows, bs = blocks.local_rows, blocks.ratio
    lsub = lgeo.block_len // bs
    out = []
    for k in range(len(lgeo.bases)):
        ro = rgeo.bases[k] + blocks.remote_ids * rgeo.stride + roff
        lo = lgeo.bases[k] + (rows // bs) * lgeo.stride + (rows % bs) * lsub + loff
        out.append(_coalesce(ro, lo, length, max_frame))
    return out


def plan_rank(
    local: PeerEngine,
    worker: PeerWorker,
    remote: PeerEngine,
    remote_ids: I64,
    local_ids: I64,
    *,
    max_frame: int = 1 << 20,
) -> RankPlan:
    """Plan one local rank's part of one request.

    ``remote_ids`` are the producer's blocks in token order, ``local_ids`` the blocks they land
    in (with a block-size ratio ``r``: ``r * (len(local_ids) - 1) < len(remote_ids) <= r *
    len(local_ids)``). Raises `PlanError` for anything that cannot be served.
    """
    bs = _block_ratio(local, remote, remote_ids.size, local_ids.size)
    ranks = _RemoteRanks(remote)
    blocks = _Blocks.of(remote_ids, local_ids, bs)
    reads: dict[tuple[int, int], _Reads] = {}
    fixes: list[tuple[str, MemoryOrder]] = []
    notify: set[tuple[int, int]] = set()
    expected = 1
    # Layers share descriptors (usually all of them one): topology and runs once per pair.
    sourced: dict[tuple[BufferDescriptor, BufferDescriptor], tuple[list[Source], list[int], int]]
    sourced = {}
    runs: dict[tuple[Source, BufferDescriptor, BufferDescriptor], list[Runs]] = {}
    checked: set[BufferDescriptor] = set()
    fix_of: dict[tuple[BufferDescriptor, BufferDescriptor], bool] = {}
    # This loop runs once per layer of every pull: each step below is a lookup of what the first
    # layer of the same descriptors computed, so a plan's cost grows with its distinct descriptors.
    for li, name in enumerate(worker.layers):
        pp = ranks.home(name)
        ldesc = worker.descriptors[li]
        first = ranks.first_descriptor(pp)
        found = sourced.get((ldesc, first))
        if found is None:
            found = sourced[ldesc, first] = _sources(local, worker, remote, ldesc, first)
        sources, targets, expected = found
        for q in targets:
            notify.add((q, pp))
        if ldesc not in checked:
            _check_ids(blocks.local_ids, geometry(ldesc), "local")
            checked.add(ldesc)
        rdesc: BufferDescriptor | None = None
        for source in sources:
            rw = ranks.worker(source[0], pp)
            at = ranks.layer_index(rw).get(name)
            if at is None:
                raise PlanError(f"remote rank tp{rw.tp_rank}.pp{pp} has no layer {name!r}")
            rdesc = rw.descriptors[at]
            key = (source, rdesc, ldesc)
            regions = runs.get(key)
            if regions is None:
                regions = runs[key] = _source_runs(
                    source, rdesc, ldesc, blocks, name=name, max_frame=max_frame
                )
            entry = reads.get((source[0], pp))
            if entry is None:
                entry = reads[source[0], pp] = _Reads()
            for region in regions:
                entry.add(name, li, region)
        if rdesc is not None:
            fix = fix_of.get((rdesc, ldesc))
            if fix is None:
                fix = fix_of[rdesc, ldesc] = needs_fix(rdesc.memory_order, ldesc, bs)
            if fix:
                fixes.append((name, rdesc.memory_order))
    return RankPlan(
        reads=[reads[key].plan(*key, worker.layers) for key in sorted(reads)],
        notify=sorted(notify),
        expected_readers=expected,
        fixes=fixes,
        block_size_ratio=bs,
    )
