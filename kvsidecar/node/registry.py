"""What the daemon knows: engines, their workers, and each worker's mapped buffers.

Pure bookkeeping, no I/O: the daemon maps memory, then hands the result here. Each worker has a
``device`` buffer set (its registered layers) and, when its engine declared host capacity, a
``host`` buffer set: a mirror in the daemon's host pool with, per layer, the same descriptor as
the registered layer except ``num_blocks`` (the engine's host capacity). Host block ids are
engine-wide: id ``i`` names block ``i`` of every worker's mirror, so one `host_alloc` serves all
of an engine's ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from kvsidecar.core import layout
from kvsidecar.memory.base import HandleError, MappedBuffer, TensorBuffer
from kvsidecar.memory.host_pool import BlockIdAllocator, HostPool
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import (
    BufferDescriptor,
    BufferInfo,
    BufferSetRef,
    EngineInfo,
    Medium,
    WorkerInfo,
    WorkerRef,
)


@dataclass(eq=False)
class LayerBuffer:
    """One mapped layer: descriptor, mapping, logical view, and per-block byte views.

    ``block_views`` are ``(num_blocks, row)`` uint8 views (two for a ``kv_first`` layer: K, V)
    that the mover copies whole rows of.
    """

    name: str
    descriptor: BufferDescriptor
    mapped: MappedBuffer
    cache: torch.Tensor
    block_views: list[torch.Tensor]

    @classmethod
    def map(cls, name: str, descriptor: BufferDescriptor, mapped: MappedBuffer) -> LayerBuffer:
        """Build the views of a mapped buffer; raises `SidecarError` if the sizes disagree."""
        try:
            need = layout.buffer_nbytes(descriptor)
        except layout.LayoutError as exc:
            raise SidecarError("incompatible_buffers", f"layer {name!r}: {exc}") from None
        if need != mapped.nbytes:
            raise SidecarError(
                "incompatible_buffers",
                f"layer {name!r}: descriptor needs {need} bytes, the handle maps {mapped.nbytes}",
            )
        try:
            cache = layout.view_buffer(mapped.flat, descriptor)
            views = layout.block_views(cache, descriptor)
        except layout.LayoutError as exc:
            raise SidecarError("incompatible_buffers", f"layer {name!r}: {exc}") from None
        return cls(name, descriptor, mapped, cache, list(views))

    def close(self) -> None:
        """Drop the views, then the mapping."""
        self.block_views = []
        self.cache = torch.empty(0)
        self.mapped.close()


@dataclass(eq=False)
class BufferSet:
    """A worker's layers in one medium (its registered memory, or its host mirror).

    A prefix-cache namespace (`kvsidecar.daemon.cache.prefix`) is a buffer set too, keyed by a
    name of its own and the medium ``"cache"``.
    """

    key: tuple[WorkerRef, str]
    layers: dict[str, LayerBuffer]
    on_close: Callable[[], None] | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks per layer (every layer of a set has the same count)."""
        first = next(iter(self.layers.values()), None)
        return 0 if first is None else first.descriptor.num_blocks

    @property
    def nbytes(self) -> int:
        """Mapped bytes over all layers."""
        return sum(layer.mapped.nbytes for layer in self.layers.values())

    def close(self) -> None:
        """Release every layer's mapping, then the set's own resources (host extents)."""
        for layer in self.layers.values():
            layer.close()
        self.layers = {}
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()


def host_buffer_set(
    pool: HostPool,
    key: tuple[WorkerRef, str],
    descs: list[tuple[str, BufferDescriptor]],
    *,
    owner: str = "",
) -> BufferSet:
    """Reserve a buffer set in the host pool: one dense layer buffer per ``(name, descriptor)``.

    ``owner``: the user the pool counts the bytes against (its ``host_pool_user_bytes`` quota).

    Raises `SidecarError` ``pool_exhausted`` when the pool has no room. Layers start on 4 KiB
    boundaries (dtype views need aligned storage, pages help copies); the set gives the extent
    back when it closes.
    """
    sizes = [layout.buffer_nbytes(d) for _, d in descs]
    pitches = [-(-n // 4096) * 4096 for n in sizes]
    try:
        extent = pool.reserve(sum(pitches), owner=owner)
    except HandleError as exc:
        raise SidecarError("pool_exhausted", str(exc)) from None
    layers = {}
    offset = 0
    for (name, desc), nbytes, pitch in zip(descs, sizes, pitches, strict=True):
        buf = TensorBuffer(extent.flat[offset : offset + nbytes], "host_pool")
        layers[name] = LayerBuffer.map(name, desc, buf)
        offset += pitch
    return BufferSet(key, layers, on_close=extent.close)


def unknown_engine(engine_id: str) -> SidecarError:
    """Return the error of a command naming an engine that is not registered.

    Also for an engine that is not the sender's to know of: the same words, so that the two
    cannot be told apart.
    """
    return SidecarError("unknown_engine", f"no engine {engine_id!r} is registered")


@dataclass(eq=False)
class Worker:
    """One registered worker process."""

    ref: WorkerRef
    tp_size: int
    pp_size: int
    dcp_size: int
    device: BufferSet
    host: BufferSet | None
    lease_deadline: float
    fd_connection: Hashable | None = None
    """The fd-channel connection its fds came on; its closing means the worker died."""
    epoch: int = 0
    """Registration epoch (`Registered.epoch`): fences commands meant for an earlier one."""

    def buffer_set(self, medium: Medium) -> BufferSet:
        """Return the registered layers or the host mirror (``pool_exhausted`` if it has none)."""
        if medium == "device":
            return self.device
        if self.host is None:
            raise SidecarError(
                "pool_exhausted",
                f"{self.ref.label()} has no host mirror (its engine declared host_blocks=0)",
            )
        return self.host

    def close(self) -> None:
        """Release the registered mappings and the host mirror."""
        self.device.close()
        if self.host is not None:
            self.host.close()


@dataclass(eq=False)
class Engine:
    """An engine: its identity, its workers, its host-block id space."""

    engine_id: str
    model_hash: str
    tp_size: int
    pp_size: int
    dcp_size: int
    host_blocks: int
    allocator: BlockIdAllocator | None
    workers: dict[WorkerRef, Worker] = field(default_factory=dict)
    epoch: int = 0
    """The epoch of the registration that created it: with the name, its identity for rights."""
    owner: str = ""
    """The transport user that created it (``uid:<n>``, ``curve:<key>``): only it may join."""

    def host_used(self) -> int:
        """Host blocks currently allocated to this engine."""
        if self.allocator is None:
            return 0
        return self.host_blocks - self.allocator.num_free


def check_epoch(worker: Worker, epoch: int) -> None:
    """Raise ``stale_epoch`` when ``epoch`` (0: unchecked) is not the worker's current one."""
    if epoch and epoch != worker.epoch:
        raise SidecarError(
            "stale_epoch",
            f"{worker.ref.label()} is registration epoch {worker.epoch}, the command names "
            f"{epoch} (an earlier registration of it)",
        )


class Registry:
    """Engines and workers by name, with the lookups commands need (typed errors on a miss)."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.workers: dict[WorkerRef, Worker] = {}
        self.derived: dict[Hashable, object] = {}
        """What commands compute from registered buffers and reuse (`kvsidecar.node.jobs` move
        plans). Emptied on every `add` and `remove`, so nothing in it outlives a release or
        refers to a replaced registration."""

    def engine(self, engine_id: str) -> Engine:
        """Return the engine, or raise ``unknown_engine``."""
        engine = self.engines.get(engine_id)
        if engine is None:
            raise unknown_engine(engine_id)
        return engine

    def worker(self, ref: WorkerRef) -> Worker:
        """Return the worker, or raise ``unknown_engine`` / ``unknown_worker``."""
        worker = self.workers.get(ref)
        if worker is None:
            self.engine(ref.engine_id)
            raise SidecarError("unknown_worker", f"no worker {ref.label()} is registered")
        return worker

    def rank_worker(self, engine_id: str, tp_rank: int, pp_rank: int) -> Worker | None:
        """Return the engine's worker of these TP and PP ranks (any DCP rank), or None."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return None
        return next(
            (
                w
                for w in engine.workers.values()
                if (w.ref.tp_rank, w.ref.pp_rank) == (tp_rank, pp_rank)
            ),
            None,
        )

    def buffer_set(self, ref: BufferSetRef) -> BufferSet:
        """Resolve one side of a move (``stale_epoch`` if it names an earlier registration)."""
        worker = self.worker(ref.worker)
        check_epoch(worker, ref.epoch)
        return worker.buffer_set(ref.medium)

    def add(self, engine: Engine, worker: Worker) -> None:
        """Record a worker (and its engine, if new)."""
        self.derived.clear()
        self.engines.setdefault(engine.engine_id, engine)
        self.engines[engine.engine_id].workers[worker.ref] = worker
        self.workers[worker.ref] = worker

    def remove(self, ref: WorkerRef) -> Worker | None:
        """Forget a worker (the caller releases it); drop its engine when it was the last one."""
        worker = self.workers.pop(ref, None)
        if worker is None:
            return None
        self.derived.clear()
        engine = self.engines.get(ref.engine_id)
        if engine is not None:
            engine.workers.pop(ref, None)
            if not engine.workers:
                del self.engines[ref.engine_id]
        return worker

    def engine_infos(
        self,
        now: float,
        in_flight: Callable[[WorkerRef], int],
        visible: Callable[[Engine], bool] = lambda engine: True,
    ) -> list[EngineInfo]:
        """Status view of every engine ``visible`` lets through."""
        out = []
        for engine in self.engines.values():
            if not visible(engine):
                continue
            workers = []
            for w in engine.workers.values():
                layers = [
                    BufferInfo(name, lb.mapped.kind, lb.mapped.nbytes, lb.descriptor)
                    for name, lb in w.device.layers.items()
                ]
                workers.append(
                    WorkerInfo(
                        worker=w.ref,
                        tp_size=w.tp_size,
                        pp_size=w.pp_size,
                        dcp_size=w.dcp_size,
                        layers=layers,
                        nbytes=w.device.nbytes,
                        host_mirror_bytes=0 if w.host is None else w.host.nbytes,
                        lease_left_s=max(0.0, w.lease_deadline - now),
                        in_flight=in_flight(w.ref),
                    )
                )
            out.append(
                EngineInfo(
                    engine_id=engine.engine_id,
                    model_hash=engine.model_hash,
                    workers=workers,
                    host_blocks=engine.host_blocks,
                    host_blocks_used=engine.host_used(),
                )
            )
        return out
