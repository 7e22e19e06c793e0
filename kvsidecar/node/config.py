"""The daemon's settings as one frozen `Config`, validated once.

Every setting is declared once in `kvsidecar.node.settings.SETTINGS` with its type, default
and help text; this module parses values from a TOML file, the ``KVSIDECAR_*`` environment and
flags into a `Config`, and checks at import that its fields match the table.

Precedence, lowest to highest: defaults, TOML file, environment, explicit overrides (flags).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from kvsidecar.memory.fd_limits import FdLimits
from kvsidecar.node.settings import SETTINGS, Setting
from kvsidecar.wire.curve import KeyFileError, load_authorized_keys, load_keypair
from kvsidecar.wire.endpoints import (
    canonical_peer_endpoint,
    control_endpoint,
    default_runtime_dir,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting has a value the daemon cannot run with; the message names the setting."""


_BY_NAME = {s.name: s for s in SETTINGS}
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


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
        if not isinstance(raw, str):  # a TOML number, list or table where words belong
            raise TypeError(raw)
        return raw
    except (TypeError, ValueError):
        raise ConfigError(f"{setting.name} from {source}: {raw!r} is not {_KINDS[kind]}") from None


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
    peers: str = ""
    peer_max_links: int = 64
    peer_link_idle_s: float = 300.0
    peer_nixl_trusted: bool = False
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
        self._check_numbers()
        self._check_words()
        self._check_together()

    def _fill_paths(self) -> None:
        """Derive the empty paths from the runtime directory and check what Unix sockets allow."""
        runtime_dir = self.runtime_dir or str(default_runtime_dir())
        _check_path("runtime_dir", runtime_dir)  # before the paths derived from it
        object.__setattr__(self, "runtime_dir", runtime_dir)
        if not self.endpoint:
            object.__setattr__(self, "endpoint", control_endpoint(runtime_dir))
        if not self.fd_socket:
            object.__setattr__(self, "fd_socket", f"{runtime_dir}/fd.sock")
        _check_endpoint("endpoint", self.endpoint, ("ipc", "tcp"))
        _check_path("fd_socket", self.fd_socket)
        # A Unix socket path longer than sun_path (108 bytes) fails late and obscurely at bind.
        for name, path in (("endpoint", self.ipc_path), ("fd_socket", self.fd_socket)):
            if path is not None and len(path.encode()) > 100:
                raise ConfigError(f"{name} path is too long for a Unix socket: {path!r}")

    def _check_numbers(self) -> None:
        """Refuse a number outside its setting's range (`Setting.low`, `Setting.high`).

        Infinity and NaN are outside every range: as a time or a size they would switch a bound
        off; so is a time beyond a day or a size beyond what a node holds.
        """
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if setting.low is None or setting.high is None:
                continue
            if not (math.isfinite(value) and setting.low <= value <= setting.high):
                raise ConfigError(
                    f"{setting.name} must be a number from {_number(setting.low)} to "
                    f"{_number(setting.high)}, not {value!r}"
                )

    def _check_words(self) -> None:
        """Refuse a word or name the daemon would misread (levels, planes, hosts, uids, keys)."""
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")
        if self.peer_endpoint:
            _check_endpoint("peer_endpoint", self.peer_endpoint, ("tcp",))
        if self.peer_data_plane not in ("auto", "zmq", "nixl"):
            raise ConfigError(
                f"peer_data_plane must be auto, zmq or nixl, got {self.peer_data_plane!r}"
            )
        for peer in self.peer_list:
            try:
                canonical_peer_endpoint(peer)
            except ValueError as exc:
                raise ConfigError(f"peers: {peer[:80]!r}: {exc}") from None
        if not _is_host(self.metrics_host):
            raise ConfigError(
                f"metrics_host must be an IP address or a host name, got {self.metrics_host!r}"
            )
        try:
            _ = self.uids
        except ValueError:
            raise ConfigError(
                f"allowed_uids must be comma-separated uids (0 to {_MAX_UID}), got "
                f"{self.allowed_uids!r}"
            ) from None
        # Key files named are read now: a missing or bad one must not wait for the first tcp
        # connection to be noticed (or, with an ipc endpoint, go unnoticed).
        try:
            if self.curve_secret_key:
                load_keypair(self.curve_secret_key)
            if self.curve_authorized_keys:
                load_authorized_keys(self.curve_authorized_keys)
        except KeyFileError as exc:
            raise ConfigError(str(exc)) from None

    def _check_together(self) -> None:
        """Refuse settings that contradict each other."""
        if self.peer_data_plane == "nixl" and not self.peer_nixl_trusted:
            raise ConfigError(
                "peer_data_plane=nixl needs peer_nixl_trusted: NIXL lets a peer read any of "
                "this daemon's memory (docs/reliability.md)"
            )
        if self.max_message_bytes < self.max_header_bytes:
            raise ConfigError("max_message_bytes must be >= max_header_bytes")
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
        try:
            _ = self.fd_limits
        except ValueError as exc:
            raise ConfigError(f"connection and fd limits: {exc}") from None
        self._check_disk_tier()

    def _check_disk_tier(self) -> None:
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

    @property
    def disk_tier(self) -> bool:
        """Whether the prefix cache has a disk tier (``cache_dir``, and a host pool to cache in)."""
        return bool(self.cache_dir) and self.cache_disk_bytes > 0 and self.host_pool_bytes > 0

    @property
    def uids(self) -> frozenset[int]:
        """The uids allowed on the ipc endpoint and the fd channel (default: our own).

        `ValueError` for anything but comma-separated uids (no empty item).
        """
        if not self.allowed_uids.strip():
            return frozenset({os.geteuid()})
        uids = [int(p.strip(), 10) for p in self.allowed_uids.split(",")]
        if not all(0 <= uid <= _MAX_UID for uid in uids):
            raise ValueError(self.allowed_uids)
        return frozenset(uids)

    @property
    def users(self) -> int:
        """How many users share the daemon's totals: the allowed uids.

        Each user's connections, unclaimed fds, moves in flight, large replies, host-pool bytes
        and cache namespaces are bounded by an equal share of the daemon's total, all its
        processes and engines together, so that no user can take the room another needs.
        """
        return len(self.uids)

    @property
    def user_pool_bytes(self) -> int:
        """Host-pool bytes one user's host mirrors and cache namespaces may hold together.

        ``host_pool_user_bytes``, or when it is 0 an equal share of the pool per allowed uid
        (the whole pool when only one is allowed).
        """
        return self.host_pool_user_bytes or self.host_pool_bytes // self.users

    @property
    def user_cache_bytes(self) -> int:
        """Bytes of ``cache_bytes`` one user's namespaces may hold.

        An equal share per allowed uid (all of it when only one is allowed).
        """
        return self.cache_bytes // self.users

    @property
    def user_disk_bytes(self) -> int:
        """Bytes of ``cache_disk_bytes`` one user's namespaces may hold on disk.

        An equal share per allowed uid (all of it when only one is allowed), as in memory.
        """
        return self.cache_disk_bytes // self.users

    @property
    def fd_limits(self) -> FdLimits:
        """The fd channel's limits (`kvsidecar.memory.fd_limits`) from the ``fd_*`` settings."""
        return FdLimits(
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
            max_unclaimed_fds=self.fd_max_unclaimed,
            max_unclaimed_fds_per_peer=max(1, self.fd_max_unclaimed // 4),
            max_connections_per_user=max(1, self.max_connections // self.users),
            max_unclaimed_fds_per_user=max(1, self.fd_max_unclaimed // self.users),
            unclaimed_s=self.fd_unclaimed_s,
            idle_s=self.fd_unclaimed_s / 3,
        )

    @property
    def peer_list(self) -> tuple[str, ...]:
        """The ``peers`` setting as a tuple of endpoints, as written (empty entries dropped)."""
        return tuple(p.strip() for p in self.peers.split(",") if p.strip())

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
                values[key] = _parse(setting, raw, setting.flag)
        return cls(**values)


_MAX_UID = (1 << 32) - 2
"""The largest uid (``(uid_t) -1`` means none)."""
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _number(value: float) -> str:
    """Write a range's end as people do (``1048576``, ``0.01``, ``86400``)."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def _is_host(host: str) -> bool:
    """Whether ``host`` is an IP address, or a host name made of valid labels (not all digits)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return True
    labels = host.rstrip(".").split(".")
    return (
        0 < len(host) <= 253
        and all(_HOST_LABEL.match(label) for label in labels)
        and not labels[-1].isdigit()
    )


def _check_path(name: str, path: str) -> None:
    """Refuse a relative path or one with a NUL: a daemon's sockets must not move with its cwd."""
    if not os.path.isabs(path) or "\0" in path:
        raise ConfigError(f"{name} must be an absolute path, got {path!r}")


def _check_endpoint(name: str, endpoint: str, schemes: tuple[str, ...]) -> None:
    """Refuse an endpoint that is not ``ipc://<absolute path>`` or ``tcp://<host>:<port>``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in schemes:
        spelled = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{name} must start with {spelled}, got {endpoint!r}")
    if scheme == "ipc":
        _check_path(name, rest)
        return
    host, colon, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (colon and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{name} must be tcp://<host>:<port 1-65535>, got {endpoint!r}")
    if host != "*" and not _is_host(host):
        raise ConfigError(f"{name}: {host!r} is neither an IP address nor a host name")


def _check_table_matches_fields() -> None:
    """Keep `SETTINGS` and `Config` in step: same names, same defaults."""
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    table = {s.name: s.default for s in SETTINGS}
    if fields != table:  # pragma: no cover - a programming error caught at import
        raise RuntimeError(f"SETTINGS and Config disagree: {fields} vs {table}")
    for s in SETTINGS:  # every number has its range
        if s.type in (int, float) and (s.low is None or s.high is None):  # pragma: no cover
            raise RuntimeError(f"setting {s.name} has no range")


_check_table_matches_fields()
