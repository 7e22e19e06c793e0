"""The scheduler half's calls to the daemon, none of them waited for on vLLM's scheduling thread.

`Lookups`: the prefix cache's answers to vLLM's scheduler, asked in the background.

vLLM asks the connector, for each waiting request, how many tokens it can load
(``get_num_new_matched_tokens``), and asks again later for a request answered None. So no
scheduler step waits on the daemon: the first ask sends the lookup (which also pins the hit
blocks on every rank for ``pin_s``, so that the load needs no second round trip) and answers
None; an ask once the reply is in answers from it. Hit blocks that are on the daemon's disk
tier only are brought up into its memory before it answers (at most ``disk_wait_s``): the
request waits for them here, in the background, and vLLM admits it once its load reads memory.
The answer is kept while its pin holds (half of ``pin_s``): a request that vLLM cannot admit yet
(no free KV blocks) is answered from it step after step, without a round trip each. A lookup
the daemon does not answer within ``lookup_timeout_s`` is a miss, and the daemon is left alone
for ``retry_s``.

`Publishes`: a finished prefill's publish, sent as vLLM finishes the request; its reply is read
a step later. The request is answered as published (its blocks held) at once: the decode engine
only learns of it once vLLM has returned the request, long after the message reached the
daemon. A publish the daemon refuses frees the blocks (`StepPlan.unsent`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from kvsidecar.client import Pending, SidecarClient, SidecarError
from kvsidecar.integrations.vllm.connection import DaemonConnection
from kvsidecar.integrations.vllm.settings import ConnectorSettings
from kvsidecar.wire.cache import CacheHits

# A child of vLLM's logger: what the connector says shows in the engine's own log, formatted alike.
log = logging.getLogger("vllm.kvsidecar")

KEPT = 4096
"""Answers kept at most (requests that waited and never came back go first)."""


@dataclasses.dataclass
class _Lookup:
    fingerprint: str
    keys: list[bytes]
    pending: Pending[CacheHits] | None
    hits: int = 0
    pin_id: int = 0
    disk_hits: int = 0
    fresh_until: float = 0.0


class Lookups:
    """See the module doc. Used from vLLM's scheduler thread only."""

    def __init__(
        self,
        conn: DaemonConnection,
        settings: ConnectorSettings,
        tp_size: int,
        *,
        replicated: bool = False,
    ) -> None:
        self.conn = conn
        self.settings = settings
        # Replicated (MLA): every rank loads from rank 0's one namespace, each under the pin.
        self.tp_size, self.loads = (1, tp_size) if replicated else (tp_size, 1)
        self._entries: collections.OrderedDict[str, _Lookup] = collections.OrderedDict()

    def answer(self, request_id: str, fingerprint: str, keys: list[bytes]) -> int | None:
        """Return how many leading ``keys`` every rank holds, or None: ask again later."""
        entry = self._entries.get(request_id)
        now = time.monotonic()
        if entry is not None and entry.fingerprint == fingerprint and entry.keys == keys:
            if entry.pending is not None and not self._settle(entry, now):
                return None
            if now < entry.fresh_until:
                return entry.hits
        client = self.conn.get()
        if client is None:
            return 0
        try:
            pending = client.submit_cache_lookup(
                fingerprint,
                keys,
                tp_size=self.tp_size,
                pin_s=self.settings.pin_s,
                timeout=self.settings.lookup_timeout_s,
                loads=self.loads,
                disk_wait_s=min(self.settings.disk_wait_s, self.settings.lookup_timeout_s / 2),
            )
        except SidecarError as exc:
            self.conn.away(f"lookup: {exc}")
            return 0
        self._entries[request_id] = _Lookup(fingerprint, keys, pending)
        self._entries.move_to_end(request_id)
        while len(self._entries) > KEPT:
            self._entries.popitem(last=False)
        return None

    def _settle(self, entry: _Lookup, now: float) -> bool:
        """Take the lookup's reply if it came (or give up on it); whether it is settled."""
        pending = entry.pending
        assert pending is not None
        if not pending.done():
            if now < pending.deadline:
                return False
            self.conn.away("lookup: no answer in lookup_timeout_s")
            entry.pending = None
            entry.fresh_until = now + self.settings.retry_s  # a miss until the daemon is back
            return True
        entry.pending = None
        try:
            reply = pending.result()
        except SidecarError as exc:
            self.conn.away(f"lookup: {exc}")
            entry.fresh_until = now + self.settings.retry_s
            return True
        entry.hits, entry.pin_id, entry.disk_hits = reply.hits, reply.pin_id, reply.disk_hits
        entry.fresh_until = now + self.settings.pin_s / 2  # the pin still holds when loaded
        return True

    def take(self, request_id: str) -> tuple[int, int]:
        """Forget the request's answer; return its pin (0: none) and its blocks from disk.

        The pin is what its load releases; the blocks from disk, how many of its hit blocks
        the daemon had on its disk tier only.
        """
        entry = self._entries.pop(request_id, None)
        if entry is None or entry.pending is not None:
            return 0, 0
        return entry.pin_id, entry.disk_hits

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request (it finished, or vLLM admitted it)."""
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        """Drop every answer (the namespace changed)."""
        self._entries.clear()


class Publishes:
    """See the module doc. Used from vLLM's scheduler thread only."""

    def __init__(self, conn: DaemonConnection, settings: ConnectorSettings, engine_id: str) -> None:
        self.conn = conn
        self.settings = settings
        self.engine_id = engine_id
        self._pending: list[tuple[str, Pending[None]]] = []

    def send(self, client: SidecarClient, request_id: str, blocks: list[int], digest: str) -> bool:
        """Send a request's publish; False when it could not even be sent (not published)."""
        try:
            pending = client.submit_publish(
                self.engine_id,
                request_id,
                blocks,
                lease_s=self.settings.lease_s,
                prompt_digest=digest,
                timeout=self.settings.lookup_timeout_s,
            )
        except SidecarError as exc:
            self.conn.away(f"publish: {exc}")
            return False
        self._pending.append((request_id, pending))
        return True

    def refused(self) -> list[str]:
        """Return the requests whose publish the daemon refused since the last call.

        One that timed out or lost its daemon stays held: a daemon that got it ends its lease
        with ``finished_sending``, and the workers release everything of a daemon that went.
        """
        refused, waiting = [], []
        for rid, pending in self._pending:
            if not pending.done():
                waiting.append((rid, pending))
                continue
            try:
                pending.result()
            except SidecarError as exc:
                if exc.code not in ("timeout", "connection_lost"):
                    log.warning("kvsidecar: %s: publish refused (%s): freed", rid, exc)
                    refused.append(rid)
        self._pending = waiting
        return refused
