"""The daemon's settings as one frozen `Config`, validated once.

Every setting is declared once in `kvsidecar.node.settings.SETTINGS` with its type, default
and help text; this module parses values from a TOML file, the ``KVSIDECAR_*`` environment and
flags into a `Config`, and checks at import that its fields match the table.

Precedence, lowest to highest: defaults, TOML file, environment, explicit overrides (flags).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvsidecar.memory.fd_limits import FdLimits
from kvsidecar.node.settings import SETTINGS, Setting
from kvsidecar.wire.endpoints import control_endpoint, default_runtime_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting has a value the daemon cannot run with; the message names the setting."""


_BY_NAME = {s.name: s for s in SETTINGS}


def _parse(setting: Setting, raw: object, source: str) -> Any:
    """Convert a raw value (TOML value or env string) to the setting's type."""
    kind = setting.type
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            if isinstance(raw, bool):  # bool is an int subclass; never a count
                raise ValueError(raw)
            if isinstance(raw, str):
                return int(raw.replace("_", ""), 0)
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)  # type: ignore[call-overload]
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)  # type: ignore[arg-type]
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{setting.name} from {source}: {raw!r} is not a valid {kind.__name__}"
        ) from None


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated, immutable daemon settings. Build with `Config.load` or directly.

    The field defaults mirror `SETTINGS`; `__post_init__` checks ranges and fills the derived
    paths (``runtime_dir``, ``endpoint``, ``fd_socket``) so that the rest of the daemon never sees
    an empty path.
    """

    endpoint: str = ""
    runtime_dir: str = ""
    fd_socket: str = ""
    host_pool_bytes: int = 1 << 30
    require_cuda: bool = False
    copy_threads: int = 2
    lease_s: float = 10.0
    drain_timeout_s: float = 10.0
    max_message_bytes: int = 64 << 20
    max_header_bytes: int = 1 << 20
    max_ids_per_command: int = 1 << 20
    fd_wait_s: float = 5.0
    use_uvloop: bool = True
    log_level: str = "info"
    peer_endpoint: str = ""
    peer_data_plane: str = "auto"
    peer_lease_s: float = 60.0
    peer_pull_timeout_s: float = 30.0
    peer_handshake_timeout_s: float = 5.0
    peer_max_in_flight: int = 8
    peer_chunk_bytes: int = 4 << 20
    peer_streams: int = 2
    peer_nixl_wakeup_ms: int = 1
    peer_keep_freed_memory: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    metrics_grace_s: float = 30.0
    allowed_uids: str = ""
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    insecure: bool = False
    max_moves_per_worker: int = 256
    max_moves_total: int = 4096
    checksum: bool = False
    short_move_fast_path: bool = True
    max_layers: int = 1024
    max_host_blocks: int = 1 << 22
    host_pool_user_bytes: int = 0
    max_reply_bytes: int = 64 << 20
    max_connections: int = 1024
    max_connections_per_peer: int = 256
    fd_max_unclaimed: int = 4096
    fd_unclaimed_s: float = 30.0
    cache_bytes: int = 256 << 20
    cache_pin_s: float = 30.0
    cache_dir: str = ""
    cache_disk_bytes: int = 0
    cache_disk_admit: str = "reuse"
    cache_disk_direct: bool = True
    cache_disk_threads: int = 2

    def __post_init__(self) -> None:
        self._fill_paths()
        self._check_finite()
        self._check_core()
        self._check_peer_and_metrics()
        self._check_security_and_limits()

    def _fill_paths(self) -> None:
        """Derive the empty paths from the runtime directory and check what Unix sockets allow."""
        runtime_dir = self.runtime_dir or str(default_runtime_dir())
        object.__setattr__(self, "runtime_dir", runtime_dir)
        if not self.endpoint:
            object.__setattr__(self, "endpoint", control_endpoint(runtime_dir))
        if not self.fd_socket:
            object.__setattr__(self, "fd_socket", f"{runtime_dir}/fd.sock")
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"endpoint must start with ipc:// or tcp://, got {self.endpoint!r}")
        # A Unix socket path longer than sun_path (108 bytes) fails late and obscurely at bind.
        for name, path in (("endpoint", self.ipc_path), ("fd_socket", self.fd_socket)):
            if path is not None and len(path.encode()) > 100:
                raise ConfigError(f"{name} path is too long for a Unix socket: {path!r}")

    def _check_finite(self) -> None:
        """Refuse an infinite or NaN number: as a time or size it would disable a bound."""
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if setting.type is float and not math.isfinite(value):
                raise ConfigError(f"{setting.name} must be a finite number, not {value}")

    def _check_core(self) -> None:
        if self.host_pool_bytes < 0:
            raise ConfigError("host_pool_bytes must be >= 0")
        if self.copy_threads < 1:
            raise ConfigError("copy_threads must be >= 1")
        for name in ("lease_s", "drain_timeout_s", "fd_wait_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.max_header_bytes < 1024:
            raise ConfigError("max_header_bytes must be >= 1024")
        if self.max_message_bytes < self.max_header_bytes:
            raise ConfigError("max_message_bytes must be >= max_header_bytes")
        if self.max_ids_per_command < 1:
            raise ConfigError("max_ids_per_command must be >= 1")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")

    def _check_peer_and_metrics(self) -> None:
        if self.peer_endpoint and not self.peer_endpoint.startswith("tcp://"):
            raise ConfigError(f"peer_endpoint must be tcp://host:port, got {self.peer_endpoint!r}")
        if self.peer_data_plane not in ("auto", "zmq", "nixl"):
            raise ConfigError(
                f"peer_data_plane must be auto, zmq or nixl, got {self.peer_data_plane!r}"
            )
        for name in ("peer_lease_s", "peer_pull_timeout_s", "peer_handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.peer_max_in_flight < 1:
            raise ConfigError("peer_max_in_flight must be >= 1")
        if self.peer_chunk_bytes < 4096:
            raise ConfigError("peer_chunk_bytes must be >= 4096")
        if not 1 <= self.peer_streams <= 64:
            raise ConfigError("peer_streams must be 1..64")
        if not 0 <= self.peer_nixl_wakeup_ms <= 60_000:
            raise ConfigError("peer_nixl_wakeup_ms must be 0..60000")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port must be -1 (off), 0 (any free) or a port, not {self.metrics_port}"
            )
        if not self.metrics_grace_s >= 0:
            raise ConfigError("metrics_grace_s must be >= 0")

    def _check_security_and_limits(self) -> None:
        if self.endpoint.startswith("tcp://") and not (self.curve_secret_key or self.insecure):
            raise ConfigError(
                "a tcp endpoint needs curve_secret_key (see `kvsidecar keygen`) or, knowingly, "
                "insecure"
            )
        if self.peer_endpoint and not (self.curve_secret_key or self.insecure):
            raise ConfigError(
                "a peer_endpoint needs curve_secret_key (see `kvsidecar keygen`) or, knowingly, "
                "insecure"
            )
        if self.max_moves_per_worker < 1 or self.max_moves_total < 1:
            raise ConfigError("max_moves_per_worker and max_moves_total must be >= 1")
        if self.max_layers < 1 or self.max_host_blocks < 0:
            raise ConfigError("max_layers must be >= 1 and max_host_blocks >= 0")
        if self.host_pool_user_bytes < 0:
            raise ConfigError("host_pool_user_bytes must be >= 0 (0: the whole pool)")
        if self.max_reply_bytes < 1 << 20:
            raise ConfigError("max_reply_bytes must be >= 1 MiB")
        try:
            _ = self.fd_limits
        except ValueError as exc:
            raise ConfigError(f"connection and fd limits: {exc}") from None
        if self.cache_bytes < 0:
            raise ConfigError("cache_bytes must be >= 0")
        if not self.cache_pin_s > 0:
            raise ConfigError("cache_pin_s must be > 0")
        self._check_disk_tier()
        try:
            _ = self.uids
        except ValueError:
            raise ConfigError(
                f"allowed_uids must be comma-separated integers, got {self.allowed_uids!r}"
            ) from None

    def _check_disk_tier(self) -> None:
        if self.cache_disk_bytes < 0:
            raise ConfigError("cache_disk_bytes must be >= 0")
        if self.cache_dir and not os.path.isabs(self.cache_dir):
            raise ConfigError(f"cache_dir must be an absolute path, got {self.cache_dir!r}")
        if self.cache_dir and not self.cache_disk_bytes:
            raise ConfigError(
                "cache_dir is set but cache_disk_bytes is 0: give the disk tier a size"
            )
        if self.cache_disk_bytes and not self.cache_dir:
            raise ConfigError("cache_disk_bytes is set but cache_dir is empty: name a directory")
        if self.cache_dir and not self.cache_bytes:
            raise ConfigError("cache_dir needs the prefix cache in memory: cache_bytes > 0")
        if self.cache_disk_admit not in ("reuse", "all"):
            raise ConfigError(
                f"cache_disk_admit must be reuse or all, got {self.cache_disk_admit!r}"
            )
        if not 1 <= self.cache_disk_threads <= 64:
            raise ConfigError("cache_disk_threads must be 1..64")

    @property
    def disk_tier(self) -> bool:
        """Whether the prefix cache has a disk tier (``cache_dir``, and a host pool to cache in)."""
        return bool(self.cache_dir) and self.cache_disk_bytes > 0 and self.host_pool_bytes > 0

    @property
    def uids(self) -> frozenset[int]:
        """The uids allowed on the ipc endpoint and the fd channel (default: our own)."""
        parts = [p.strip() for p in self.allowed_uids.split(",") if p.strip()]
        return frozenset(int(p) for p in parts) if parts else frozenset({os.geteuid()})

    @property
    def fd_limits(self) -> FdLimits:
        """The fd channel's limits (`kvsidecar.memory.fd_limits`) from the ``fd_*`` settings."""
        return FdLimits(
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
            max_unclaimed_fds=self.fd_max_unclaimed,
            max_unclaimed_fds_per_peer=max(1, self.fd_max_unclaimed // 4),
            unclaimed_s=self.fd_unclaimed_s,
            idle_s=self.fd_unclaimed_s / 3,
        )

    @property
    def ipc_path(self) -> str | None:
        """Filesystem path of an ``ipc://`` endpoint, None for tcp."""
        if self.endpoint.startswith("ipc://"):
            return self.endpoint[len("ipc://") :]
        return None

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Config:
        """Build a config from defaults < TOML ``file`` < ``env`` (``KVSIDECAR_*``) < ``overrides``.

        ``env`` defaults to `os.environ`; pass ``{}`` to ignore the environment. Override values
        that are None are skipped, so a CLI can pass every flag and let unset ones fall through.
        Unknown keys in the file or overrides are errors (a typo must not be ignored silently).
        """
        values: dict[str, Any] = {}
        if file is not None:
            with open(file, "rb") as fh:
                try:
                    data = tomllib.load(fh)
                except tomllib.TOMLDecodeError as exc:
                    raise ConfigError(f"{file}: not valid TOML: {exc}") from None
            # Accept both a flat file and one with a [kvsidecar] table.
            table = data.get("kvsidecar", data)
            if not isinstance(table, dict):
                raise ConfigError(f"{file}: [kvsidecar] must be a table")
            for key, raw in table.items():
                setting = _BY_NAME.get(key.replace("-", "_"))
                if setting is None:
                    raise ConfigError(f"{file}: unknown setting {key!r}")
                values[setting.name] = _parse(setting, raw, str(file))
        environ = os.environ if env is None else env
        for setting in SETTINGS:
            if setting.env_var in environ:
                values[setting.name] = _parse(setting, environ[setting.env_var], setting.env_var)
        for key, raw in (overrides or {}).items():
            setting = _BY_NAME.get(key)
            if setting is None:
                raise ConfigError(f"unknown setting {key!r}")
            if raw is not None:
                values[key] = _parse(setting, raw, "override")
        return cls(**values)


def _check_table_matches_fields() -> None:
    """Keep `SETTINGS` and `Config` in step: same names, same defaults."""
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    table = {s.name: s.default for s in SETTINGS}
    if fields != table:  # pragma: no cover - a programming error caught at import
        raise RuntimeError(f"SETTINGS and Config disagree: {fields} vs {table}")


_check_table_matches_fields()
