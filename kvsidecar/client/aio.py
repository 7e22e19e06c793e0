"""The asyncio client, `AsyncSidecarClient`: concurrent calls matched to replies by request id.

One typed method per command: build the call (`kvsidecar.client.requests`,
`kvsidecar.client.cache_requests`), await it on the client's transport
(`kvsidecar.client.aio_transport`: socket, reader callback, fd channel watch, reconnection,
heartbeat task), return its result. Import it from `kvsidecar.client`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import torch
import zmq.asyncio

from kvsidecar.client.aio_transport import _AsyncTransport
from kvsidecar.client.codec import Ids
from kvsidecar.client.common import _Registration
from kvsidecar.client.facade import _Facade
from kvsidecar.client.requests import BatchMove
from kvsidecar.core import layout
from kvsidecar.wire.batch import MovedBatch
from kvsidecar.wire.cache import CacheHits, CacheLoaded, CacheStored
from kvsidecar.wire.curve import KeyPair
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import (
    Collected,
    Fixed,
    HelloReply,
    Moved,
    Registered,
    Reported,
    StatusReply,
)
from kvsidecar.wire.pulls import Pulled
from kvsidecar.wire.reports import CacheEvents, PeerCompletion, TransferStats
from kvsidecar.wire.types import Arrangement, BufferSetRef, Medium, MemoryOrder, WorkerRef

__all__ = ["AsyncSidecarClient"]


class AsyncSidecarClient(_Facade):
    """asyncio client: ``async with AsyncSidecarClient(endpoint) as c:`` (or ``await c.start()``).

    Calls may run concurrently on one client; replies are matched to calls by request id. The
    constructor only prepares: `start` connects and says hello.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = 10.0,
        name: str = "",
        heartbeat: bool = True,
        context: zmq.asyncio.Context | None = None,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_s, name, curve)
        self._transport = _AsyncTransport(
            self._session, self._requests, heartbeat=heartbeat, context=context
        )
        # Bound once: every method ends in it.
        self._run = self._transport.run

    async def start(self) -> HelloReply:
        """Connect and say hello; returns the daemon's hello reply."""
        return await self._transport.start()

    async def close(self) -> None:
        """Stop heartbeats and the reader, close the fd channel and the socket. Idempotent."""
        await self._transport.close()

    async def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register; see `SidecarClient.reconnect`."""
        await self._transport.reconnect(timeout=timeout)

    async def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return await self._run(self._requests.hello(timeout))

    async def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        engine_id: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        model_hash: str = "",
        arrangement: Arrangement = "kv_first",
        memory_order: MemoryOrder | None = None,
        shape_order: layout.ShapeOrder = "NH",
        host_blocks: int = 0,
        timeout: float | None = None,
    ) -> Registered:
        """Register this worker's KV tensors; see `SidecarClient.register_kv_caches`."""
        reg = _Registration(
            dict(kv_caches),
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            model_hash=model_hash,
            arrangement=arrangement,
            memory_order=memory_order,
            shape_order=shape_order,
            host_blocks=host_blocks,
        )
        reply = await self._run(self._requests.register(reg, timeout))
        self._transport.keep_alive(reply.lease_s)
        return reply

    async def grant(
        self,
        grantee: str,
        *,
        read: bool = True,
        write: bool = False,
        owner: WorkerRef | None = None,
        timeout: float | None = None,
        grantee_user: str = "",
    ) -> None:
        """Let engine ``grantee`` use this engine's blocks; see `SidecarClient.grant`."""
        await self._run(
            self._requests.grant(grantee, owner, read, write, timeout, grantee_user=grantee_user)
        )

    async def unregister(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        await self._run(self._requests.unregister(worker, timeout))

    async def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now."""
        await self._run(self._requests.heartbeat(workers, timeout))

    async def host_alloc(
        self, engine_id: str, count: int, *, timeout: float | None = None
    ) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        return await self._run(self._requests.host_alloc(engine_id, count, timeout))

    async def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine."""
        await self._run(self._requests.host_free(engine_id, ids, timeout))

    async def move(
        self,
        src: BufferSetRef,
        dst: BufferSetRef,
        src_ids: Ids,
        dst_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks between buffer sets; see `SidecarClient.move`."""
        call = self._requests.move(
            src, dst, src_ids, dst_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

    async def move_batch(
        self,
        moves: Sequence[BatchMove],
        *,
        checksum: bool | None = None,
        timeout: float | None = None,
    ) -> MovedBatch:
        """Run many moves in one command (an engine step's requests): one round trip in all.

        Each `BatchMove` is what `move` takes; each is checked on its own: the reply holds one
        `MoveResult` per move, in order, with ``error_code`` set on those that failed (the
        others ran). The moves run in order, so a later move sees what an earlier one wrote.
        """
        return await self._run(self._requests.move_batch(moves, checksum, timeout))

    async def offload(
        self,
        worker: WorkerRef,
        device_ids: Ids,
        host_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy a worker's blocks into its host mirror."""
        src, dst = BufferSetRef(worker, "device"), BufferSetRef(worker, "host")
        call = self._requests.move(
            src, dst, device_ids, host_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

    async def onboard(
        self,
        worker: WorkerRef,
        host_ids: Ids,
        device_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks from a worker's host mirror into its KV cache."""
        src, dst = BufferSetRef(worker, "host"), BufferSetRef(worker, "device")
        call = self._requests.move(
            src, dst, host_ids, device_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return await self._run(call)

    async def fix_layout(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        *,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Fixed:
        """Rewrite blocks in place from the remote layout; see `SidecarClient.fix_layout`."""
        call = self._requests.fix_layout(
            target, block_ids, remote_memory_order, remote_block_size, layers, timeout=timeout
        )
        return await self._run(call)

    async def pull(
        self,
        engine_id: str,
        remote_endpoint: str,
        remote_engine_id: str,
        requests: Mapping[str, tuple[Ids, Ids]],
        *,
        tp_rank: int | None = None,
        pp_rank: int = 0,
        medium: Medium = "device",
        timeout_s: float = 0.0,
        remote_request_ids: Mapping[str, str] | None = None,
        plane: Literal["", "zmq", "nixl"] = "",
        timeout: float | None = None,
        prompt_digests: Mapping[str, str] | None = None,
    ) -> Pulled:
        """Pull requests' blocks from another node's daemon; see `SidecarClient.pull`."""
        call = self._requests.pull(
            engine_id,
            remote_endpoint,
            remote_engine_id,
            requests,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            medium=medium,
            timeout_s=timeout_s,
            remote_request_ids=remote_request_ids,
            plane=plane,
            timeout=timeout,
            prompt_digests=prompt_digests,
        )
        return await self._run(call)

    async def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Ids,
        *,
        lease_s: float = 0.0,
        timeout: float | None = None,
        prompt_digest: str = "",
    ) -> None:
        """Hold a request's blocks for remote readers; see `SidecarClient.publish`."""
        await self._run(
            self._requests.publish(
                engine_id,
                request_id,
                block_ids,
                lease_s=lease_s,
                timeout=timeout,
                prompt_digest=prompt_digest,
            )
        )

    async def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events; see `SidecarClient.take_peer_events`."""
        return await self._run(self._requests.take_peer_events(engine_id, timeout))

    async def report(
        self,
        step: int,
        *,
        finished_sending: Collection[str] = (),
        finished_recving: Collection[str] = (),
        invalid_block_ids: Collection[int] = (),
        failed_recving: Collection[str] = (),
        expected_finished_count: int = 0,
        kv_connector_stats: TransferStats | None = None,
        kv_cache_events: CacheEvents | None = None,
        worker: WorkerRef | None = None,
        epoch: int | None = None,
        timeout: float | None = None,
    ) -> Reported:
        """Report a worker's completions of one step; see `SidecarClient.report`."""
        call = self._requests.report(
            step,
            worker=worker,
            epoch=epoch,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids,
            failed_recving=failed_recving,
            expected_finished_count=expected_finished_count,
            kv_connector_stats=kv_connector_stats,
            kv_cache_events=kv_cache_events,
            timeout=timeout,
        )
        return await self._run(call)

    async def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions; see `SidecarClient.collect`."""
        return await self._run(self._requests.collect(engine_id, step, timeout_s, timeout))

    async def cache_lookup(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        *,
        tp_size: int = 1,
        pin_s: float = 0.0,
        timeout: float | None = None,
        loads: int = 1,
        disk_wait_s: float = 0.0,
    ) -> CacheHits:
        """Count the leading ``keys`` every rank of ``fingerprint`` holds (`CacheLookup`)."""
        call = self._cache_requests.cache_lookup(
            fingerprint, keys, tp_size, pin_s, timeout, loads=loads, disk_wait_s=disk_wait_s
        )
        return await self._run(call)

    async def cache_store(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        not_after: float = 0.0,
        capacity_bytes: int = 0,
        worker: WorkerRef | None = None,
        timeout: float | None = None,
    ) -> CacheStored:
        """Store blocks ``block_ids`` under ``keys`` in the worker's namespace (`CacheStore`)."""
        call = self._cache_requests.cache_store(
            fingerprint,
            keys,
            block_ids,
            worker=worker,
            not_after=not_after,
            capacity_bytes=capacity_bytes,
            timeout=timeout,
        )
        return await self._run(call)

    async def cache_load(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        pin_id: int = 0,
        worker: WorkerRef | None = None,
        timeout: float | None = None,
        not_after: float = 0.0,
    ) -> CacheLoaded:
        """Load the blocks of ``keys`` into ``block_ids`` (`CacheLoad`); see its missing ids."""
        call = self._cache_requests.cache_load(
            fingerprint,
            keys,
            block_ids,
            worker=worker,
            pin_id=pin_id,
            timeout=timeout,
            not_after=not_after,
        )
        return await self._run(call)

    async def take_worker_events(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the completion events credited to a worker (default: this client's; subscribes)."""
        return await self._run(self._cache_requests.take_worker_events(worker, timeout))

    async def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's state; see `SidecarClient.status`."""
        return await self._run(self._requests.status(timeout))

    async def __aenter__(self) -> AsyncSidecarClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
