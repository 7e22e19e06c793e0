"""What an engine worker imports: `SidecarClient` (blocking) and `AsyncSidecarClient`.

Both speak the same protocol over a ZeroMQ DEALER socket, with typed methods for every command,
a per-call timeout, and `SidecarError` (carrying the wire error code) for every failure::

    from kvsidecar.client import SidecarClient

    with SidecarClient() as sidecar:                    # default endpoint of this user's daemon
        sidecar.register_kv_caches(kv_caches, engine_id="prefill", tp_rank=0, tp_size=2)
        ids = sidecar.host_alloc("prefill", 16)
        sidecar.offload(sidecar.worker, device_ids=[3, 4, 5], host_ids=ids[:3])

A registered client keeps its worker's lease with heartbeats (a background thread, or a task for
the async client) and keeps the fd channel open: closing the client, or the process dying, makes
the daemon release the worker's mappings.

The blocking client is not thread-safe: use one per thread (the heartbeat has its own socket).

Daemon restarts: a call in flight when the daemon dies fails at once with ``connection_lost``
(the fd channel closes); the next call, or the heartbeat, reconnects with backoff and registers
the same tensors again (new epochs), so an engine keeps running across a restart. For a tcp
endpoint with CurveZMQ pass ``curve=(daemon_public_key, client_key_pair)`` or set
``KVSIDECAR_SERVER_PUBLIC_KEY`` and ``KVSIDECAR_CLIENT_SECRET_KEY`` (see docs/reliability.md).
"""

from __future__ import annotations

# Each client is composed, in package-private modules with one owner each: a session
# (`kvsidecar.client.common`: what it knows of its daemon, reconnection), request builders without
# I/O (`kvsidecar.client.requests`, `kvsidecar.client.cache_requests`, over `calls`, `codec` and
# `export`), and a transport (`kvsidecar.client.sync_transport`, `kvsidecar.client.aio_transport`:
# how calls travel). `kvsidecar.client.facade` holds what both share; the typed public methods
# are in `kvsidecar.client.sync` and `kvsidecar.client.aio`, kept in step by a test
# (tests/client/test_parity.py).
from kvsidecar.client.aio import AsyncSidecarClient
from kvsidecar.client.codec import Ids
from kvsidecar.client.export import export_layers
from kvsidecar.client.requests import BatchMove
from kvsidecar.client.sync import Pending, SidecarClient
from kvsidecar.wire.endpoints import default_endpoint
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.types import BufferSetRef, WorkerRef

__all__ = [
    "AsyncSidecarClient",
    "BatchMove",
    "BufferSetRef",
    "Ids",
    "Pending",
    "SidecarClient",
    "SidecarError",
    "WorkerRef",
    "default_endpoint",
    "export_layers",
]
