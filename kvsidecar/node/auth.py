"""Who may connect: CurveZMQ keys for tcp, peer-uid checks for ipc, one ZAP handler for both.

libzmq asks a ZAP handler (ZeroMQ's authentication protocol, RFC 27, served on
``inproc://zeromq.zap.01`` of the socket's context) about every new connection of a socket that
has a ZAP domain, before any message of it is delivered. Two facts make it the right place for
both checks:

- on an **ipc** endpoint, libzmq 4.3 fills the request's address with the peer's kernel
  credentials (SO_PEERCRED at accept): ``"localhost:<uid>:<gid>:<pid>"``, even with the NULL
  mechanism; the handler compares the uid with the allow-list. (``ZMQ_IPC_FILTER_UID`` does the
  same inside libzmq but is deprecated, and refuses silently.)
- on a **tcp** endpoint with CURVE, the request carries the client's long-term public key; the
  handler compares it with the authorized keys.

A refused connection never delivers a message; libzmq closes it after the handshake. The reply's
``User-Id`` (``uid:<n>``, ``curve:<z85 key>`` or ``insecure``) rides on every message of an
accepted connection as the frame property ``User-Id``, which the daemon's access checks read.

Key files are read by `kvsidecar.wire.curve`, which clients share. The server socket fails
closed: ``ZAP_ENFORCE_DOMAIN`` refuses connections when no handler answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85

from kvsidecar.node.config import Config, ConfigError
from kvsidecar.wire.curve import KeyFileError, KeyPair, load_authorized_keys, load_keypair

log = logging.getLogger("kvsidecar.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends ZAP requests (fixed by RFC 27)."""

CONTROL_DOMAIN = "kvsidecar-control"
"""ZAP domain of the control endpoint (engine workers and schedulers)."""
PEER_DOMAIN = "kvsidecar-peer"
"""ZAP domain of the peer endpoint (other nodes' daemons)."""

INSECURE_USER = "insecure"
"""``User-Id`` of a connection accepted on plain tcp (no authentication at all)."""


@dataclass
class DomainPolicy:
    """What one ZAP domain accepts.

    ``uids``: peer uids allowed on ipc (None: any). ``curve_keys``: client keys allowed with CURVE
    (None: CURVE connections refused). ``allow_plain_tcp``: accept NULL-mechanism tcp peers.
    """

    uids: frozenset[int] | None = None
    curve_keys: frozenset[bytes] | None = None
    allow_plain_tcp: bool = False


@dataclass
class ZapStats:
    """Counts of the handler's answers, for status, metrics and tests."""

    accepted: int = 0
    refused: int = 0
    last_refused: str = ""
    refused_by_reason: dict[str, int] = field(default_factory=dict)


class ZapHandler:
    """A ZAP handler on the daemon's event loop, answering for every domain it was given.

    Bind it (`start`) before binding the sockets it guards. Unknown domains are refused.
    """

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.policies: dict[str, DomainPolicy] = {}
        self.admission: dict[str, Callable[[bytes], str]] = {}
        """Per domain, a last say on an authenticated connection by its address: why to refuse
        it ("" to let it in); `kvsidecar.daemon.limits.connections.ConnectionCount.admit`."""
        self.stats = ZapStats()
        self._logged: dict[str, float] = {}

    def start(self) -> None:
        """Bind ``inproc://zeromq.zap.01`` in the context and serve requests until `close`."""
        if self._sock is not None:
            return
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self._task = asyncio.create_task(self._serve(), name="kvsidecar-zap")

    async def close(self) -> None:
        """Stop answering (guarded sockets then refuse every new connection)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _serve(self) -> None:
        assert self._sock is not None
        sock = self._sock
        served = 0
        while True:
            served += 1
            if served % 32 == 0:  # a receive that finds one waiting never yields: a connection
                await asyncio.sleep(0)  # flood must not hold the loop
            # ROUTER framing: [routing id, empty delimiter, *ZAP request] (the request socket is a
            # REQ inside libzmq).
            frames = await sock.recv_multipart()
            try:
                reply = self.answer(frames[2:])
            except Exception:  # a malformed request must not stop authentication for everyone
                log.exception("ZAP: bad request")
                continue
            with contextlib.suppress(zmq.ZMQError):
                await sock.send_multipart([frames[0], b"", *reply])

    def answer(self, request: list[bytes]) -> list[bytes]:
        """Decide one ZAP request (RFC 27 frames) and return the reply frames."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        status, text, user = self._decide(
            domain.decode(errors="replace"), address, mechanism, credentials
        )
        admit = self.admission.get(domain.decode(errors="replace"))
        refusal = "" if admit is None or status != b"200" else admit(address)
        if refusal:  # past a connection limit
            status, text, user = b"400", refusal, ""
        if status == b"200":
            self.stats.accepted += 1
        else:
            self._refused(text, domain, address)
        return [version, request_id, status, text.encode(), user.encode(), b""]

    def _decide(
        self, domain: str, address: bytes, mechanism: bytes, credentials: list[bytes]
    ) -> tuple[bytes, str, str]:
        policy = self.policies.get(domain)
        if policy is None:
            return b"400", "unknown ZAP domain", ""
        if mechanism == b"CURVE":
            key = z85.encode(credentials[0]) if credentials else b""
            if policy.curve_keys is not None and key in policy.curve_keys:
                return b"200", "OK", "curve:" + key.decode()
            return b"400", "CURVE key not authorized", ""
        if mechanism != b"NULL":
            return b"400", f"mechanism {mechanism.decode(errors='replace')} not supported", ""
        uid = _ipc_uid(address)
        if uid is not None:
            if policy.uids is None or uid in policy.uids:
                return b"200", "OK", f"uid:{uid}"
            return b"400", f"uid {uid} not allowed", ""
        if policy.allow_plain_tcp:
            return b"200", "OK", INSECURE_USER
        return b"400", "unauthenticated connection refused", ""

    def _refused(self, reason: str, domain: bytes, address: bytes) -> None:
        s = self.stats
        s.refused += 1
        s.last_refused = f"{reason} ({address.decode(errors='replace')})"
        key = reason.split(" (", maxsplit=1)[0]
        s.refused_by_reason[key] = s.refused_by_reason.get(key, 0) + 1
        # libzmq retries a refused peer every reconnect interval: log each reason once a minute.
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) >= 60.0:
            self._logged[reason] = now
            log.warning(
                "refused a connection on %s: %s (%s)",
                domain.decode(errors="replace"),
                reason,
                address.decode(errors="replace"),
            )


async def close_zap_and_context(zap: ZapHandler | None, ctx: zmq.asyncio.Context | None) -> None:
    """Stop ``zap``, then end ``ctx``; call it once the sockets they guard are closed.

    In that order because ``term`` waits for every socket of the context, the handler's too.
    """
    if zap is not None:
        await zap.close()
    if ctx is not None:
        ctx.term()


def _ipc_uid(address: bytes) -> int | None:
    """Return the uid in libzmq's ipc peer address ``localhost:<uid>:<gid>:<pid>``, else None."""
    parts = address.split(b":")
    if len(parts) == 4 and parts[0] == b"localhost":
        try:
            return int(parts[1])
        except ValueError:
            return None
    return None


def secure_server_socket(sock: zmq.Socket[Any], *, domain: str, keys: KeyPair | None) -> None:
    """Make ``sock`` (before bind) consult the ZAP handler, with CURVE when ``keys`` are given."""
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    # Fail closed: without a handler answering, connections are refused, not let through.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    # A connection holds a descriptor until its handshake ends: 5 s, not libzmq's 30 s default.
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


@dataclass(frozen=True)
class Transport:
    """The control endpoint's security, resolved from the config at start-up."""

    keys: KeyPair | None
    """This daemon's key pair (tcp with CURVE), else None."""
    policy: DomainPolicy
    insecure: bool
    """True when a tcp endpoint runs in plain text (warned about, exported as a metric)."""


def _curve_keys(config: Config) -> tuple[KeyPair, frozenset[bytes]]:
    """Load this daemon's key pair and the public keys it accepts (by default: only its own)."""
    try:
        keys = load_keypair(config.curve_secret_key)
        allowed = (
            load_authorized_keys(config.curve_authorized_keys)
            if config.curve_authorized_keys
            else frozenset({keys.public})
        )
    except KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    return keys, allowed


def control_transport(config: Config) -> Transport:
    """Resolve the control endpoint's security; `ConfigError` on missing or bad key files."""
    uids = config.uids
    if config.ipc_path is not None:
        return Transport(None, DomainPolicy(uids=uids), insecure=False)
    if config.curve_secret_key:
        keys, allowed = _curve_keys(config)
        return Transport(keys, DomainPolicy(uids=uids, curve_keys=allowed), insecure=False)
    if not config.insecure:  # Config refuses it: fail closed all the same, never open
        raise ConfigError("a tcp endpoint needs curve_secret_key or insecure")
    log.warning(
        "control endpoint %s runs WITHOUT authentication or encryption (insecure): anyone who "
        "reaches it can read and overwrite every registered KV cache",
        config.endpoint,
    )
    return Transport(None, DomainPolicy(uids=uids, allow_plain_tcp=True), insecure=True)


def peer_transport(config: Config) -> Transport:
    """Resolve the peer endpoint's security and the key pair links to other daemons use.

    Peers authenticate with the daemon's own key pair in both roles; by default a node trusts
    only its own public key, which is the cluster-key deployment: one key pair (a Kubernetes
    Secret) on every node. Per-node keys go into ``curve_authorized_keys``; a pulling daemon then
    still expects the remote to present the cluster key (see docs/reliability.md).
    """
    if config.curve_secret_key:
        keys, allowed = _curve_keys(config)
        return Transport(keys, DomainPolicy(curve_keys=allowed), insecure=False)
    if config.peer_endpoint:  # Config refuses this without insecure
        log.warning(
            "peer endpoint %s runs WITHOUT authentication or encryption (insecure)",
            config.peer_endpoint,
        )
    return Transport(None, DomainPolicy(allow_plain_tcp=True), insecure=bool(config.peer_endpoint))


def peer_link_curve(transport: Transport) -> tuple[bytes, KeyPair] | None:
    """Return the CURVE settings of a link to another daemon (its key: the cluster's public key)."""
    if transport.keys is None:
        return None
    return transport.keys.public, transport.keys
