"""The daemon's lifecycle: config -> startup -> serve -> shutdown, and the services it composes.

Shaped like uvicorn's ``Server``: `Daemon.run` picks the event loop (uvloop when present) and
calls `Daemon.serve`, which is `Daemon.startup`, a wait on an `asyncio.Event` set by the first
SIGTERM/SIGINT, and `Daemon.shutdown`. A second signal skips the drain.

`startup` allocates the host pool and the `CopyExecutor`, binds the fd channel, the control
socket (`kvsidecar.daemon.control.ControlSocket`) and the peer endpoint, then builds the request
handlers with the state each needs, as uvicorn hands ``config`` and ``server_state`` to its
protocol objects: `kvsidecar.daemon.registration.Registrations`, `kvsidecar.daemon.moves.Moves`
(over a `kvsidecar.daemon.runner.JobRunner`), `kvsidecar.daemon.cache.commands.CacheCommands`,
the `CompletionService` and the `PeerService`, routed by `kvsidecar.daemon.dispatch.Router`.

The event loop only does I/O and bookkeeping: requests are decoded and checked on it, the copies
run on the executor, except short CPU moves on blocks no job in flight touches, which are copied
on the loop since the copy takes less than the hand-off to a thread and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from pathlib import Path
from typing import Any

from kvsidecar import __version__
from kvsidecar.daemon.cache.commands import CacheCommands
from kvsidecar.daemon.cache.disk import DiskTier
from kvsidecar.daemon.cache.prefix import PrefixCache
from kvsidecar.daemon.cache.tiering import TieredCache
from kvsidecar.daemon.cache.worker_events import WorkerEvents
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.control import ControlSocket
from kvsidecar.daemon.dispatch import Router
from kvsidecar.daemon.gpu import check_cuda
from kvsidecar.daemon.limits.access import AccessControl
from kvsidecar.daemon.limits.admission import Admission
from kvsidecar.daemon.metrics.observability import Observability, readiness, snapshot
from kvsidecar.daemon.metrics.server import Readiness
from kvsidecar.daemon.metrics.state import StateSnapshot
from kvsidecar.daemon.metrics.tiers import TierState
from kvsidecar.daemon.moves import Moves
from kvsidecar.daemon.registration import Registrations
from kvsidecar.daemon.runner import JobRunner
from kvsidecar.daemon.runtime_dir import (
    allocate_pool,
    claim_runtime_dir,
    make_parent,
    refuse_if_running,
)
from kvsidecar.daemon.sdnotify import Notifier, watchdog_loop
from kvsidecar.daemon.state import DaemonState, MoveTotals
from kvsidecar.memory.fd_channel import FdChannelServer, FdConnection
from kvsidecar.memory.fd_limits import raise_fd_limit
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.node.auth import ZapHandler
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.identity import mint_daemon_id
from kvsidecar.node.registry import Registry
from kvsidecar.node.replies import ReplyBudget
from kvsidecar.peer.service import PeerService
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.daemon")


class Daemon:
    """One kvsidecar daemon. ``await startup()``; ``await shutdown()``; or `run` / `serve`.

    ``started`` is set once the sockets are bound and the pool is allocated (tests and the CLI
    wait on it). `request_exit` is what the signal handlers call.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = Registry()
        self.state = DaemonState()
        self.totals = MoveTotals()
        self.started = asyncio.Event()
        self.force_exit = False
        self._exit = asyncio.Event()
        self._lock_fd: int | None = None
        """The runtime directory's lock (`claim_runtime_dir`), held while serving."""
        self._notifier = Notifier.from_env()
        self._background: list[asyncio.Task[Any]] = []
        self.completions = CompletionService()
        """Per-engine completion aggregation (the ``report`` and ``collect`` commands)."""
        self.worker_events = WorkerEvents(self.registry)
        """Completion events per subscribed worker (``take_worker_events``)."""
        self.observability = Observability(config)
        """Metrics registry and the /metrics, /healthz, /readyz endpoint."""
        self.access = AccessControl(lookup=self.registry.engines.get)
        """Connection -> engine bindings and sharing grants."""
        self.admission = Admission(
            config.max_moves_per_worker, config.max_moves_total, users=config.users
        )
        self.reply_budget = ReplyBudget(config.max_reply_bytes, users=config.users)
        """Bytes of large replies waiting for their readers (`kvsidecar.node.replies`)."""
        # Made by `startup`, in this order; None before it and after `shutdown`.
        self.pool: HostPool | None = None
        self.executor: CopyExecutor | None = None
        self.fd_server: FdChannelServer | None = None
        self.control: ControlSocket | None = None
        self.peer: PeerService | None = None
        """Node-to-node transfer (kvsidecar.peer)."""
        self.cache: PrefixCache | None = None
        """The node's shared prefix cache."""
        self.disk: DiskTier | None = None
        """The prefix cache's disk tier (``cache_dir``), below the host pool."""
        self.registrations: Registrations | None = None
        self.moves: Moves | None = None
        self.router: Router | None = None
        self.daemon_id = ""
        """This daemon's identity, minted at startup: hello replies and peer handshakes carry it."""

    @property
    def zap(self) -> ZapHandler | None:
        """The control socket's ZAP handler (None when not bound)."""
        return None if self.control is None else self.control.zap

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
        """Create the runtime dir, allocate the pool, bind the sockets, build the handlers."""
        cfg = self.config
        check_cuda(cfg.require_cuda)  # before anything is bound or allocated: fail fast
        self._lock_fd = claim_runtime_dir(Path(cfg.runtime_dir))
        refuse_if_running(cfg.fd_socket, cfg.ipc_path)
        if cfg.ipc_path is not None:
            # Only created, never re-moded: an ipc path outside runtime_dir is the admin's call.
            make_parent(cfg.ipc_path, "endpoint")
        make_parent(cfg.fd_socket, "fd_socket")
        self.pool = allocate_pool(cfg.host_pool_bytes)
        executor = self.executor = CopyExecutor(cfg.copy_threads)
        # Use the descriptors we may: a flood must not meet a low soft limit.
        before, after = raise_fd_limit()
        if after != before:
            log.info("open files limit raised from %d to %d", before, after)
        self.fd_server = FdChannelServer(
            cfg.fd_socket, on_close=self._on_fd_close, allowed_uids=cfg.uids, limits=cfg.fd_limits
        )
        await self.fd_server.start()
        control = self.control = ControlSocket(
            cfg,
            access=self.access,
            observability=self.observability,
            reply_budget=self.reply_budget,
            executor=executor,
            state=self.state,
        )
        control.bind()
        self.daemon_id = mint_daemon_id()
        peer = self.peer = PeerService(
            cfg,
            self.registry,
            executor,
            daemon_id=self.daemon_id,
            on_completion=self._on_peer_completion,
        )
        await peer.start()
        self.cache = PrefixCache(cfg, self.registry, self.pool, self.observability.cache_metrics)
        if cfg.disk_tier:
            # Its previous spaces are found before the first request: a lookup sees them all.
            self.disk = DiskTier(cfg)
            await self.disk.start()
        self._build_handlers(executor, control, peer, self.cache, self.fd_server)
        await self.observability.start(self, self.readiness)
        # Plain tcp (control or peer, `insecure`) shows as kvsidecar_insecure_transport.
        peer_plain = bool(cfg.peer_endpoint) and not cfg.curve_secret_key
        self.observability.metrics.set_insecure_transport(control.insecure or peer_plain)
        self._start_background()
        log.info(
            "kvsidecar %s serving on %s (fd channel %s)", __version__, cfg.endpoint, cfg.fd_socket
        )
        # What exists now (torch, numpy, sockets, settings) lives as long as the daemon: out of
        # the cyclic collector's way, whose full passes would otherwise walk it all.
        gc.freeze()
        self.started.set()

    def _build_handlers(
        self,
        executor: CopyExecutor,
        control: ControlSocket,
        peer: PeerService,
        cache: PrefixCache,
        fd_server: FdChannelServer,
    ) -> None:
        cfg, registry, state = self.config, self.registry, self.state
        runner = JobRunner(registry, executor, self.admission, state, self.totals)
        self.registrations = Registrations(
            cfg,
            registry,
            completions=self.completions,
            observability=self.observability,
            access=self.access,
            executor=executor,
            pool=self.pool,
            fd_server=fd_server,
            state=state,
            daemon_id=self.daemon_id,
        )
        self.moves = Moves(
            cfg,
            registry,
            executor=executor,
            runner=runner,
            totals=self.totals,
            observability=self.observability,
            completions=self.completions,
        )
        self.router = Router(
            cfg,
            registry,
            state=state,
            totals=self.totals,
            control=control,
            executor=executor,
            pool=self.pool,
            access=self.access,
            observability=self.observability,
            completions=self.completions,
            worker_events=self.worker_events,
            registrations=self.registrations,
            moves=self.moves,
            cache=CacheCommands(cfg, cache, registry, runner, self.moves, tiers=self._tiers(cache)),
            peer=peer,
        )

    def _tiers(self, cache: PrefixCache) -> TieredCache | None:
        """Define the tiers' metrics; join the disk tier (if any) to the pool's namespaces."""
        disk = self.disk

        def states() -> list[TierState]:
            mem = cache.state()
            tiers = [
                TierState(
                    "CPU", True, mem.capacity_bytes, mem.used_bytes, mem.blocks, mem.namespaces
                )
            ]
            return tiers if disk is None else [*tiers, disk.state()]

        metrics = self.observability.tier_metrics(states)
        if disk is None:
            return None
        disk.metrics = metrics
        return TieredCache(
            cache, disk, admit_all=self.config.cache_disk_admit == "all", metrics=metrics
        )

    def _start_background(self) -> None:
        """Start reading requests, sweeping leases and (under systemd) the watchdog; say READY."""
        assert self.control is not None and self.router is not None
        assert self.registrations is not None
        self._background = [
            asyncio.create_task(self.control.serve(self.router.dispatch), name="kvsidecar-recv"),
            asyncio.create_task(self.registrations.lease_loop(), name="kvsidecar-leases"),
        ]
        if self.cache is not None:
            self._background.append(
                asyncio.create_task(self.cache.pin_sweep_loop(), name="kvsidecar-pins")
            )
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
        state = self.state
        state.draining = True
        self._notifier.stopping()
        self._exit.set()
        executor = self.executor
        if (
            executor is not None
            and not self.force_exit
            and not await executor.wait_idle(self.config.drain_timeout_s)
        ):
            log.warning("drain timeout: failing %d in-flight jobs", executor.in_flight)
        for task in list(state.tasks):
            task.cancel()
        for job in list(state.jobs):  # copy jobs still in flight after the drain
            job.cancel()
        if state.replies:  # their replies (and those of jobs that just finished) go out first
            await asyncio.wait(list(state.replies), timeout=1.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*state.tasks, *self._background, return_exceptions=True)
        self._background = []
        if self.peer is not None:  # links and the peer socket closed before the mappings go
            await self.peer.close()
            self.peer = None
        for ref in list(self.registry.workers):
            worker = self.registry.remove(ref)
            if worker is not None:
                worker.close()
        if self.fd_server is not None:
            await self.fd_server.close()
            self.fd_server = None
        bound = self.control is not None and self.control.bound
        if self.control is not None:
            await self.control.close()
        if executor is not None:
            # A copy still running after the drain is abandoned; its views keep its mapping alive.
            executor.shutdown(wait=not self.force_exit and executor.in_flight == 0)
            self.executor = None
        if self.disk is not None:  # its writes read the cache's memory: they end first
            if not await self.disk.drain(self.config.drain_timeout_s):
                log.warning("drain timeout: disk tier I/O still in flight")
            self.disk.close()
            self.disk = None
        if self.cache is not None:  # its namespaces are host-pool extents
            self.cache.close()
            self.cache = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.config.ipc_path is not None and bound:
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
        if self.started.is_set():  # a start refused has said why, and nothing more
            log.info("kvsidecar stopped")

    def _on_fd_close(self, conn: FdConnection) -> None:
        if self.registrations is not None:
            self.registrations.on_fd_close(conn)

    def metrics_state(self) -> StateSnapshot:
        """`kvsidecar.daemon.metrics.state.StateProvider`: live state, read at every scrape."""
        pool, executor = self.pool, self.executor
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
        fd, peer, http = self.fd_server, self.peer, self.observability.server
        events = {} if fd is None else {("fd_channel", k): v for k, v in vars(fd.stats).items()}
        if peer is not None:
            events[("peer", "replies_dropped")] = peer.replies_dropped_total
            events[("peer", "unreadable")] = peer.unreadable_total
            events[("peer", "notifies_dropped")] = peer.producer.notifies_dropped_total
            events[("peer", "publishes_refused")] = peer.producer.publishes_refused_total
            events[("peer", "links_evicted")] = peer.links.evicted_total
            events[("peer", "links_refused")] = peer.links.refused_total
            events[("peer", "links_passing")] = peer.links.passing_total
        if http is not None:
            events[("metrics", "evicted")] = http.evicted_total
        connections = None if self.control is None else self.control.connections
        if connections is not None:
            events[("control", "refused_connections")] = connections.refused
        return events

    def readiness(self) -> Readiness:
        """`kvsidecar.daemon.metrics.server.HealthProvider`: what ``/readyz`` decides on."""
        return readiness(
            sockets_bound=self.control is not None
            and self.control.is_open
            and self.started.is_set(),
            pool_needed=self.config.host_pool_bytes > 0,
            pool_allocated=self.pool is not None,
            draining=self.state.draining,
        )

    def _on_peer_completion(self, event: PeerCompletion) -> None:
        # Counted by the aggregation; the peer service queues it for ``take_peer_events`` itself.
        self.completions.on_peer_event(event)
        self.worker_events.on_peer_event(event)  # connectors that aggregate themselves
