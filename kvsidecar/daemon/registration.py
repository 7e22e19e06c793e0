"""Registration: who may move what, and for how long.

The command handlers that make and unmake workers: ``hello``, ``register`` (mapping a worker's
layers, its host mirror), ``unregister``, ``heartbeat``, ``grant``; and the two ways a worker
leaves without asking: its fd channel closes, or its lease runs out (`Registrations.lease_loop`).
`Registrations.release` is the one way out for all of them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Hashable

import msgspec
import torch

from kvsidecar import __version__
from kvsidecar.core import layout
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.limits.access import AccessControl, EngineId, Principal
from kvsidecar.daemon.metrics.observability import Observability
from kvsidecar.daemon.state import DaemonState
from kvsidecar.memory import cuda_driver, open_handles
from kvsidecar.memory.base import HandleError, MappedBuffer
from kvsidecar.memory.cuda_ipc import IpcBackend
from kvsidecar.memory.fd_channel import FdChannelServer, FdConnection
from kvsidecar.memory.host_pool import BlockIdAllocator, HostPool
from kvsidecar.memory.shm import open_shm_all
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.registry import (
    BufferSet,
    Engine,
    LayerBuffer,
    Registry,
    Worker,
    check_epoch,
    host_buffer_set,
    unknown_engine,
)
from kvsidecar.wire.errors import SidecarError, require_distinct
from kvsidecar.wire.protocol import (
    PROTOCOL_VERSION,
    Grant,
    Heartbeat,
    Hello,
    HelloReply,
    Ok,
    Register,
    Registered,
    Reply,
    Unregister,
)
from kvsidecar.wire.types import BufferDescriptor, CudaVmmRef, ShmRef, WorkerRef

log = logging.getLogger("kvsidecar.daemon")  # one logger for the whole daemon


class Registrations:
    """Handlers of the registration commands, and the release of workers."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        *,
        completions: CompletionService,
        observability: Observability,
        access: AccessControl,
        executor: CopyExecutor,
        pool: HostPool | None,
        fd_server: FdChannelServer,
        state: DaemonState,
        daemon_id: str,
    ) -> None:
        self._config = config
        self._registry = registry
        self._completions = completions
        self._observability = observability
        self._access = access
        self._executor = executor
        self._pool = pool
        self._fd_server = fd_server
        self._state = state
        self.daemon_id = daemon_id
        """This daemon's identity in hello replies."""
        # Epochs start at the start time in microseconds: unique across daemon restarts too.
        self._epochs = itertools.count(time.time_ns() // 1000)
        self.capabilities: tuple[str, ...] = daemon_capabilities()
        """What `hello` announces."""
        self.cuda_backend: IpcBackend | None = None
        """How CUDA IPC handles are opened (None: torch's); tests without a GPU set their own."""

    def hello(self, req: Hello) -> HelloReply:
        """Answer ``hello``: what this daemon is, speaks and allows."""
        cfg = self._config
        return HelloReply(
            id=req.id,
            protocol_version=PROTOCOL_VERSION,
            daemon_version=__version__,
            fd_socket=cfg.fd_socket,
            lease_s=cfg.lease_s,
            max_message_bytes=cfg.max_message_bytes,
            max_ids_per_command=cfg.max_ids_per_command,
            metrics_port=self._observability.port,
            capabilities=list(self.capabilities),
            peer_endpoint=cfg.peer_endpoint,
            daemon_id=self.daemon_id,
        )

    def heartbeat(self, req: Heartbeat, who: Principal) -> Ok:
        """Renew the leases of every named worker, or of none (an unknown or stale one).

        A worker of another user's engine is answered as one that does not exist, and not
        renewed: a heartbeat tells its sender about its own user's engines only.
        """
        deadline = time.monotonic() + self._config.lease_s
        workers = [self._own_worker(ref, who) for ref in req.workers]  # all known, or none renewed
        for worker, epoch in zip(workers, req.epochs, strict=False):
            check_epoch(worker, epoch)  # a restarted worker's old heartbeat renews nothing
        for worker in workers:
            worker.lease_deadline = deadline
        return Ok(id=req.id)

    def _own_worker(self, ref: WorkerRef, who: Principal) -> Worker:
        engine = self._registry.engines.get(ref.engine_id)
        if engine is not None and not self._access.owns(who, engine):
            raise unknown_engine(ref.engine_id)
        return self._registry.worker(ref)

    def grant(self, req: Grant, who: Principal) -> Ok:
        """Let ``req.grantee`` use the owner's engine (read and/or write; see `access`)."""
        self._registry.worker(req.owner)
        if not req.grantee:
            raise SidecarError("invalid_message", "grantee must not be empty")
        owner = self._registry.engine(req.owner.engine_id)
        self._access.grant(
            EngineId(owner.engine_id, owner.epoch),
            req.grantee,
            req.grantee_user or owner.owner,
            read=req.read,
            write=req.write,
        )
        return Ok(id=req.id)

    async def register(self, req: Register, who: Principal) -> Reply:
        """Map a worker's layers (and reserve its host mirror); all or nothing."""
        ref = req.worker
        if len(req.layers) > self._config.max_layers:
            raise SidecarError(
                "too_large",
                f"{len(req.layers)} layers, more than max_layers {self._config.max_layers}",
            )
        _check_identity(req)
        if ref in self._registry.workers:
            raise SidecarError("already_registered", f"{ref.label()} is already registered")
        engine = self._engine_for(req, who)  # sizes checked: nothing allocated or mapped yet
        buffers, conn_id = await self._map_layers(req)
        layers: dict[str, LayerBuffer] = {}
        device: BufferSet | None = None
        host: BufferSet | None = None
        try:
            for spec, mapped in zip(req.layers, buffers, strict=True):
                layers[spec.name] = LayerBuffer.map(spec.name, spec.descriptor, mapped)
            device = BufferSet((ref, "device"), layers)
            if engine.host_blocks > 0:
                host = self._mirror(ref, req, engine.host_blocks, who.user)
            # Checked again: another register of the same worker may have finished meanwhile.
            if ref in self._registry.workers:
                raise SidecarError("already_registered", f"{ref.label()} is already registered")
            existing = self._registry.engines.get(ref.engine_id)
            if existing is not None and existing is not engine:
                self._check_engine_matches(existing, req)
                engine = existing
            # Checked again now, with the registry as the worker joins it: the name may have
            # been taken by another user while the fds were awaited.
            self._access.check_register(who, ref.engine_id)
        except BaseException:
            for mapped in buffers:
                mapped.close()
            if host is not None:
                host.close()
            raise
        worker = Worker(
            ref=ref,
            tp_size=req.tp_size,
            pp_size=req.pp_size,
            dcp_size=req.dcp_size,
            device=device,
            host=host,
            lease_deadline=time.monotonic() + self._config.lease_s,
            fd_connection=conn_id,
            epoch=next(self._epochs),  # fences the commands of earlier registrations
        )
        self._registry.add(engine, worker)
        engine_id = EngineId(engine.engine_id, engine.epoch)
        if existing is None:
            self._access.engine_created(engine_id, engine.owner)
        self._access.bind(who, ref, engine_id)
        # Reports carry this registration's epoch; the engine's metric series start at 0.
        epoch = self._completions.worker_registered(
            ref, engine.tp_size * engine.pp_size, epoch=worker.epoch or None
        )
        self._observability.engine_added(ref.engine_id)
        log.info(
            "registered %s: %d layers, %d bytes, %d host blocks",
            ref.label(),
            len(layers),
            device.nbytes,
            engine.host_blocks,
        )
        return Registered(
            id=req.id,
            worker=ref,
            num_layers=len(layers),
            nbytes=device.nbytes,
            host_blocks=engine.host_blocks if host is not None else 0,
            lease_s=self._config.lease_s,
            epoch=epoch,
        )

    def _engine_for(self, req: Register, who: Principal) -> Engine:
        """Return the engine the worker joins (or a new one); its mirror's size checked first."""
        existing = self._registry.engines.get(req.worker.engine_id)
        if existing is not None:
            self._check_engine_matches(existing, req)
            self._check_mirror(req, existing.host_blocks, who.user)
            return existing
        if req.host_blocks < 0:
            raise SidecarError("invalid_message", "host_blocks must be >= 0")
        if req.host_blocks > self._config.max_host_blocks:
            raise SidecarError(
                "too_large",
                f"host_blocks {req.host_blocks} is more than max_host_blocks "
                f"{self._config.max_host_blocks}",
            )
        self._check_mirror(req, req.host_blocks, who.user)
        return Engine(
            engine_id=req.worker.engine_id,
            model_hash=req.model_hash,
            tp_size=req.tp_size,
            pp_size=req.pp_size,
            dcp_size=req.dcp_size,
            host_blocks=req.host_blocks,
            allocator=BlockIdAllocator(req.host_blocks) if req.host_blocks > 0 else None,
            epoch=next(self._epochs),
            owner=who.user,
        )

    @staticmethod
    def _check_engine_matches(engine: Engine, req: Register) -> None:
        mine = (engine.model_hash, engine.tp_size, engine.pp_size, engine.dcp_size)
        theirs = (req.model_hash, req.tp_size, req.pp_size, req.dcp_size)
        if mine != theirs:
            raise SidecarError(
                "incompatible_engine",
                f"engine {engine.engine_id!r} is registered with (model_hash, tp, pp, dcp) = "
                f"{mine}, this worker says {theirs}",
            )
        if req.host_blocks not in (0, engine.host_blocks):
            raise SidecarError(
                "incompatible_engine",
                f"engine {engine.engine_id!r} has {engine.host_blocks} host blocks, "
                f"this worker asks for {req.host_blocks}",
            )

    async def _map_layers(self, req: Register) -> tuple[list[MappedBuffer], Hashable | None]:
        """Map every layer's memory; all or nothing. Returns the buffers and the fd connection.

        The mapping runs on a helper thread: CUDA initialisation and IPC opens block for
        milliseconds to seconds, and the loop keeps serving everyone else meanwhile.
        """
        handles = [s.handle for s in req.layers]
        fds: list[int] = []
        conn_id: Hashable | None = None
        # A token binds the registration to its fd channel connection (whose end releases the
        # worker), also when it carries no fds (GPU memory); shm and VMM handles need one.
        if req.fd_token or any(isinstance(h, (ShmRef, CudaVmmRef)) for h in handles):
            conn_id, fds = await self._take_fds(req)
        opening = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(open_handles, handles, fds, cuda_backend=self.cuda_backend)
        )
        try:
            return await asyncio.shield(opening), conn_id
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)  # the thread finishes; then close its work
            raise
        except HandleError as exc:
            raise SidecarError("handle_error", str(exc)) from None

    async def _take_fds(self, req: Register) -> tuple[Hashable, list[int]]:
        """Collect the fds sent under the registration's tokens, in order (the caller owns them)."""
        if not req.fd_token:
            raise SidecarError("handle_error", "shm and cuda_vmm layers need an fd_token")
        fds: list[int] = []
        conns: set[Hashable] = set()
        try:
            for token in (req.fd_token, *req.fd_tokens):
                try:
                    conn, got = await self._fd_server.take(token, self._config.fd_wait_s)
                except (TimeoutError, asyncio.TimeoutError):
                    raise SidecarError(
                        "handle_error",
                        f"no fds arrived on {self._config.fd_socket} for this registration",
                    ) from None
                except HandleError as exc:  # busy: refused or lost for lack of room, retry
                    raise SidecarError(
                        "busy" if exc.code == "busy" else "handle_error", str(exc)
                    ) from None
                fds += got
                conns.add(conn.id)
            if len(conns) != 1:
                raise SidecarError("handle_error", "a registration's fds came on several channels")
        except BaseException:
            open_shm_all(fds, [])  # closes them
            raise
        return conns.pop(), fds

    def _check_mirror(self, req: Register, host_blocks: int, user: str) -> int:
        """Return the bytes of the worker's host mirror; ``pool_exhausted`` if they cannot fit.

        Pure arithmetic on the descriptors, checked against the pool and ``user``'s quota
        (``host_pool_user_bytes``) before anything is allocated or mapped.
        """
        if host_blocks == 0:
            return 0
        pool = self._pool
        if pool is None:
            raise SidecarError("pool_exhausted", "the daemon runs without a host pool")
        need = sum(pitch for _, _, _, pitch in _mirror_layers(req, host_blocks))
        if need > pool.capacity_bytes:
            raise SidecarError(
                "pool_exhausted",
                f"a host mirror of {need} bytes is larger than the pool ({pool.capacity_bytes})",
            )
        quota = self._config.user_pool_bytes
        if pool.used_by(user) + need > quota:
            raise SidecarError(
                "pool_exhausted",
                f"{user} holds {pool.used_by(user)} host-pool bytes (host mirrors and cache "
                f"namespaces); {need} more would pass its quota of {quota} (host_pool_user_bytes"
                ", or the pool's share per allowed uid)",
            )
        return need

    def _mirror(self, ref: WorkerRef, req: Register, host_blocks: int, user: str) -> BufferSet:
        """Reserve the worker's host mirror: per layer, its descriptor with ``host_blocks``."""
        self._check_mirror(req, host_blocks, user)  # again: others may have reserved meanwhile
        assert self._pool is not None
        descs = [(name, desc) for name, desc, _, _ in _mirror_layers(req, host_blocks)]
        return host_buffer_set(self._pool, (ref, "host"), descs, owner=user)

    async def unregister(self, req: Unregister) -> Reply:
        """Release a worker at its own request."""
        await self.release(req.worker, "unregistered")
        return Ok(id=req.id)

    async def release(self, ref: WorkerRef, why: str) -> None:
        """Forget a worker at once; close its mappings once no copy touches them (bounded)."""
        engine = self._registry.engines.get(ref.engine_id)
        worker = self._registry.remove(ref)
        if worker is None or engine is None:
            return
        # What waited for this worker completes (receiving: failed), in completions and metrics.
        self._completions.worker_departed(ref, why)
        if ref.engine_id not in self._registry.engines:
            self._observability.engine_departed(ref.engine_id)
        # Its queued copies fail at once (worker_lost; running ones finish on their thread and
        # fail at the end), its connection binding and grants go.
        for fut, refs in list(self._state.jobs.items()):
            if ref in refs:
                fut.cancel()
        self._access.unbind(ref)
        if ref.engine_id not in self._registry.engines:
            self._access.drop_engine(EngineId(engine.engine_id, engine.epoch))
        keys: set[Hashable] = {worker.device.key}
        if worker.host is not None:
            keys.add(worker.host.key)
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def close() -> None:
            # Run by the executor as the last copy on this worker ends: the mappings go in
            # the same callback that takes the copy out of the in-flight count.
            worker.close()
            if not closed.done():
                closed.set_result(None)

        self._executor.when_idle(keys, close)
        try:
            await asyncio.wait_for(asyncio.shield(closed), self._config.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: copies still running at release; views keep them safe", ref.label())
        worker.close()  # idempotent
        log.info("released %s (%s)", ref.label(), why)

    def on_fd_close(self, conn: FdConnection) -> None:
        """Release the workers of an fd connection whose process exited (or closed it)."""
        for ref, worker in list(self._registry.workers.items()):
            if worker.fd_connection == conn.id:
                self._state.spawn(self.release(ref, f"fd channel closed (pid {conn.cred.pid})"))

    async def lease_loop(self) -> None:
        """Release the workers whose lease ran out, until cancelled."""
        period = min(1.0, self._config.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for ref, worker in list(self._registry.workers.items()):
                if worker.lease_deadline < now:
                    self._observability.lease_expired(ref.engine_id)
                    self._state.spawn(self.release(ref, "lease expired"))


def check_version(version: int) -> None:
    """Refuse a client that speaks another protocol version (``version_mismatch``)."""
    if version != PROTOCOL_VERSION:
        raise SidecarError(
            "version_mismatch",
            f"client speaks protocol {version}, this daemon speaks {PROTOCOL_VERSION}",
        )


def _check_identity(req: Register) -> None:
    ref = req.worker
    for rank, size, name in (
        (ref.tp_rank, req.tp_size, "tp"),
        (ref.pp_rank, req.pp_size, "pp"),
        (ref.dcp_rank, req.dcp_size, "dcp"),
    ):
        if size < 1 or not 0 <= rank < size:
            raise SidecarError("invalid_message", f"{name}_rank {rank} with {name}_size {size}")
    if not ref.engine_id:
        raise SidecarError("invalid_message", "engine_id must not be empty")
    require_distinct(
        [s.name for s in req.layers],
        empty="a registration needs at least one layer",
        repeated="layer names must be unique",
    )
    for spec in req.layers:
        try:
            layout.buffer_nbytes(spec.descriptor)
        except layout.LayoutError as exc:
            raise SidecarError("incompatible_buffers", f"layer {spec.name!r}: {exc}") from None
    first = req.layers[0].descriptor.num_blocks
    if any(s.descriptor.num_blocks != first for s in req.layers):
        raise SidecarError("incompatible_buffers", "every layer must have the same num_blocks")


def _close_opened(opening: asyncio.Future[list[MappedBuffer]]) -> None:
    """Close what a registration abandoned (cancelled) while its thread was still mapping."""
    if not opening.cancelled() and opening.exception() is None:
        for buf in opening.result():
            buf.close()


def daemon_capabilities() -> tuple[str, ...]:
    """Return what this daemon announces in `HelloReply.capabilities` (checked at start-up)."""
    found = ["cuda_events", "fd_tokens"]
    if torch.cuda.is_available():
        try:
            cuda_driver.driver()
        except HandleError as exc:
            log.info("no cuda_vmm: %s", exc)
        else:
            found.append("cuda_vmm")
    return tuple(sorted(found))


def _mirror_layers(req: Register, host_blocks: int) -> list[tuple[str, BufferDescriptor, int, int]]:
    """Each layer of a host mirror: name, descriptor, bytes, and its 4 KiB-aligned pitch."""
    out = []
    for spec in req.layers:
        desc = msgspec.structs.replace(spec.descriptor, num_blocks=host_blocks)
        nbytes = layout.buffer_nbytes(desc)
        # 4 KiB-aligned layer starts: dtype views need aligned storage, pages help copies.
        out.append((spec.name, desc, nbytes, -(-nbytes // 4096) * 4096))
    return out
