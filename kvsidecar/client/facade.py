"""What both clients are made of: a session, its request builders, and the session's public face.

`SidecarClient` (`kvsidecar.client.sync`) and `AsyncSidecarClient` (`kvsidecar.client.aio`) each
add a transport of their own (`kvsidecar.client.sync_transport`, `kvsidecar.client.aio_transport`)
and one method per command that builds the call (`_Requests`, `_CacheRequests`), carries it on
the transport, and returns what the call's ``finish`` made of the reply. The two method sets are
kept in step by ``tests/client/test_parity.py``.
"""

from __future__ import annotations

from kvsidecar.client.cache_requests import _CacheRequests
from kvsidecar.client.common import _Session
from kvsidecar.client.requests import _Requests
from kvsidecar.wire.curve import KeyPair
from kvsidecar.wire.protocol import HelloReply
from kvsidecar.wire.types import WorkerRef


class _Facade:
    """A client's session and request builders, and what it shows of the session."""

    def __init__(
        self, endpoint: str | None, timeout_s: float, name: str, curve: tuple[bytes, KeyPair] | None
    ) -> None:
        self._session = _Session(endpoint, timeout_s, name, curve)
        self._requests = _Requests(self._session)
        self._cache_requests = _CacheRequests(self._session)

    @property
    def endpoint(self) -> str:
        """The daemon's endpoint (default: this user's daemon on this node)."""
        return self._session.endpoint

    @property
    def timeout_s(self) -> float:
        """How long a call waits for its reply unless it passes ``timeout=``."""
        return self._session.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._session.timeout_s = value

    @property
    def name(self) -> str:
        """The client's name in the daemon's hello and logs."""
        return self._session.name

    @property
    def daemon(self) -> HelloReply | None:
        """The daemon's hello reply (versions, fd socket, lease, limits)."""
        return self._session.daemon

    @property
    def workers(self) -> list[WorkerRef]:
        """Workers registered through this client (kept alive by its heartbeats)."""
        return self._session.workers

    @property
    def epochs(self) -> dict[WorkerRef, int]:
        """Registration epoch of each worker registered here (`Registered.epoch`)."""
        return self._session.epochs

    @property
    def reconnects(self) -> int:
        """Completed reconnections (daemon restarts survived)."""
        return self._session.reconnects

    @property
    def available(self) -> bool:
        """Whether the daemon is reachable as far as this client knows (no loss seen yet).

        False from the moment the daemon's death shows (its fd channel closed) until a
        reconnection, made by the next call or the heartbeat, succeeds.
        """
        return self._session.available

    @property
    def worker(self) -> WorkerRef:
        """The (first) worker this client registered."""
        return self._session.worker
