"""The systemd notify protocol (``sd_notify(3)``), without a dependency.

Under ``Type=notify`` systemd waits for ``READY=1`` before it counts the service as started, and
with ``WatchdogSec=`` it kills and restarts a service whose ``WATCHDOG=1`` pings stop. The protocol
is one datagram per message on the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET``: newline-separated
``KEY=VALUE`` assignments. A name starting with ``@`` is in the Linux abstract namespace.

How the daemon uses it::

    notifier = Notifier.from_env()
    ...  # bind sockets, allocate the host pool
    notifier.ready()
    if (interval := notifier.watchdog_interval()) is not None:
        pings = asyncio.create_task(watchdog_loop(notifier, interval))
    ...  # on SIGTERM:
    notifier.stopping()

The pings come from a task on the event loop, not from a thread: a loop that stalls (a copy run on
it by mistake, a deadlock) stops pinging, and systemd restarts the daemon.

Without ``$NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``) every call is a no-op. Send
errors are logged, never raised: a notification must not take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

__all__ = ["Notifier", "watchdog_loop"]

log = logging.getLogger(__name__)


def _socket_address(name: str) -> str | None:
    """Map ``$NOTIFY_SOCKET`` to an address for ``sendto``; None when the form is unsupported."""
    if name.startswith("/"):
        return name
    if name.startswith("@") and len(name) > 1:
        # Linux abstract namespace: a leading NUL byte instead of the '@'.
        return "\0" + name[1:]
    # systemd >= 254 also accepts "vsock:CID:PORT" (for VMs); a node daemon never sees it.
    return None


def _parse_positive(value: str | None) -> int | None:
    """Parse a positive decimal integer as ``sd_watchdog_enabled(3)`` does; None if invalid."""
    if value is None:
        return None
    try:
        usec = int(value, 10)
    except ValueError:
        return None
    return usec if usec > 0 else None


class Notifier:
    """Sends state changes to the service manager over ``$NOTIFY_SOCKET``.

    Build it with `from_env`. A notifier without an address is disabled: its methods return False
    and send nothing.
    """

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        """Open a notifier for ``address`` (a path, or ``@name`` for the abstract namespace).

        ``watchdog_usec`` and ``watchdog_pid`` are ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID`` as
        integers; `watchdog_interval` interprets them.
        """
        self._name = address
        self._address = _socket_address(address) if address else None
        if address and self._address is None:
            log.warning("NOTIFY_SOCKET=%r has an unsupported form; not notifying", address)
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        if self._address is not None:
            try:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            except OSError as exc:
                log.warning("cannot open a notify socket: %s; not notifying", exc)
                self._address = None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, unset_environment: bool = False
    ) -> Notifier:
        """Build a notifier from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        ``environ`` defaults to `os.environ`. With ``unset_environment`` the three variables are
        removed from `os.environ` afterwards, as ``sd_notify(unset_environment=1)`` does, so that
        child processes do not notify in the daemon's name.
        """
        env = os.environ if environ is None else environ
        pid_text = env.get("WATCHDOG_PID")
        watchdog_pid = _parse_positive(pid_text)
        if pid_text is not None and watchdog_pid is None:
            # A PID we cannot parse means "not for us": sd_watchdog_enabled() returns an error.
            watchdog_pid = -1
        notifier = cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=_parse_positive(env.get("WATCHDOG_USEC")),
            watchdog_pid=watchdog_pid,
        )
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """Whether notifications go anywhere."""
        return self._sock is not None and self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True if the datagram was sent.

        Never blocks and never raises: with the socket gone or its queue full, the failure is
        logged and False returned.
        """
        if self._sock is None or self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        try:
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            log.warning("sd_notify %r to %s failed: %s", assignments, self._name, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd that start-up is complete (``READY=1``), optionally with a status line."""
        if status is None:
            return self.notify("READY=1")
        return self.notify("READY=1", f"STATUS={_one_line(status)}")

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd that shutdown began (``STOPPING=1``): the daemon is draining."""
        if status is None:
            return self.notify("STOPPING=1")
        return self.notify("STOPPING=1", f"STATUS={_one_line(status)}")

    def status(self, text: str) -> bool:
        """Set the free-form status line shown by ``systemctl status``."""
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``)."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before systemd's start or stop timeout fires.

        For a drain that is still making progress near ``TimeoutStopSec=``.
        """
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1e6))}")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings, or None when no watchdog is armed for this process.

        Follows ``sd_watchdog_enabled(3)``: ``$WATCHDOG_USEC`` must be a positive integer and
        ``$WATCHDOG_PID``, when set, must be this process's PID. The result is half the watchdog
        timeout, as that man page recommends, so that one late ping is not fatal.
        """
        if not self.enabled or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2e6

    def close(self) -> None:
        """Close the socket; later calls are no-ops."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        return f"Notifier({self._name!r}, enabled={self.enabled})"


def _one_line(text: str) -> str:
    """Keep a value on one line: a newline would start a new assignment."""
    return " ".join(text.splitlines())


async def watchdog_loop(
    notifier: Notifier,
    interval: float,
    *,
    healthy: Callable[[], bool] | None = None,
) -> None:
    """Ping ``WATCHDOG=1`` every ``interval`` seconds from the running event loop, until cancelled.

    Because the pings are scheduled on the loop, a blocked loop stops them, which is the point.
    With ``healthy``, a ping is skipped while it returns False (a stuck copy executor, say), so
    systemd restarts a daemon that is alive but not working.
    """
    if interval <= 0:
        raise ValueError(f"watchdog interval must be positive, got {interval}")
    while True:
        if healthy is None or _check(healthy):
            notifier.watchdog()
        else:
            log.warning("health check failed; withholding the watchdog ping")
        await asyncio.sleep(interval)


def _check(healthy: Callable[[], bool]) -> bool:
    """Run a health check; one that raises counts as failed (and keeps the loop alive)."""
    try:
        return healthy()
    except Exception:
        log.exception("health check raised")
        return False
