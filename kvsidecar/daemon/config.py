"""The daemon's settings: one table, one frozen `Config`, validated once.

Every setting is declared once in `SETTINGS` with its type, default and help text. The same table
gives the TOML keys, the ``KVSIDECAR_*`` environment variables and (in the CLI) the command-line
flags and ``--help``, so a setting cannot exist in one place and be missing in another.

Precedence, lowest to highest: defaults, TOML file, environment, explicit overrides (flags).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvsidecar.wire.endpoints import control_endpoint, default_runtime_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "KVSIDECAR_"
"""Prefix of every environment variable that sets a config value."""


class ConfigError(ValueError):
    """A setting has a value the daemon cannot run with; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One entry of the settings table: name, type, default and a help line."""

    name: str
    type: type
    default: Any
    help: str

    @property
    def env_var(self) -> str:
        """The environment variable that sets this value, e.g. ``KVSIDECAR_LEASE_S``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        """The command-line flag that sets this value, e.g. ``--lease-s``."""
        return "--" + self.name.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "endpoint",
        str,
        "",
        "ZeroMQ control endpoint (ipc:// or tcp://). Empty: ipc://<runtime_dir>/control.sock.",
    ),
    Setting(
        "runtime_dir",
        str,
        "",
        "Private directory (mode 0700) for the ipc and fd-channel sockets. Empty: "
        "$XDG_RUNTIME_DIR/kvsidecar, else /tmp/kvsidecar-<uid>.",
    ),
    Setting(
        "fd_socket",
        str,
        "",
        "Unix socket on which workers pass shared-memory fds. Empty: <runtime_dir>/fd.sock.",
    ),
    Setting(
        "host_pool_bytes",
        int,
        1 << 30,
        "Bytes of the daemon-owned host block pool, allocated and touched at start.",
    ),
    Setting("copy_threads", int, 2, "Threads of the copy executor (moves run concurrently)."),
    Setting(
        "lease_s",
        float,
        10.0,
        "Worker lease: a worker silent for this long is dropped and its mappings released.",
    ),
    Setting(
        "drain_timeout_s",
        float,
        10.0,
        "On SIGTERM/SIGINT, how long in-flight moves may run before they are failed.",
    ),
    Setting(
        "max_message_bytes",
        int,
        64 << 20,
        "Largest accepted request (all frames together); larger ones get a too_large error.",
    ),
    Setting(
        "max_header_bytes",
        int,
        1 << 20,
        "Largest accepted request header frame (the msgpack part).",
    ),
    Setting(
        "max_ids_per_command",
        int,
        1 << 20,
        "Most block ids one command may carry in one id frame.",
    ),
    Setting(
        "fd_wait_s",
        float,
        5.0,
        "How long a register waits for its fds to arrive on the fd channel.",
    ),
    Setting("use_uvloop", bool, True, "Run the event loop on uvloop when it is installed."),
    Setting("log_level", str, "info", "Logging level: debug, info, warning, error."),
    # --- peer (node-to-node transfer, kvsidecar/peer/) ---
    Setting(
        "peer_endpoint",
        str,
        "",
        "tcp://host:port on which other daemons pull this node's blocks. Empty: no peer "
        "endpoint (this daemon can still pull from others).",
    ),
    Setting(
        "peer_data_plane",
        str,
        "auto",
        "How block bytes travel between daemons: nixl, zmq, or auto (NIXL when installed and "
        "working and a peer endpoint is set, else ZMQ).",
    ),
    Setting(
        "peer_lease_s",
        float,
        60.0,
        "How long published blocks are held for a remote reader that never comes.",
    ),
    Setting(
        "peer_pull_timeout_s",
        float,
        30.0,
        "Bound on one pull (handshake and data); past it the request is failed.",
    ),
    Setting(
        "peer_handshake_timeout_s",
        float,
        5.0,
        "Bound on the handshake with a remote daemon (an unreachable peer fails this fast).",
    ),
    Setting(
        "peer_max_in_flight",
        int,
        8,
        "Read chunks in flight per remote daemon on the ZMQ plane.",
    ),
    Setting(
        "peer_chunk_bytes",
        int,
        4 << 20,
        "Bytes per read chunk on the ZMQ plane (one request/reply message).",
    ),
    # --- metrics endpoint (kvsidecar/observability.py) ---
    Setting(
        "metrics_host",
        str,
        "127.0.0.1",
        "Address of the HTTP endpoint serving /metrics, /healthz and /readyz.",
    ),
    Setting(
        "metrics_port",
        int,
        9464,
        "Port of the HTTP endpoint; 0 picks a free port (logged, and in status), -1 disables it.",
    ),
    Setting(
        "metrics_grace_s",
        float,
        30.0,
        "How long a departed engine's metric series stay (two scrape intervals or more).",
    ),
    # --- reliability and security (kvsidecar/auth.py, access.py, admission.py) ---
    Setting(
        "allowed_uids",
        str,
        "",
        "Comma-separated uids that may connect to the ipc endpoint and the fd channel. Empty: "
        "the daemon's own uid only.",
    ),
    Setting(
        "curve_secret_key",
        str,
        "",
        "CurveZMQ secret key file of this daemon (from `kvsidecar keygen`); required for a tcp "
        "endpoint unless insecure.",
    ),
    Setting(
        "curve_authorized_keys",
        str,
        "",
        "File or directory of the CurveZMQ public keys allowed to connect over tcp. Empty: only "
        "this daemon's own public key.",
    ),
    Setting(
        "insecure",
        bool,
        False,
        "Allow plain tcp without CurveZMQ (anyone who reaches the port is trusted). Logged and "
        "exported as kvsidecar_insecure_transport.",
    ),
    Setting(
        "max_moves_per_worker",
        int,
        256,
        "Moves and fixes queued or running per worker; beyond it commands get a busy error.",
    ),
    Setting(
        "max_moves_total",
        int,
        4096,
        "Moves and fixes queued or running on the daemon; beyond it commands get a busy error.",
    ),
    Setting(
        "checksum",
        bool,
        False,
        "Verify every move end to end with a CRC32 at source and destination (a Move may ask "
        "for it on its own).",
    ),
    # --- prefix cache (kvsidecar/daemon/cache.py) ---
    Setting(
        "cache_bytes",
        int,
        256 << 20,
        "Host-pool bytes the node's shared prefix cache may hold, all namespaces together "
        "(taken from the pool as engines store; 0 disables the cache).",
    ),
    Setting(
        "cache_pin_s",
        float,
        30.0,
        "Longest a lookup's pin keeps blocks from eviction before the engine loads them.",
    ),
)
"""Every setting of the daemon, in the order ``--help`` lists them."""

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
    copy_threads: int = 2
    lease_s: float = 10.0
    drain_timeout_s: float = 10.0
    max_message_bytes: int = 64 << 20
    max_header_bytes: int = 1 << 20
    max_ids_per_command: int = 1 << 20
    fd_wait_s: float = 5.0
    use_uvloop: bool = True
    log_level: str = "info"
    # --- peer (node-to-node transfer) ---
    peer_endpoint: str = ""
    peer_data_plane: str = "auto"
    peer_lease_s: float = 60.0
    peer_pull_timeout_s: float = 30.0
    peer_handshake_timeout_s: float = 5.0
    peer_max_in_flight: int = 8
    peer_chunk_bytes: int = 4 << 20
    # --- metrics endpoint ---
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    metrics_grace_s: float = 30.0
    # --- reliability and security ---
    allowed_uids: str = ""
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    insecure: bool = False
    max_moves_per_worker: int = 256
    max_moves_total: int = 4096
    checksum: bool = False
    # --- prefix cache ---
    cache_bytes: int = 256 << 20
    cache_pin_s: float = 30.0

    def __post_init__(self) -> None:
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
        # --- peer (node-to-node transfer) ---
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
        # --- metrics endpoint ---
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port must be -1 (off), 0 (any free) or a port, not {self.metrics_port}"
            )
        if not self.metrics_grace_s >= 0:
            raise ConfigError("metrics_grace_s must be >= 0")
        # --- reliability and security ---
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
        # --- prefix cache ---
        if self.cache_bytes < 0:
            raise ConfigError("cache_bytes must be >= 0")
        if not self.cache_pin_s > 0:
            raise ConfigError("cache_pin_s must be > 0")
        try:
            _ = self.uids
        except ValueError:
            raise ConfigError(
                f"allowed_uids must be comma-separated integers, got {self.allowed_uids!r}"
            ) from None

    @property
    def uids(self) -> frozenset[int]:
        """The uids allowed on the ipc endpoint and the fd channel (default: our own)."""
        parts = [p.strip() for p in self.allowed_uids.split(",") if p.strip()]
        return frozenset(int(p) for p in parts) if parts else frozenset({os.geteuid()})

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
