"""`PeerLinks`: this daemon's connections to other daemons, keyed by who answers, and bounded.

A pull names its producer's daemon by endpoint, and that endpoint is input from whoever sent the
pull (an engine's connector passes one on from an API user's request). libzmq accepts many
spellings of one endpoint (host names, addresses of one host, a source address before a ``;``),
so links kept per endpoint string would let a client that spells one daemon a thousand ways
use up the sockets this daemon has for its peers. Hence:

- a pull's endpoint must be one of the ``peers`` setting when that is set, else pass the peer
  endpoint rule (`kvsidecar.wire.endpoints.canonical_peer_endpoint`); `check` turns it into its
  one canonical spelling, or refuses it;
- a link whose handshake succeeded is kept under the identity of the daemon that answered (its
  daemon id and the key it presented); a link that turns out to reach an identity already kept
  (another spelling of its endpoint) serves the pulls that use it and is closed after them:
  however many spellings reach one daemon, one link to it is kept;
- at most ``peer_max_links`` links are open at once (links to configured peers come on top):
  a new one past it closes the least recently used idle link, or, when every link is in use,
  is refused (``busy``);
- a link that no pull used for ``peer_link_idle_s`` is closed; one whose connection dropped is
  replaced at its next use (a restarted peer has a new daemon id: its link replaces the old).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvsidecar.node.config import Config
from kvsidecar.peer.link import PeerLink
from kvsidecar.wire.endpoints import canonical_peer_endpoint
from kvsidecar.wire.errors import SidecarError

log = logging.getLogger("kvsidecar.peer")

Identity = tuple[str, bytes]
"""Who answered a handshake: the remote daemon's id and the public key it presented."""


class PeerLinks:
    """The links to other daemons (see the module doc); `close` them at shutdown."""

    def __init__(self, config: Config, connect: Callable[[str], PeerLink]) -> None:
        """``connect(endpoint)``: a new link to a canonical endpoint (`PeerService` makes it)."""
        self._connect = connect
        self._max = config.peer_max_links
        self._idle_s = config.peer_link_idle_s
        self._peers = frozenset(canonical_peer_endpoint(p) for p in config.peer_list)
        self._by_endpoint: dict[str, PeerLink] = {}
        self._by_identity: dict[Identity, PeerLink] = {}
        self._open: set[PeerLink] = set()
        """Every link whose sockets are open: kept, passing, or closing (until closed)."""
        self._closing: set[asyncio.Task[None]] = set()
        self.evicted_total = 0
        """Idle links closed to make room for a new one (`peer_max_links`)."""
        self.refused_total = 0
        """Pulls refused because every link was in use (``busy``)."""
        self.passing_total = 0
        """Links that reached a daemon already linked under another spelling (closed after use)."""

    @property
    def open_count(self) -> int:
        """Links whose sockets are open now (closing ones included)."""
        return len(self._open)

    def check(self, endpoint: str) -> str:
        """Return the canonical spelling of a pull's endpoint, or refuse it (a typed error).

        ``invalid_message``: it does not pass the peer endpoint rule; ``forbidden``: ``peers``
        is set and does not name it.
        """
        try:
            canonical = canonical_peer_endpoint(endpoint)
        except ValueError as exc:
            raise SidecarError(
                "invalid_message", f"remote_endpoint {endpoint[:80]!r}: {exc}"
            ) from None
        if self._peers and canonical not in self._peers:
            raise SidecarError(
                "forbidden", f"remote_endpoint {canonical!r} is not one of this daemon's peers"
            )
        return canonical

    def acquire(self, endpoint: str) -> PeerLink:
        """Return a link to ``endpoint`` (canonical, from `check`) for one pull; `release` it.

        Connects when none is kept for it (or it was lost); may close an idle link to make room,
        or raise ``busy`` when every link is in use.
        """
        link = self._by_endpoint.get(endpoint)
        if link is not None and (link.closed or link.lost):
            self._discard(link)
            link = None
        if link is None:
            self._make_room(endpoint)
            link = self._connect(endpoint)
            self._open.add(link)
            self._by_endpoint[endpoint] = link
        link.users += 1
        link.last_used = time.monotonic()
        return link

    def release(self, link: PeerLink) -> None:
        """Give ``link`` back after a pull; a passing link with no other user is closed."""
        link.users -= 1
        link.last_used = time.monotonic()
        if link.users <= 0 and link.passing:
            self._discard(link)

    def adopt(self, link: PeerLink, identity: Identity) -> None:
        """Record who answered ``link``'s handshake; keep it under that identity, or let it pass.

        A link that reaches an identity already kept on another live link serves its pulls and is
        closed after them (`release`); its endpoint is not remembered.
        """
        if link.identity == identity:
            return
        kept = self._by_identity.get(identity)
        if kept is not None and kept is not link and not (kept.closed or kept.lost):
            if not link.passing:
                link.passing = True
                self.passing_total += 1
                if self._by_endpoint.get(link.endpoint) is link:
                    del self._by_endpoint[link.endpoint]
            return
        if link.identity is not None and self._by_identity.get(link.identity) is link:
            del self._by_identity[link.identity]  # the daemon at this endpoint restarted
        link.identity = identity
        self._by_identity[identity] = link

    async def drop(self, link: PeerLink) -> None:
        """Close ``link`` now (its peer is gone); the next pull to its endpoint connects afresh."""
        self._forget(link)
        await link.close()
        self._open.discard(link)

    async def sweep(self) -> None:
        """Close the links that no pull used for ``peer_link_idle_s``, until cancelled."""
        period = min(self._idle_s / 4, 5.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for link in list(self._open):
                if not link.closed and link.users <= 0 and now - link.last_used >= self._idle_s:
                    log.debug("closing the idle link to %s", link.endpoint)
                    self._discard(link)

    async def close(self) -> None:
        """Close every link (at shutdown)."""
        for link in list(self._open):
            self._forget(link)
            await link.close()
        self._open.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _make_room(self, endpoint: str) -> None:
        if endpoint in self._peers:
            return  # configured peers are not counted against the bound
        counted = [link for link in self._open if link.endpoint not in self._peers]
        if len(counted) < self._max:
            return
        idle = [link for link in counted if link.users <= 0 and not link.closed]
        if not idle:
            self.refused_total += 1
            raise SidecarError(
                "busy",
                f"{len(counted)} links to other daemons are open and in use (peer_max_links): "
                f"no new link to {endpoint}",
            )
        self.evicted_total += 1
        self._discard(min(idle, key=lambda link: link.last_used))

    def _forget(self, link: PeerLink) -> None:
        if self._by_endpoint.get(link.endpoint) is link:
            del self._by_endpoint[link.endpoint]
        if link.identity is not None and self._by_identity.get(link.identity) is link:
            del self._by_identity[link.identity]

    def _discard(self, link: PeerLink) -> None:
        """Forget ``link`` and close it in the background (its sockets count until closed)."""
        self._forget(link)
        if link.closed:
            return
        task = asyncio.get_running_loop().create_task(link.close())
        self._closing.add(task)

        def done(t: asyncio.Task[None], link: PeerLink = link) -> None:
            self._closing.discard(t)
            self._open.discard(link)

        task.add_done_callback(done)
