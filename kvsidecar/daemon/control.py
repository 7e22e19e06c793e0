"""The daemon's control socket: read requests, check them once, route them, send every reply.

`ControlSocket` owns the ROUTER. It is a plain pyzmq socket read from a loop reader callback on its
fd (an awaited ``recv_multipart`` per request costs a future and a task step, a good part of a short
command's round trip). Each request is size-checked, decoded once into the `Request` union, checked
for its data frames and its sender's rights (`kvsidecar.daemon.limits.access.authorize`), then
handed with its `ReplyTo` to the route given at construction
(`kvsidecar.daemon.dispatch.Router.dispatch`). Every reply goes out through `ControlSocket.send`,
from the loop or from a copy thread (the socket is shared under a lock); `ReplyTo` makes sure a
request is answered exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.daemon.limits.access import AccessControl, Principal, authorize
from kvsidecar.daemon.limits.connections import ConnectionCount
from kvsidecar.daemon.metrics.observability import Observability
from kvsidecar.daemon.runner import reply_of
from kvsidecar.daemon.state import DaemonState
from kvsidecar.node.auth import (
    CONTROL_DOMAIN,
    ZapHandler,
    close_zap_and_context,
    control_transport,
    secure_server_socket,
)
from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor, call_soon_from_thread
from kvsidecar.node.replies import ReplyBudget
from kvsidecar.wire import zmqio
from kvsidecar.wire.batch import MoveBatch
from kvsidecar.wire.cache import CacheLoad, CacheLookup, CacheStore
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.protocol import (
    REQUEST_TAGS,
    Collect,
    Envelope,
    Error,
    FixLayout,
    Hello,
    HostAlloc,
    HostFree,
    Move,
    Reply,
    Request,
    Status,
)
from kvsidecar.wire.pulls import Publish, Pull, TakePeerEvents

log = logging.getLogger("kvsidecar.daemon")

DATA_FRAMES: dict[type, int] = {
    Move: 2,
    FixLayout: 1,
    HostFree: 1,
    Pull: 2,
    Publish: 1,
    MoveBatch: 2,
    CacheLookup: 1,
    CacheStore: 2,
    CacheLoad: 2,
}
"""Raw frames each request carries after its header (others: none). Pull: (remote ids, local
ids); Publish: the published ids; MoveBatch: (every item's source ids, destination ids); cache
lookup: the keys; cache store and load: (keys, ids)."""

_Frames = list[zmq.Frame]
_BURST = 64
"""Requests served per reader callback before yielding to the loop (bounded work per turn)."""
_BURST_S = 0.005
"""...and seconds: a burst of requests that each cost milliseconds (stores of thousands of keys)
yields after this long, so that one client's heavy requests, answered one by one as fast as it
sends them, cannot hold the other callbacks (``/healthz``, the fd channel, timers) off."""

Dispatched = (
    tuple[Reply, tuple[Any, ...]] | Coroutine[Any, Any, Reply] | asyncio.Future[Reply] | None
)
"""What a route returns: an inline reply and its data frames, a coroutine run as a task, a
future (a peer pull's reply, or a copy job's outcome that answers through its `ReplyTo`), or
None: answered already."""

Route = Callable[[Request, list[memoryview], "ReplyTo", Principal], Dispatched]
"""Who answers a checked request (`kvsidecar.daemon.dispatch.Router.dispatch`)."""

NOBODY = Principal(frozenset(), admin=False, user="")
"""The principal handed on with requests that need no rights and tell nothing (hello)."""

BULKY = (Status, HostAlloc, Collect, TakePeerEvents)
"""Requests whose replies may be large (zero-copy): refused while `ReplyBudget` has no room."""

OPEN = (Hello,)
"""Requests anyone may send and that tell nothing of any engine: no principal is looked up for
them (``status`` and ``heartbeat`` need one: they answer about the sender's own engines)."""

ANSWERED_BY_JOB = (Move, FixLayout, MoveBatch, CacheStore, CacheLoad)
"""Requests run as copy jobs, which answer through their `ReplyTo` themselves.

Tuples, not unions, for ``isinstance``: a union is built anew at each call."""


def _user_of(frame: zmq.Frame) -> str:
    """Return the transport user libzmq's ZAP verdict put on a message ("": none, trust nothing)."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, KeyError):
        return ""


def _no_room(size: int, budget: ReplyBudget, user: str) -> str:
    what = f"a reply of {size} bytes" if size else "a reply that may be large"
    return (
        f"{what} was not queued: replies wait for clients that have not read them, "
        f"{budget.held_by(user)} bytes of them {user or 'unauthenticated'}'s (its share of "
        f"max_reply_bytes {budget.limit}: {budget.user_limit}); read your replies, then retry"
    )


class ReplyTo:
    """Where one request's reply goes: sent once, from the loop or from a copy thread.

    The `kvsidecar.daemon.runner.Answer` of a request. A copy thread and the loop may both try to
    answer (a move that finished just as its worker was released); a lock decides who does, and
    what was sent stays readable so that the loop's bookkeeping matches what the client got.
    """

    __slots__ = ("_claimed", "_command", "_control", "_ident", "_lock", "_sent", "_started", "user")

    def __init__(
        self, control: ControlSocket, ident: bytes, command: str, started: float, user: str = ""
    ) -> None:
        self._control, self._ident, self._command, self._started = control, ident, command, started
        self.user = user
        """The sender's transport user (``uid:<n>``, ``curve:<key>``, ``insecure``)."""
        self._lock = threading.Lock()
        self._claimed = False
        self._sent: Reply | None = None

    def send(self, reply: Reply, *, from_thread: bool = False) -> bool:
        """Send ``reply`` unless the reply is claimed already; True if this call sent it."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            self._sent = reply
        self._control.send(
            self._ident,
            reply,
            command=self._command,
            started=self._started,
            from_thread=from_thread,
            user=self.user,
        )
        return True

    def claim(self) -> Reply | None:
        """Claim the reply for the caller (None; then `deliver` it) or return what was sent."""
        with self._lock:
            if self._claimed:
                return self._sent
            self._claimed = True
            return None

    def deliver(self, reply: Reply) -> None:
        """Send the reply that `claim` reserved (on the event loop)."""
        self._control.send(
            self._ident, reply, command=self._command, started=self._started, user=self.user
        )


class ControlSocket:
    """The control ROUTER: bound behind ZAP, read from the loop, every reply sent through it."""

    def __init__(
        self,
        config: Config,
        *,
        access: AccessControl,
        observability: Observability,
        reply_budget: ReplyBudget,
        executor: CopyExecutor,
        state: DaemonState,
    ) -> None:
        self._config = config
        self._access = access
        self._observability = observability
        self._reply_budget = reply_budget
        self._executor = executor
        self._state = state
        self._route: Route | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._lock = threading.Lock()
        """Held around every use of ``_sock``: copy threads send replies on it too (`ReplyTo`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._envelope = msgspec.msgpack.Decoder(Envelope)
        self._encoder = msgspec.msgpack.Encoder()
        self.errors_total = 0
        """Error replies sent (``status``)."""
        self._read_scheduled = False
        """A call of `_on_readable` is queued on the loop (never more than one)."""
        self._drained = False
        """The last reply sent from the loop found no request waiting (and re-armed the edge)."""
        self.bound = False
        """True once the socket is bound (shutdown removes an ipc path only then)."""
        self.insecure = False
        """The endpoint is plain tcp (``insecure``); exported as a metric."""
        self.zap: ZapHandler | None = None
        """Authenticates connections (peer uid on ipc, CURVE key on tcp); set by `bind`."""
        self.connections: ConnectionCount | None = None
        """Connections per peer and in total, admitted by ZAP; set by `bind`."""

    def bind(self) -> None:
        """Start ZAP, then bind the ROUTER behind it, with its connection limits."""
        config = self._config
        transport = control_transport(config)  # ConfigError on bad key files
        self.insecure = transport.insecure
        self._ctx = zmq.asyncio.Context()
        self.zap = ZapHandler(self._ctx)
        self.zap.policies[CONTROL_DOMAIN] = transport.policy
        self.zap.start()  # before bind: the socket refuses connections nobody vouches for
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_server_socket(sock, domain=CONTROL_DOMAIN, keys=transport.keys)
        # Hard ceiling enforced by libzmq itself (the peer is disconnected); below it, oversize
        # requests get a typed too_large reply from `_on_message`.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
        zmqio.bind_or_close(sock, config.endpoint, "control endpoint")
        self.bound = True  # from here on the ipc socket file is ours to remove
        if config.ipc_path is not None:
            os.chmod(config.ipc_path, 0o600)
        self._sock = sock
        self.connections = ConnectionCount(
            sock,
            max_total=config.max_connections,
            max_per_peer=config.max_connections_per_peer,
            users=len(config.uids),
        )
        self.zap.admission[CONTROL_DOMAIN] = self.connections.admit

    @property
    def is_open(self) -> bool:
        """Whether the socket is bound and not closed yet."""
        return self._sock is not None

    async def serve(self, route: Route) -> None:
        """Answer requests through ``route`` until cancelled."""
        assert self._sock is not None
        self._route = route
        self._loop = asyncio.get_running_loop()
        await zmqio.serve_readable(self._sock, self._on_readable, self._schedule_read)

    async def close(self) -> None:
        """Close the connection count, the socket, ZAP and the context; safe to call again."""
        if self.connections is not None:
            await self.connections.close()
            self.connections = None
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
        await close_zap_and_context(self.zap, self._ctx)
        self.zap, self._ctx = None, None

    def _schedule_read(self, *, from_thread: bool = False) -> None:
        """Queue one `_on_readable` on the loop unless one is queued already.

        Several reasons to read again come up in one turn (each reply sent may swallow the fd's
        edge, a burst may end with requests waiting): one queued read serves them all. One per
        reason would let a client that sends without reading multiply them turn after turn,
        until the loop spent whole seconds per turn and starved timers, ZAP and the fd channel.
        """
        if self._read_scheduled:
            return
        self._read_scheduled = True
        if not from_thread:
            asyncio.get_running_loop().call_soon(self._on_readable)
        elif self._loop is not None:
            call_soon_from_thread(self._loop, self._on_readable)

    def _on_readable(self) -> None:
        # The fd is edge-triggered: it signals again only once ZMQ_EVENTS has reported nothing
        # left to read (and `send` re-checks after each send, which may swallow the edge). A
        # burst is served in slices so that other callbacks (copy completions, the fd channel,
        # ZAP, timers) run in between; libzmq's fair queueing takes one request per connection
        # in turn, so one client's backlog does not delay another's requests by more than that.
        # When the reply just sent from the loop found nothing more to read, the callback
        # returns at once: that check re-armed the edge, and asking again would cost another
        # option read and receive attempt per request.
        self._read_scheduled = False
        lock = self._lock
        settle = self._executor.settle_finished
        until = time.perf_counter() + _BURST_S
        for _ in range(_BURST):
            with lock:
                sock = self._sock
                frames = None if sock is None else zmqio.try_recv(sock)
            if frames is None:
                return
            settle()  # moves answered from copy threads are settled before any later request
            self._drained = False
            try:
                self._on_message(frames)
            except Exception:  # a bug must not stop the daemon serving everyone else
                log.exception("unhandled error on a request")
            if self._drained:
                return
            if time.perf_counter() > until:
                break
        self._schedule_read()

    def send(
        self,
        ident: bytes,
        reply: Reply,
        data: tuple[Any, ...] = (),
        *,
        command: str = "",
        started: float = 0.0,
        from_thread: bool = False,
        user: str = "",
    ) -> None:
        """Send one reply; ``from_thread`` when called on a copy thread, not on the loop.

        ``user``: the sender's transport user, whose share of ``max_reply_bytes`` a large reply
        takes.
        """
        # The socket's encoder on the loop; msgspec's module-level one on a copy thread.
        header = msgspec.msgpack.encode(reply) if from_thread else self._encoder.encode(reply)
        size = len(header) + sum(memoryview(f).nbytes for f in data) if data else len(header)
        large = size >= zmqio.COPY_BELOW  # sent zero-copy: held until libzmq lets go of it
        budget = self._reply_budget
        if large and not budget.take(size, user):
            reply = Error(id=reply.id, code="busy", message=_no_room(size, budget, user))
            header, data, large = msgspec.msgpack.encode(reply), (), False
        if isinstance(reply, Error):
            self.errors_total += 1
        with self._lock:
            sock = self._sock
            trackers: list[zmq.MessageTracker] = []
            try:
                if sock is None:
                    raise zmq.ZMQError(msg="the control socket is closed")
                # A ROUTER never blocks on send (it drops for a gone or saturated peer).
                frames = [ident, header, *data]
                trackers = zmqio.send_frames(sock, frames, copy=not large, track=large)
                # The send may have taken the fd's edge: requests waiting now would go unnoticed.
                pending = zmqio.readable(sock)
            except zmq.ZMQError as exc:  # peer gone, or socket closing during shutdown
                log.debug("reply %s not sent: %s", type(reply).__name__, exc)
                if large:
                    budget.give_back(size, user)
                trackers, large, pending = [], False, False
        if large:
            budget.track(trackers, size, user)
        if command:  # metered once the reply is out: every answered command, with its latency
            self._observability.command(command, reply, started)
        if pending:
            self._schedule_read(from_thread=from_thread)
        elif not from_thread:
            self._drained = True

    def _on_message(self, frames: _Frames) -> None:
        ident = frames[0].bytes
        body = frames[1:]
        request_id = 0
        started = time.perf_counter()
        command = "unknown"  # metrics label until the header decodes
        user = ""
        try:
            if not body:
                raise SidecarError("bad_frame", "a request needs a header frame")
            header = body[0].buffer
            size = len(body[0])  # a frame's len() is its size, without a memoryview
            total = sum(map(len, body))
            if self._too_large(size, total):
                request_id = self._peek_id(header) if size <= (1 << 16) else 0
                raise SidecarError(
                    "too_large",
                    f"request of {total} bytes (header {size}); limits "
                    f"{self._config.max_message_bytes} and {self._config.max_header_bytes}",
                )
            request = self._decode(header)
            request_id = request.id
            command = str(type(request).__struct_config__.tag)
            want = DATA_FRAMES.get(type(request), 0)
            if len(body) - 1 != want:
                raise SidecarError(
                    "bad_frame",
                    f"{type(request).__name__} carries {want} data frames, got {len(body) - 1}",
                )
            if self._state.draining and not isinstance(request, Status):
                raise SidecarError("shutting_down", "the daemon is shutting down")
            user = "" if isinstance(request, OPEN) else _user_of(body[0])
            if isinstance(request, BULKY) and not self._reply_budget.has_room(user):
                # Refused before it runs: a collect or take_peer_events must not consume what
                # its reply would then have to drop.
                raise SidecarError("busy", _no_room(0, self._reply_budget, user))
            who = NOBODY  # hello needs no rights: no principal looked up
            if not isinstance(request, OPEN):
                who = self._access.principal(ident, user)
                authorize(self._access, who, request)  # forbidden before anything is done
            reply_to = ReplyTo(self, ident, command, started, user)
            assert self._route is not None
            result = self._route(request, [f.buffer for f in body[1:]], reply_to, who)
        except SidecarError as exc:
            rid = request_id or exc.request_id
            self.send(
                ident,
                Error(id=rid, code=exc.code, message=exc.message),
                command=command,
                started=started,
                user=user,
            )
            return
        if result is None:  # answered already
            return
        if isinstance(result, tuple):
            reply, data = result
            self.send(ident, reply, data, command=command, started=started, user=user)
        elif isinstance(result, asyncio.Future):
            if isinstance(request, ANSWERED_BY_JOB):  # by `JobRunner.run`, perhaps already
                self._state.hold_reply(result)
                return
            self._state.replies.add(result)

            def answer(outcome: asyncio.Future[Reply]) -> None:
                self._state.replies.discard(outcome)
                reply_to.send(reply_of(outcome, request_id))

            result.add_done_callback(answer)
        else:
            self._state.spawn(
                self._finish(ident, request_id, result, command=command, started=started, user=user)
            )

    def _too_large(self, header_bytes: int, total_bytes: int) -> bool:
        """Whether a request's header or whole size is over the limits (``too_large``)."""
        config = self._config
        return header_bytes > config.max_header_bytes or total_bytes > config.max_message_bytes

    def _peek_id(self, header: memoryview) -> int:
        try:
            return self._envelope.decode(header).id
        except (msgspec.DecodeError, OverflowError):
            return 0

    def _decode(self, header: memoryview) -> Request:
        try:
            return self._decoder.decode(header)
        except msgspec.ValidationError as exc:
            try:
                env = self._envelope.decode(header)
            except msgspec.DecodeError:
                raise SidecarError("bad_frame", f"header is not a request: {exc}") from None
            if env.type not in REQUEST_TAGS:
                raise SidecarError(
                    "unknown_message", f"unknown request type {env.type!r}", request_id=env.id
                ) from None
            raise SidecarError("invalid_message", f"{env.type}: {exc}", request_id=env.id) from None
        except msgspec.DecodeError as exc:
            raise SidecarError("bad_frame", f"header is not msgpack: {exc}") from None

    async def _finish(
        self,
        ident: bytes,
        request_id: int,
        work: Coroutine[Any, Any, Reply],
        *,
        command: str = "",
        started: float = 0.0,
        user: str = "",
    ) -> None:
        try:
            reply = await work
        except SidecarError as exc:
            reply = Error(id=request_id, code=exc.code, message=exc.message)
        except asyncio.CancelledError:
            self.send(
                ident,
                Error(id=request_id, code="shutting_down", message="cancelled by shutdown"),
                command=command,
                started=started,
                user=user,
            )
            raise
        except Exception as exc:
            log.exception("request %d failed", request_id)
            reply = Error(id=request_id, code="internal", message=f"{type(exc).__name__}: {exc}")
        self.send(ident, reply, command=command, started=started, user=user)
