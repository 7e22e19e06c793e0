"""The connector's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

One frozen `ConnectorSettings`, read once from the extra config in both of vLLM's processes
(they get the same config). Unknown keys and ill-typed values are errors: a typo must not
silently turn a feature off. Every key is documented in docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvsidecar.wire.endpoints import default_endpoint


class SettingsError(ValueError):
    """A connector setting has a value the connector cannot run with; the message names it."""


MAX_STORE_BATCH_STEPS = 1024
"""Most decode steps whose blocks a store may batch (beyond, other engines see them too late)."""


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may set (defaults in the field list)."""

    endpoint: str = ""
    """The daemon's control endpoint; "" is this user's default (``KVSIDECAR_*`` env, runtime
    dir), as for every kvsidecar client."""
    prefix_cache: bool | None = None
    """Share computed blocks through the daemon's prefix cache; None: on for ``kv_both``."""
    disaggregated: bool | None = None
    """Take part in disaggregated prefill: publish prefills asked for with ``do_remote_decode``
    and pull those handed over with ``do_remote_prefill``. None: on for the roles
    ``kv_producer`` and ``kv_consumer``, off for ``kv_both``, where such params from an API
    client are ignored."""
    peers: tuple[str, ...] = ()
    """Peer endpoints (``tcp://host:port``) of the producer daemons this engine may pull from. A
    prefill published through this engine's own daemon needs none; any other endpoint a request
    names is ignored (the daemon would connect wherever an API client says)."""
    cache_bytes: int = 0
    """Size of this engine's cache namespace per rank when it creates it; 0: the daemon's share."""
    timeout_s: float = 10.0
    """Bound on one call to the daemon (stores, loads and pulls are also bounded by their own)."""
    connect_timeout_s: float = 2.0
    """How long a connection attempt waits for the daemon's hello."""
    lookup_timeout_s: float = 1.0
    """Bound on the scheduler's lookup; a daemon that does not answer in time is a miss."""
    disk_wait_s: float = 0.5
    """How long the daemon may hold a lookup's answer while it brings the hit's blocks up from
    its disk tier into memory (the request is admitted once they are there, so the load reads
    memory); half of ``lookup_timeout_s`` at most. 0: answered at once, the load waits."""
    retry_s: float = 5.0
    """After the daemon was found away, how long before it is tried again (misses meanwhile)."""
    store_wait_s: float = 5.0
    """How long a worker keeps a block unwritten for its store to copy it (``not_after``)."""
    store_batch_steps: int = 8
    """How many decode steps' full blocks a worker sends as one store (a prompt's blocks go at
    once); 1: every step's at once."""
    load_timeout_s: float = 10.0
    """Bound on a load; past it the blocks are load errors."""
    async_loads: bool = True
    """Load prefix-cache hits while the engine computes other requests (the request waits in
    vLLM's ``WAITING_FOR_REMOTE_KVS``), the whole block-aligned prompt included; false: the
    forward waits for the load, which stops one token short of the prompt."""
    pin_s: float = 10.0
    """How long a lookup's pin holds cached blocks for the load that follows."""
    lease_s: float = 0.0
    """How long a prefill engine's published blocks wait for their consumer; 0: the daemon's."""
    max_held_blocks: int = 0
    """Most KV blocks a prefill engine holds for hand-overs nobody has read yet (requests
    finished with ``do_remote_decode``, each held until its consumer reads it or its lease
    ends); a request past it is not handed over: its blocks are freed at once and its consumer
    computes the prompt. 0: half of the engine's blocks."""
    pull_timeout_s: float = 0.0
    """Bound on a decode engine's pull; 0: the daemon's ``peer_pull_timeout_s``."""
    stats_file: str = ""
    """Where each vLLM process appends, at shutdown, one JSON line: the calls and seconds of each
    connector hook (and a worker's counters). "" writes nothing."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Build the settings from vLLM's extra config; `SettingsError` names a bad key."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            field = fields.get(key)
            if field is None:
                raise SettingsError(f"kvsidecar connector: unknown setting {key!r}")
            values[key] = _parse(key, raw, field.default)
        settings = cls(**values)
        for name in ("timeout_s", "connect_timeout_s", "lookup_timeout_s", "retry_s"):
            if not getattr(settings, name) > 0:
                raise SettingsError(f"kvsidecar connector: {name} must be > 0")
        for name in ("store_wait_s", "load_timeout_s", "pin_s"):
            if not getattr(settings, name) > 0:
                raise SettingsError(f"kvsidecar connector: {name} must be > 0")
        if not 0 <= settings.disk_wait_s <= 30:
            raise SettingsError("kvsidecar connector: disk_wait_s must be in 0..30")
        for name in ("cache_bytes", "lease_s", "pull_timeout_s", "max_held_blocks"):
            if getattr(settings, name) < 0:
                raise SettingsError(f"kvsidecar connector: {name} must be >= 0")
        if not 1 <= settings.store_batch_steps <= MAX_STORE_BATCH_STEPS:
            raise SettingsError(
                f"kvsidecar connector: store_batch_steps must be in 1..{MAX_STORE_BATCH_STEPS}"
            )
        for peer in settings.peers:
            if not peer.startswith(("tcp://", "ipc://")):
                raise SettingsError(f"kvsidecar connector: peers: {peer!r} is no tcp:// endpoint")
        return settings

    @property
    def daemon_endpoint(self) -> str:
        """The endpoint to connect to (``endpoint``, or this user's default)."""
        return self.endpoint or default_endpoint()


def _parse(key: str, raw: object, default: object) -> Any:
    """Check ``raw`` against the type of the field's default (bools are not numbers)."""
    if isinstance(default, tuple):
        if isinstance(raw, list | tuple) and all(isinstance(x, str) for x in raw):
            return tuple(raw)
        raise SettingsError(f"kvsidecar connector: {key} must be a list of strings, not {raw!r}")
    if default is None or isinstance(default, bool):
        if isinstance(raw, bool) or (default is None and raw is None):
            return raw
        raise SettingsError(f"kvsidecar connector: {key} must be true or false, not {raw!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise SettingsError(f"kvsidecar connector: {key} must be an integer, not {raw!r}")
    if isinstance(default, float):
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        raise SettingsError(f"kvsidecar connector: {key} must be a number, not {raw!r}")
    if isinstance(raw, str):
        return raw
    raise SettingsError(f"kvsidecar connector: {key} must be a string, not {raw!r}")
