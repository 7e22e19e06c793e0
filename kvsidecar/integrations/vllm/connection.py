"""The connector's link to its daemon: made in the background, given up for a while when away.

An engine must start and serve whether or not its daemon is there. `DaemonConnection` tries to
connect (and, on a worker, to register) from a background thread, every ``retry_s`` until it
succeeds, so neither vLLM process waits for an absent daemon; until then `DaemonConnection.get`
returns None and the connector serves without help (every lookup a miss). Once connected, the
client's own machinery (its heartbeat thread) re-registers after a daemon restart; a side that
finds the daemon away (a timeout, a lost connection) calls `DaemonConnection.away`, and `get`
returns None until ``retry_s`` has passed, so a dead daemon costs one timeout per ``retry_s``,
not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvsidecar.client import SidecarClient, SidecarError
from kvsidecar.integrations.vllm.settings import ConnectorSettings

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")


class DaemonConnection:
    """One client of the daemon for one side of the connector (see the module doc)."""

    def __init__(
        self,
        settings: ConnectorSettings,
        name: str,
        *,
        heartbeat: bool,
        timeout_s: float,
        on_connect: Callable[[SidecarClient], None] | None = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self._heartbeat = heartbeat
        self._timeout_s = timeout_s
        self._on_connect = on_connect
        self._client: SidecarClient | None = None
        self._away_until = 0.0
        self._warned = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._reconnecting: threading.Thread | None = None

    def start(self) -> None:
        """Connect now if the daemon answers at once, else keep trying in the background."""
        if not self._try_connect():
            self._thread = threading.Thread(
                target=self._retry_loop, name=f"kvsidecar-connect-{self.name}", daemon=True
            )
            self._thread.start()

    def get(self) -> SidecarClient | None:
        """Return the client; None while there is none, or the daemon was found away lately."""
        client = self._client
        if client is None or time.monotonic() < self._away_until:
            return None
        return client

    def away(self, reason: str) -> None:
        """Note that the daemon did not answer: serve without it for ``retry_s``."""
        self._away_until = time.monotonic() + self.settings.retry_s
        log.warning(
            "kvsidecar (%s): daemon at %s unavailable (%s); serving without it for %.0f s",
            self.name,
            self.settings.daemon_endpoint,
            reason,
            self.settings.retry_s,
        )
        if not self._heartbeat:
            self._reconnect_in_background()

    def _reconnect_in_background(self) -> None:
        """Make a client without a heartbeat say hello again, off the caller's thread.

        The scheduler's calls are submitted, and a submit never reconnects: after a daemon
        restart its socket would stay with the daemon that went. Reconnected meanwhile, it is
        ready once ``retry_s`` has passed.
        """
        client = self._client
        if client is None or (self._reconnecting is not None and self._reconnecting.is_alive()):
            return

        def reconnect() -> None:
            while not self._closed.is_set():
                try:
                    client.reconnect(timeout=self.settings.connect_timeout_s)
                    return
                except SidecarError:
                    self._closed.wait(self.settings.retry_s)

        self._reconnecting = threading.Thread(
            target=reconnect, name=f"kvsidecar-reconnect-{self.name}", daemon=True
        )
        self._reconnecting.start()

    def close(self) -> None:
        """Stop trying, close the client (the daemon releases what it registered)."""
        self._closed.set()
        for thread in (self._thread, self._reconnecting):
            if thread is not None:
                thread.join(timeout=self.settings.connect_timeout_s + 1)
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _retry_loop(self) -> None:
        while not self._closed.wait(self.settings.retry_s):
            if self._try_connect():
                return

    def _try_connect(self) -> bool:
        settings = self.settings
        try:
            client = SidecarClient(
                settings.daemon_endpoint,
                timeout_s=settings.connect_timeout_s,
                name=f"vllm-{self.name}",
                heartbeat=self._heartbeat,
            )
        except SidecarError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "kvsidecar (%s): no daemon at %s (%s): serving without it, retrying every "
                    "%.0f s",
                    self.name,
                    settings.daemon_endpoint,
                    exc,
                    settings.retry_s,
                )
            return False
        try:
            client.timeout_s = self._timeout_s
            if self._on_connect is not None:
                self._on_connect(client)
        except SidecarError as exc:
            log.warning("kvsidecar (%s): set-up with the daemon failed: %s", self.name, exc)
            client.close()
            return False
        except Exception:  # a bug or an unusable cache layout: retrying cannot help
            log.exception("kvsidecar (%s): giving up on the daemon", self.name)
            client.close()
            self._closed.set()
            return True
        if self._closed.is_set():
            client.close()
            return True
        self._client = client
        if self._warned:
            log.warning("kvsidecar (%s): daemon at %s reached", self.name, settings.daemon_endpoint)
        return True
