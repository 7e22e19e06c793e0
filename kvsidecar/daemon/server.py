"""The daemon's lifecycle and its control socket: config -> startup -> serve -> shutdown.

Shaped like uvicorn's ``Server``: `Daemon.run` picks the event loop (uvloop when present) and
calls `Daemon.serve`, which is `Daemon.startup`, a wait on an `asyncio.Event` set by the first
SIGTERM/SIGINT, and `Daemon.shutdown`. A second signal skips the drain.

The event loop only does I/O and bookkeeping: requests are decoded and checked here, the copies
run on the `CopyExecutor`. Requests that finish without waiting (status, heartbeat, host
alloc/free, every validation error) are answered inline, in arrival order. Moves and fixes are
checked inline and their blocks claimed on the executor at once, so moves on the same blocks
apply in arrival order. The one exception is a CPU move of at most 128 KiB on blocks no job in
flight touches: it is copied right on the loop and answered from there, since the
copy takes less than the hand-off to a thread and back (`kvsidecar.daemon.jobs.INLINE_MAX_BYTES`).
A move that succeeds on a copy thread is answered from that thread (the socket is shared under
a lock): waking the loop first would add a thread hand-off to every move. The loop settles it
(counts, metrics, completions) before it reads any later request, and answers every other
outcome from the executor's completion callback (no task: on a 1-block move a task's loop
iterations cost as much as the copy). The rest (register, unregister, pulls) become tasks.

The parts live with their owners, each a mixin of `Daemon`: `kvsidecar.daemon.edge` (the
control socket: reading, checking and answering requests), `kvsidecar.daemon.registration` (hello,
register, unregister, heartbeat, grant; leases and the release of workers) and
`kvsidecar.daemon.commands` (moves, fixes, host alloc/free, status). This module keeps the
lifecycle and the dispatch of a checked request to its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvsidecar import __version__
from kvsidecar.daemon.cache.prefix import PrefixCache  # prefix cache
from kvsidecar.daemon.cache.worker_events import WorkerEvents
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.dispatch import Dispatch
from kvsidecar.daemon.gpu import check_cuda
from kvsidecar.daemon.limits.access import AccessControl  # security
from kvsidecar.daemon.limits.admission import Admission  # reliability
from kvsidecar.daemon.limits.connections import ConnectionCount
from kvsidecar.daemon.metrics.observability import Observability, readiness, snapshot
from kvsidecar.daemon.metrics.server import Readiness
from kvsidecar.daemon.metrics.state import StateSnapshot
from kvsidecar.daemon.registration import daemon_capabilities
from kvsidecar.daemon.runtime_dir import lock_runtime_dir, private_dir, refuse_if_running
from kvsidecar.daemon.sdnotify import Notifier, watchdog_loop
from kvsidecar.memory.fd_channel import FdChannelServer
from kvsidecar.memory.fd_limits import raise_fd_limit
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.node.auth import (
    CONTROL_DOMAIN,
    ZapHandler,
    close_zap_and_context,
    control_transport,
    secure_server_socket,
)
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.registry import Registry
from kvsidecar.node.replies import ReplyBudget
from kvsidecar.peer.service import PeerService  # peer
from kvsidecar.wire import zmqio
from kvsidecar.wire.protocol import (
    Envelope,
    Reply,
    Request,
)
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.daemon")


class Daemon(Dispatch):
    """One kvsidecar daemon. ``await startup()``; ``await shutdown()``; or `run` / `serve`.

    ``started`` is set once the sockets are bound and the pool is allocated (tests and the CLI
    wait on it). `request_exit` is what the signal handlers call.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = Registry()
        self.started = asyncio.Event()
        self.draining = False
        self.force_exit = False
        self._exit = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.Socket[Any] | None = None
        """The control ROUTER: a plain socket read from a loop reader (see `_recv_loop`)."""
        self._sock_lock = threading.Lock()
        """Held around every use of ``_sock``: copy threads send replies on it too (`ReplyTo`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd_server: FdChannelServer | None = None
        self._lock_fd: int | None = None
        """The runtime directory's lock (`lock_runtime_dir`), held while serving."""
        self._bound = False
        """True once the control socket is bound (shutdown removes an ipc path only then)."""
        self._pool: HostPool | None = None
        self._executor: CopyExecutor | None = None
        self.peer: PeerService | None = None
        """Node-to-node transfer (kvsidecar.peer); set during startup."""
        self.daemon_id = ""
        """This daemon's identity in hello replies (the peer service's); set during startup."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: list[asyncio.Task[Any]] = []
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._envelope = msgspec.msgpack.Decoder(Envelope)
        self._encoder = msgspec.msgpack.Encoder()
        self._notifier = Notifier.from_env()
        self._started_at = time.monotonic()
        self.moves_total = 0
        self.moves_failed_total = 0
        self.bytes_moved_total = 0
        self.errors_total = 0
        # --- completions and metrics ---
        self.completions = CompletionService()
        # --- prefix cache and connectors (kvsidecar/daemon/cache.py, worker_events.py) ---
        self.cache: PrefixCache | None = None
        """The node's shared prefix cache; set during startup."""
        self.worker_events = WorkerEvents(self.registry)
        """Completion events per subscribed worker (``take_worker_events``)."""
        """Per-engine completion aggregation (the ``report`` and ``collect`` commands)."""
        self.observability = Observability(config)
        """Metrics registry and the /metrics, /healthz, /readyz endpoint."""
        # --- reliability and security (kvsidecar/auth.py, access.py, admission.py) ---
        self.access = AccessControl(lookup=self.registry.engines.get)
        """Connection -> engine bindings and sharing grants."""
        self.admission = Admission(config.max_moves_per_worker, config.max_moves_total)
        self.reply_budget = ReplyBudget(config.max_reply_bytes)
        """Bytes of large replies waiting for their readers (`kvsidecar.daemon.replies`)."""
        self._connections: ConnectionCount | None = None
        self.zap: ZapHandler | None = None
        """Authenticates connections (peer uid on ipc, CURVE key on tcp); set in startup."""
        self.insecure_transport = False
        """True when the control endpoint is plain tcp (``insecure``); exported as a metric."""
        self.integrity_failures_total = 0
        """Moves whose end-to-end checksum found corrupted destination blocks."""
        # Epochs start at the start time in microseconds: unique across daemon restarts too.
        self._epochs = itertools.count(time.time_ns() // 1000)
        self._replies: set[asyncio.Future[Reply]] = set()
        """Replies of copy jobs not yet sent (shutdown sends them before closing the socket)."""
        self._jobs: dict[asyncio.Future[Any], frozenset[Hashable]] = {}
        """Pending copy jobs and the workers they touch (failed when one of them is released)."""

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Serve until a signal, on uvloop when configured and installed; blocks."""
        if self.config.use_uvloop:
            try:
                import uvloop
            except ImportError:
                log.info("uvloop is not installed; using the default asyncio loop")
            else:
                uvloop.run(self.serve())
                return
        asyncio.run(self.serve())

    async def serve(self) -> None:
        """Start, wait for a signal (or `request_exit`), then shut down gracefully."""
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        try:
            await self.startup()
            await self._exit.wait()
        finally:
            await self.shutdown()
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._exit.is_set():
            log.warning("second %s: forcing exit without draining", sig.name)
            self.request_exit(force=True)
        else:
            log.info("%s: draining and shutting down", sig.name)
            self.request_exit()

    def request_exit(self, *, force: bool = False) -> None:
        """Ask `serve` to return; ``force`` skips waiting for in-flight moves."""
        self.force_exit = self.force_exit or force
        self._exit.set()

    async def startup(self) -> None:
        """Create the runtime dir, allocate the pool, bind the sockets, start the lease sweeper."""
        cfg = self.config
        check_cuda(cfg.require_cuda)  # before anything is bound or allocated: fail fast
        private_dir(Path(cfg.runtime_dir))
        self._lock_fd = lock_runtime_dir(cfg.runtime_dir)
        refuse_if_running(cfg.fd_socket, cfg.ipc_path)
        if cfg.ipc_path is not None:
            # Only created, never re-moded: an ipc path outside runtime_dir is the admin's call.
            Path(cfg.ipc_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if cfg.host_pool_bytes > 0:
            # Allocated and touched up front: first touch is several times slower than a copy.
            self._pool = HostPool(cfg.host_pool_bytes)
        self.capabilities = daemon_capabilities()
        self._executor = CopyExecutor(cfg.copy_threads)
        # reliability: use the descriptors we may (a flood must not meet a low soft limit)
        before, after = raise_fd_limit()
        if after != before:
            log.info("open files limit raised from %d to %d", before, after)
        self._fd_server = FdChannelServer(
            cfg.fd_socket, on_close=self._on_fd_close, allowed_uids=cfg.uids, limits=cfg.fd_limits
        )
        await self._fd_server.start()
        self._bind_control()
        # --- peer: node-to-node transfer (peer endpoint, pulls, leases) ---
        self.peer = PeerService(cfg, self.registry, self._executor)
        self.daemon_id = self.peer.daemon_id
        await self.peer.start()
        # --- end peer ---
        # --- completions + metrics: peer outcomes feed the aggregation; endpoint bound last ---
        self.peer.on_completion = self._on_peer_completion
        self.cache = PrefixCache(cfg, self.registry, self._pool, self.observability.cache_metrics)
        await self.observability.start(self, self.readiness)
        # security: plain tcp (control or peer, `insecure`) shows as kvsidecar_insecure_transport
        peer_plain = bool(cfg.peer_endpoint) and not cfg.curve_secret_key
        self.insecure_transport = self.insecure_transport or peer_plain
        self.observability.metrics.set_insecure_transport(self.insecure_transport)
        self._started_at = time.monotonic()
        self._start_background()
        log.info(
            "kvsidecar %s serving on %s (fd channel %s)", __version__, cfg.endpoint, cfg.fd_socket
        )
        # What exists now (torch, numpy, sockets, settings) lives as long as the daemon: out of
        # the cyclic collector's way, whose full passes otherwise walk it all (a profile of a
        # 1 GiB pull found them at 12% of the consumer's and 45% of the producer's samples).
        gc.freeze()
        self.started.set()

    def _bind_control(self) -> None:
        """Start ZAP, then bind the control ROUTER behind it, with its connection limits."""
        cfg = self.config
        transport = control_transport(cfg)  # security: ConfigError on bad key files
        self.insecure_transport = transport.insecure
        self._ctx = zmq.asyncio.Context()
        self.zap = ZapHandler(self._ctx)
        self.zap.policies[CONTROL_DOMAIN] = transport.policy
        self.zap.start()  # before bind: the socket refuses connections nobody vouches for
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_server_socket(sock, domain=CONTROL_DOMAIN, keys=transport.keys)
        # Hard ceiling enforced by libzmq itself (the peer is disconnected); below it, oversize
        # requests get a typed too_large reply from `_on_message`.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * cfg.max_message_bytes)
        zmqio.bind_or_close(sock, cfg.endpoint, "control endpoint")
        self._bound = True  # from here on the ipc socket file is ours to remove
        if cfg.ipc_path is not None:
            os.chmod(cfg.ipc_path, 0o600)
        self._sock = sock
        # reliability: connections per peer and in total, decided by ZAP (daemon/connections.py)
        self._connections = ConnectionCount(
            sock, max_total=cfg.max_connections, max_per_peer=cfg.max_connections_per_peer
        )
        self.zap.admission[CONTROL_DOMAIN] = self._connections.admit

    def _start_background(self) -> None:
        """Start reading requests, sweeping leases and (under systemd) the watchdog; say READY."""
        self._loop = asyncio.get_running_loop()
        self._background = [
            asyncio.create_task(self._recv_loop(), name="kvsidecar-recv"),
            asyncio.create_task(self._lease_loop(), name="kvsidecar-leases"),
        ]
        self._notifier.ready(f"serving on {self.config.endpoint}")
        interval = self._notifier.watchdog_interval()
        if interval is not None:  # WatchdogSec=: pinged from the loop, so a stalled loop stops it
            self._background.append(
                asyncio.create_task(
                    watchdog_loop(
                        self._notifier, interval, healthy=self.observability.loop_healthy
                    ),
                    name="kvsidecar-watchdog",
                )
            )

    async def shutdown(self) -> None:
        """Stop accepting, drain in-flight moves (bounded), release every mapping, close sockets.

        Safe to call more than once and after a failed startup.
        """
        self.draining = True
        self._notifier.stopping()
        self._exit.set()
        if (
            self._executor is not None
            and not self.force_exit
            and not await self._executor.wait_idle(self.config.drain_timeout_s)
        ):
            log.warning("drain timeout: failing %d in-flight jobs", self._executor.in_flight)
        for task in list(self._tasks):
            task.cancel()
        for job in list(self._jobs):  # copy jobs still in flight after the drain
            job.cancel()
        if self._replies:  # their replies (and those of jobs that just finished) go out first
            await asyncio.wait(list(self._replies), timeout=1.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._background = []
        if self.peer is not None:  # peer: links and peer socket closed before mappings go
            await self.peer.close()
            self.peer = None
        for ref in list(self.registry.workers):
            worker = self.registry.remove(ref)
            if worker is not None:
                worker.close()
        if self._fd_server is not None:
            await self._fd_server.close()
            self._fd_server = None
        if self._connections is not None:
            await self._connections.close()
            self._connections = None
        with self._sock_lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
        await close_zap_and_context(self.zap, self._ctx)
        self.zap, self._ctx = None, None
        if self._executor is not None:
            # A copy still running after the drain is abandoned; its views keep its mapping alive.
            self._executor.shutdown(wait=not self.force_exit and self._executor.in_flight == 0)
            self._executor = None
        if self.cache is not None:  # prefix cache: its namespaces are host-pool extents
            self.cache.close()
            self.cache = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.config.ipc_path is not None and self._bound:
            # Only the socket this daemon bound: a refused start must not remove a live one's.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.ipc_path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        # Last: /readyz answers "draining" for as long as the drain above runs.
        self.completions.close()
        await self.observability.close()
        self._notifier.close()
        log.info("kvsidecar stopped")

    # ------------------------------------------------------------------ metrics and completions

    def metrics_state(self) -> StateSnapshot:
        """`kvsidecar.daemon.metrics_state.StateProvider`: live state, read at every scrape."""
        pool, executor = self._pool, self._executor
        return snapshot(
            self.registry,
            pool_capacity=0 if pool is None else pool.capacity_bytes,
            pool_used=0 if pool is None else pool.used_bytes,
            in_flight=0 if executor is None else executor.in_flight,
            pending=self.completions.pending_requests(),
            defences=self._defence_events(),
        )

    def _defence_events(self) -> dict[tuple[str, str], int]:
        """Count what the fd channel, the peer plane and the HTTP endpoint refused or dropped."""
        fd, peer, http = self._fd_server, self.peer, self.observability.server
        events = {} if fd is None else {("fd_channel", k): v for k, v in vars(fd.stats).items()}
        if peer is not None:
            events[("peer", "replies_dropped")] = peer.replies_dropped_total
            events[("peer", "unreadable")] = peer.unreadable_total
            events[("peer", "notifies_dropped")] = peer.producer.notifies_dropped_total
        if http is not None:
            events[("metrics", "evicted")] = http.evicted_total
        if self._connections is not None:
            events[("control", "refused_connections")] = self._connections.refused
        return events

    def readiness(self) -> Readiness:
        """`kvsidecar.daemon.metrics_server.HealthProvider`: what ``/readyz`` decides on."""
        return readiness(
            sockets_bound=self._sock is not None and self.started.is_set(),
            pool_needed=self.config.host_pool_bytes > 0,
            pool_allocated=self._pool is not None,
            draining=self.draining,
        )

    def _on_peer_completion(self, event: PeerCompletion) -> None:
        # Counted by the aggregation, and still queued for ``take_peer_events`` (observers).
        self.completions.on_peer_event(event)
        self.worker_events.on_peer_event(event)  # connectors that aggregate themselves
        if self.peer is not None:
            self.peer.completions.append(event)
