"""The blocking client, `SidecarClient`: one socket, calls in turn, a heartbeat thread.

One typed method per command: build the call (`kvsidecar.client.requests`,
`kvsidecar.client.cache_requests`), run it on the client's transport
(`kvsidecar.client.sync_transport`: socket, submitted calls, reconnection, heartbeat thread),
return its result. Import it from `kvsidecar.client`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import torch
import zmq

from kvsidecar.client.codec import Ids
from kvsidecar.client.common import _Registration
from kvsidecar.client.facade import _Facade
from kvsidecar.client.requests import BatchMove
from kvsidecar.client.sync_transport import Pending, _BlockingTransport
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

__all__ = ["Pending", "SidecarClient"]


class SidecarClient(_Facade):
    """Blocking client. Connects and says hello in the constructor; use as a context manager.

    ``timeout_s`` bounds every call (override per call with ``timeout=``); a call that times out
    raises `SidecarError` with code ``timeout`` and its late reply is discarded. ``heartbeat``:
    renew the leases of registered workers from a background thread.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = 10.0,
        name: str = "",
        heartbeat: bool = True,
        context: zmq.Context[Any] | None = None,
        curve: tuple[bytes, KeyPair] | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_s, name, curve)
        self._transport = _BlockingTransport(
            self._session, self._requests, heartbeat=heartbeat, context=context
        )
        # Bound once: every method ends in one of them.
        self._run = self._transport.run
        self._submit = self._transport.submit
        self._transport.start()

    def close(self) -> None:
        """Stop the heartbeat, close the fd channel and the socket. Idempotent.

        Closing the fd channel makes the daemon release the workers registered through it.
        """
        self._transport.close()

    def reconnect(self, *, timeout: float | None = None) -> None:
        """Reconnect to a restarted daemon and re-register every worker registered here.

        Retries with exponential backoff (50 ms doubling to 2 s) for up to ``timeout`` seconds
        (default: the client's ``timeout_s``); raises `SidecarError` ``connection_lost`` if the
        daemon does not come back in time (the next call tries again). The tensors stay where
        they are: they are exported again, with new epochs. Calls lock out meanwhile.
        """
        self._transport.reconnect(timeout=timeout)

    def hello(self, *, timeout: float | None = None) -> HelloReply:
        """Check protocol versions and learn the daemon's fd socket, lease and limits."""
        return self._run(self._requests.hello(timeout))

    def register_kv_caches(
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
        """Register this worker's KV tensors (layer name -> tensor) with the daemon.

        Each tensor is described from its shape and strides (``arrangement`` says which dims are
        which; ``memory_order`` is checked when given) and exported by handle, never copied.
        ``host_blocks`` declares the engine's host-pool capacity (first worker of the engine).
        """
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
        reply = self._run(self._requests.register(reg, timeout))
        self._transport.keep_alive(reply.lease_s)
        return reply

    def grant(
        self,
        grantee: str,
        *,
        read: bool = True,
        write: bool = False,
        owner: WorkerRef | None = None,
        timeout: float | None = None,
        grantee_user: str = "",
    ) -> None:
        """Let engine ``grantee`` read and/or write this engine's blocks (see `Grant`).

        ``owner``: the registered worker whose engine grants (default: this client's worker).
        ``read=False, write=False`` revokes. ``grantee_user`` (``uid:<n>``): the user whose
        engine of that name is meant, when it is not the granting engine's own.
        """
        self._run(
            self._requests.grant(grantee, owner, read, write, timeout, grantee_user=grantee_user)
        )

    def unregister(self, worker: WorkerRef | None = None, *, timeout: float | None = None) -> None:
        """Release a worker's mappings and host mirror (default: this client's worker)."""
        self._run(self._requests.unregister(worker, timeout))

    def heartbeat(
        self, workers: Sequence[WorkerRef] | None = None, *, timeout: float | None = None
    ) -> None:
        """Renew leases now (the background heartbeat does this on its own)."""
        self._run(self._requests.heartbeat(workers, timeout))

    def host_alloc(self, engine_id: str, count: int, *, timeout: float | None = None) -> IdArray:
        """Allocate ``count`` host-pool block ids of an engine (all or nothing)."""
        return self._run(self._requests.host_alloc(engine_id, count, timeout))

    def host_free(self, engine_id: str, ids: Ids, *, timeout: float | None = None) -> None:
        """Free host-pool block ids of an engine (all checked first: nothing freed on error)."""
        self._run(self._requests.host_free(engine_id, ids, timeout))

    def move(
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
        """Copy blocks ``src_ids`` of ``src`` into ``dst_ids`` of ``dst`` (see `Move`).

        ``request_ids``: the engine requests these blocks belong to; the daemon reports them as
        finished sending (device source) / receiving (device destination) for the workers.
        """
        call = self._requests.move(
            src, dst, src_ids, dst_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

    def move_batch(
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
        return self._run(self._requests.move_batch(moves, checksum, timeout))

    def offload(
        self,
        worker: WorkerRef,
        device_ids: Ids,
        host_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy a worker's blocks into its host mirror (device -> host)."""
        src, dst = BufferSetRef(worker, "device"), BufferSetRef(worker, "host")
        call = self._requests.move(
            src, dst, device_ids, host_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

    def onboard(
        self,
        worker: WorkerRef,
        host_ids: Ids,
        device_ids: Ids,
        *,
        layers: list[str] | None = None,
        request_ids: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Moved:
        """Copy blocks from a worker's host mirror back into its KV cache (host -> device)."""
        src, dst = BufferSetRef(worker, "host"), BufferSetRef(worker, "device")
        call = self._requests.move(
            src, dst, host_ids, device_ids, layers, request_ids=request_ids, timeout=timeout
        )
        return self._run(call)

    def fix_layout(
        self,
        target: BufferSetRef | WorkerRef,
        block_ids: Ids,
        *,
        remote_memory_order: MemoryOrder,
        remote_block_size: int,
        layers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Fixed:
        """Rewrite blocks that a raw copy filled in another layout into the registered one."""
        call = self._requests.fix_layout(
            target, block_ids, remote_memory_order, remote_block_size, layers, timeout=timeout
        )
        return self._run(call)

    def pull(
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
        """Pull requests' blocks from another node's daemon: ``{request_id: (remote, local)}``.

        ``remote_endpoint`` is the remote daemon's ``peer_endpoint``; ``tp_rank`` None pulls for
        every rank of the engine. Returns when every request is received or failed (`Pulled`);
        ``timeout_s`` bounds it on the daemon (0: its ``peer_pull_timeout_s``). An incompatible
        peer raises `SidecarError` ``incompatible_peer`` naming the mismatch.
        """
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
        return self._run(call)

    def publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Ids,
        *,
        lease_s: float = 0.0,
        timeout: float | None = None,
        prompt_digest: str = "",
    ) -> None:
        """Hold a request's blocks for remote readers (producer side; see `Publish`)."""
        self._run(
            self._requests.publish(
                engine_id,
                request_id,
                block_ids,
                lease_s=lease_s,
                timeout=timeout,
                prompt_digest=prompt_digest,
            )
        )

    def take_peer_events(
        self, engine_id: str = "", *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the queued peer completion events (finished/failed sending and receiving)."""
        return self._run(self._requests.take_peer_events(engine_id, timeout))

    def report(
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
        """Report a worker's completions of engine step ``step`` (see `Report`).

        ``worker`` defaults to this client's worker and ``epoch`` to its registration's. Safe to
        retry: a copy of a counted report is acknowledged as a duplicate. ``step_collected``
        means the scheduler has collected that step: send the same content with the next step.
        """
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
        return self._run(call)

    def collect(
        self, engine_id: str, step: int, *, timeout_s: float = 1.0, timeout: float | None = None
    ) -> Collected:
        """Collect the engine's aggregated completions up to ``step`` (the scheduler's call).

        Waits up to ``timeout_s`` for every live worker's report of the step (see `Collect`);
        ``.output`` is the `AggregatedOutput`. Collecting the same step again returns the same
        answer, so a retry loses nothing.
        """
        return self._run(self._requests.collect(engine_id, step, timeout_s, timeout))

    def cache_lookup(
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
        """Count (and with ``pin_s`` > 0 pin) the leading ``keys`` held (`CacheLookup`)."""
        call = self._cache_requests.cache_lookup(
            fingerprint, keys, tp_size, pin_s, timeout, loads=loads, disk_wait_s=disk_wait_s
        )
        return self._run(call)

    def submit_cache_lookup(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        *,
        tp_size: int = 1,
        pin_s: float = 0.0,
        timeout: float | None = None,
        loads: int = 1,
        disk_wait_s: float = 0.0,
    ) -> Pending[CacheHits]:
        """Start a `cache_lookup` and return at once."""
        call = self._cache_requests.cache_lookup(
            fingerprint, keys, tp_size, pin_s, timeout, loads=loads, disk_wait_s=disk_wait_s
        )
        return self._submit(call)

    def submit_cache_store(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        not_after: float = 0.0,
        capacity_bytes: int = 0,
        worker: WorkerRef | None = None,
        timeout: float | None = None,
    ) -> Pending[CacheStored]:
        """Start storing blocks ``block_ids`` under ``keys`` (`CacheStore`); returns at once.

        ``not_after``: ``time.monotonic()`` after which the caller may overwrite the blocks;
        a copy that ends later is thrown away. ``capacity_bytes``: the namespace's size if this
        store creates it (0: the daemon's share).
        """
        call = self._cache_requests.cache_store(
            fingerprint,
            keys,
            block_ids,
            worker=worker,
            not_after=not_after,
            capacity_bytes=capacity_bytes,
            timeout=timeout,
        )
        return self._submit(call)

    def submit_cache_load(
        self,
        fingerprint: str,
        keys: Sequence[bytes],
        block_ids: Ids,
        *,
        pin_id: int = 0,
        worker: WorkerRef | None = None,
        timeout: float | None = None,
        not_after: float = 0.0,
    ) -> Pending[CacheLoaded]:
        """Start loading the blocks of ``keys`` into ``block_ids`` (`CacheLoad`); returns at once.

        The result's ``missing_block_ids`` were not loaded (not held): recompute them.
        ``not_after``: ``time.monotonic()`` after which the copy must not start (the caller has
        given up waiting and may reuse the blocks).
        """
        call = self._cache_requests.cache_load(
            fingerprint,
            keys,
            block_ids,
            worker=worker,
            pin_id=pin_id,
            timeout=timeout,
            not_after=not_after,
        )
        return self._submit(call)

    def submit_pull(
        self,
        engine_id: str,
        remote_endpoint: str,
        remote_engine_id: str,
        requests: Mapping[str, tuple[Ids, Ids]],
        *,
        tp_rank: int | None = None,
        timeout_s: float = 0.0,
        remote_request_ids: Mapping[str, str] | None = None,
        plane: Literal["", "zmq", "nixl"] = "",
        timeout: float | None = None,
        prompt_digests: Mapping[str, str] | None = None,
    ) -> Pending[Pulled]:
        """Start a `pull` and return at once (``remote_endpoint`` "": from this node's daemon)."""
        call = self._requests.pull(
            engine_id,
            remote_endpoint,
            remote_engine_id,
            requests,
            tp_rank=tp_rank,
            pp_rank=0,
            medium="device",
            timeout_s=timeout_s,
            remote_request_ids=remote_request_ids,
            plane=plane,
            timeout=timeout,
            prompt_digests=prompt_digests,
        )
        return self._submit(call)

    def take_worker_events(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> list[PeerCompletion]:
        """Take the completion events credited to a worker (default: this client's; subscribes)."""
        return self._run(self._cache_requests.take_worker_events(worker, timeout))

    def submit_take_worker_events(
        self, worker: WorkerRef | None = None, *, timeout: float | None = None
    ) -> Pending[list[PeerCompletion]]:
        """Start a `take_worker_events` and return at once."""
        return self._submit(self._cache_requests.take_worker_events(worker, timeout))

    def submit_publish(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Ids,
        *,
        lease_s: float = 0.0,
        timeout: float | None = None,
        prompt_digest: str = "",
    ) -> Pending[None]:
        """Start a `publish` and return at once."""
        call = self._requests.publish(
            engine_id,
            request_id,
            block_ids,
            lease_s=lease_s,
            timeout=timeout,
            prompt_digest=prompt_digest,
        )
        return self._submit(call)

    def status(self, *, timeout: float | None = None) -> StatusReply:
        """Return the daemon's engines, workers, buffers, host pool, in-flight moves and totals."""
        return self._run(self._requests.status(timeout))

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
