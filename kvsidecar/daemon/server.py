"""The daemon's lifecycle and its control socket: config -> startup -> serve -> shutdown.

Shaped like uvicorn's ``Server``: `Daemon.run` picks the event loop (uvloop when present) and
calls `Daemon.serve`, which is `Daemon.startup`, a wait on an `asyncio.Event` set by the first
SIGTERM/SIGINT, and `Daemon.shutdown`. A second signal skips the drain.

The event loop only does I/O and bookkeeping: requests are decoded and checked here, the copies
run on the `CopyExecutor`. Requests that finish without waiting (status, heartbeat, host
alloc/free, every validation error) are answered inline, in arrival order. Moves and fixes are
checked inline and their blocks claimed on the executor at once, so moves on the same blocks
apply in arrival order. A move that succeeds is answered from the copy thread that ran it (the
socket is shared under a lock): waking the loop first would add a thread hand-off to every
short move. The loop settles it (counts, metrics, completions) before it reads any later request,
and answers every other outcome from the executor's completion callback (no task: on a 1-block
move a task's loop iterations cost as much as the copy). The rest (register, unregister, pulls)
become tasks.

The parts live with their owners, each a mixin of `Daemon`: `kvsidecar.daemon.edge` (the
control socket: reading, checking and answering requests), `kvsidecar.daemon.registration` (hello,
register, unregister, heartbeat, grant; leases and the release of workers) and
`kvsidecar.daemon.commands` (moves, fixes, host alloc/free, status). This module keeps the
lifecycle and the dispatch of a checked request to its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Coroutine, Hashable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvsidecar import __version__
from kvsidecar.daemon.access import AccessControl  # security
from kvsidecar.daemon.admission import Admission  # reliability
from kvsidecar.daemon.auth import (
    CONTROL_DOMAIN,
    ZapHandler,
    close_zap_and_context,
    control_transport,
    secure_server_socket,
)
from kvsidecar.daemon.cache import PrefixCache  # prefix cache
from kvsidecar.daemon.cache_commands import CacheCommands
from kvsidecar.daemon.completions import CompletionService
from kvsidecar.daemon.config import Config
from kvsidecar.daemon.edge import Dispatched, Edge, ReplyTo
from kvsidecar.daemon.executor import CopyExecutor
from kvsidecar.daemon.jobs import prepare_fix
from kvsidecar.daemon.metrics import MoveKind
from kvsidecar.daemon.metrics_server import Readiness
from kvsidecar.daemon.metrics_state import StateSnapshot
from kvsidecar.daemon.observability import Observability, readiness, snapshot
from kvsidecar.daemon.registration import Registration, _check_version
from kvsidecar.daemon.registry import Registry, check_epoch
from kvsidecar.daemon.sdnotify import Notifier, watchdog_loop
from kvsidecar.daemon.worker_events import WorkerEvents
from kvsidecar.memory.fd_channel import FdChannelServer
from kvsidecar.memory.host_pool import HostPool
from kvsidecar.peer.service import PeerService  # peer
from kvsidecar.wire.cache import CacheLoad, CacheLookup, CacheStore, TakeWorkerEvents
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import (
    Collect,
    Envelope,
    FixLayout,
    Grant,
    Heartbeat,
    Hello,
    HostAlloc,
    HostFree,
    Move,
    PeerEvents,
    Publish,
    Pull,
    Pulled,
    Register,
    Reply,
    Report,
    Request,
    Status,
    TakePeerEvents,
    Unregister,
)
from kvsidecar.wire.reports import PeerCompletion

log = logging.getLogger("kvsidecar.daemon")


class Daemon(Edge, Registration, CacheCommands):
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
        # --- completions + metrics (issue 4: kvsidecar/completions.py, observability.py) ---
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
        self.access = AccessControl(exists=self.registry.engines.__contains__)
        """Connection -> engine bindings and sharing grants."""
        self.admission = Admission(config.max_moves_per_worker, config.max_moves_total)
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
        _private_dir(Path(cfg.runtime_dir))
        _refuse_if_running(cfg.fd_socket)
        if cfg.ipc_path is not None:
            # Only created, never re-moded: an ipc path outside runtime_dir is the admin's call.
            Path(cfg.ipc_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if cfg.host_pool_bytes > 0:
            # Allocated and touched up front: first touch is several times slower than a copy.
            self._pool = HostPool(cfg.host_pool_bytes)
        self._executor = CopyExecutor(cfg.copy_threads)
        self._fd_server = FdChannelServer(
            cfg.fd_socket, on_close=self._on_fd_close, allowed_uids=cfg.uids
        )
        await self._fd_server.start()
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
        sock.bind(cfg.endpoint)
        if cfg.ipc_path is not None:
            os.chmod(cfg.ipc_path, 0o600)
        self._sock = sock
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
        self._loop = asyncio.get_running_loop()
        self._background = [
            asyncio.create_task(self._recv_loop(), name="kvsidecar-recv"),
            asyncio.create_task(self._lease_loop(), name="kvsidecar-leases"),
        ]
        self._notifier.ready(f"serving on {cfg.endpoint}")
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
        log.info(
            "kvsidecar %s serving on %s (fd channel %s)", __version__, cfg.endpoint, cfg.fd_socket
        )
        self.started.set()

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
        if self.config.ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.ipc_path)
        # Last: /readyz answers "draining" for as long as the drain above runs.
        self.completions.close()
        await self.observability.close()
        self._notifier.close()
        log.info("kvsidecar stopped")

    # ------------------------------------------------------------------ dispatch

    def _peer_service(self) -> PeerService:
        """Return the peer service; a typed error when a peer command comes before or after it."""
        if self.peer is None:
            raise SidecarError("shutting_down", "node-to-node transfer is not running")
        return self.peer

    def _dispatch(self, req: Request, data: list[memoryview], reply_to: ReplyTo) -> Dispatched:
        """Answer a request inline (a reply and its data frames), or return what answers later.

        That is a coroutine (run as a task), the future of a peer pull's reply, or for copy
        jobs their outcome (the job answers through ``reply_to`` itself).
        """
        match req:
            case Hello():
                _check_version(req.protocol_version)
                return self._hello(req), ()
            case Status():
                return self._status(req), ()
            case Heartbeat():
                return self._heartbeat(req), ()
            case HostAlloc():
                return self._host_alloc(req)
            case HostFree():
                return self._host_free(req, data[0]), ()
            case Move():
                return self._move(req, data, reply_to)
            case Grant():  # security
                return self._grant(req), ()
            # --- prefix cache and connectors (kvsidecar/daemon/cache_commands.py) ---
            case CacheLookup():
                return self._cache_lookup(req, data, reply_to.user), ()
            case CacheStore():
                return self._cache_store(req, data, reply_to, reply_to.user)
            case CacheLoad():
                return self._cache_load(req, data, reply_to, reply_to.user)
            case TakeWorkerEvents():
                check_epoch(self.registry.worker(req.worker), req.epoch)
                return PeerEvents(id=req.id, events=self.worker_events.take(req.worker)), ()
            # --- end prefix cache ---
            case FixLayout():
                ids = self._ids(data[0], req.ids_dtype, "block")
                job = prepare_fix(self.registry, req, ids)
                return self._run_job(job, req.id, move=False, respond=reply_to)
            # --- peer (kvsidecar.peer.service) ---
            case Pull():
                remote = self._ids(data[0], req.ids_dtype, "remote block")
                local = self._ids(data[1], req.ids_dtype, "local block")
                return self._counted_pull(req, self._peer_service().pull(req, remote, local))
            case Publish():
                ids = self._ids(data[0], req.ids_dtype, "block")
                return self._peer_service().publish(req, ids), ()
            case TakePeerEvents():
                return self._peer_service().take_events(req), ()
            # --- end peer ---
            # --- completions (kvsidecar/completions.py) ---
            case Report():
                return self.completions.report(req), ()
            case Collect():
                return self.completions.collect(req)
            # --- end completions ---
            case Register():
                _check_version(req.protocol_version)
                return self._register(req)
            case Unregister():
                check_epoch(self.registry.worker(req.worker), req.epoch)
                return self._unregister(req)
        raise SidecarError(
            "unknown_message", f"no handler for {type(req).__name__}"
        )  # pragma: no cover

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
        )

    def readiness(self) -> Readiness:
        """`kvsidecar.daemon.metrics_server.HealthProvider`: what ``/readyz`` decides on."""
        return readiness(
            sockets_bound=self._sock is not None and self.started.is_set(),
            pool_needed=self.config.host_pool_bytes > 0,
            pool_allocated=self._pool is not None,
            draining=self.draining,
        )

    async def _counted_pull(self, req: Pull, work: Coroutine[Any, Any, Reply]) -> Reply:
        """Run a pull; count the bytes it brought as a move (``local`` when on this node)."""
        reply = await work
        if isinstance(reply, Pulled) and reply.nbytes:
            kind: MoveKind = "peer_recv" if req.remote_endpoint else "local"
            self.observability.move_done(kind, req.engine_id, reply.nbytes, reply.seconds)
        return reply

    def _on_peer_completion(self, event: PeerCompletion) -> None:
        # Counted by the aggregation, and still queued for ``take_peer_events`` (observers).
        self.completions.on_peer_event(event)
        self.worker_events.on_peer_event(event)  # connectors that aggregate themselves
        if self.peer is not None:
            self.peer.completions.append(event)


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check that an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise SystemExit(f"kvsidecar: {path} belongs to uid {st.st_uid}, not to us; refusing it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def _refuse_if_running(fd_socket: str) -> None:
    """Fail fast when another daemon already serves this runtime directory."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(fd_socket)
    except OSError:
        return
    finally:
        probe.close()
    raise SystemExit(f"kvsidecar: a daemon already listens on {fd_socket}")


async def serve(config: Config) -> None:
    """Run a daemon with ``config`` until SIGTERM/SIGINT (or cancellation)."""
    await Daemon(config).serve()


def main() -> None:
    """Serve with settings from ``KVSIDECAR_*`` (``python -m kvsidecar.daemon``).

    ``KVSIDECAR_CONFIG`` may name a TOML file. The CLI (``kvsidecar serve``) is the documented
    entry point; this one exists for tests and minimal containers.
    """
    config = Config.load(os.environ.get("KVSIDECAR_CONFIG"))
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import prometheus_client

    # Process-wide, hence in the entry point and not in the library (see kvsidecar.cli).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    Daemon(config).run()


if __name__ == "__main__":
    main()
