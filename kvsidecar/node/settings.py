"""The daemon's settings table: every setting once, with its type, default and help text.

The same table gives the TOML keys, the ``KVSIDECAR_*`` environment variables and (in the CLI)
the command-line flags and ``--help``, so a setting cannot exist in one place and be missing in
another. `kvsidecar.node.config.Config` holds the values, checked against this table at import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ENV_PREFIX = "KVSIDECAR_"
"""Prefix of every environment variable that sets a config value."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One entry of the settings table: name, type, default and a help line.

    A number's ``low`` and ``high`` are the ends (both allowed) of its sensible values: one
    outside them is refused at start.
    """

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None

    @property
    def env_var(self) -> str:
        """The environment variable that sets this value, e.g. ``KVSIDECAR_LEASE_S``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        """The command-line flag that sets this value, e.g. ``--lease-s``."""
        return "--" + self.name.replace("_", "-")


HOUR = 3600.0
DAY = 86400.0
TIB_64 = 1 << 46
"""Upper ends of ranges: a time beyond a day (an hour for waits) or 64 TiB of memory is a typo
or an attempt to switch a bound off, never a setting."""

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
        low=0,
        high=TIB_64,
    ),
    Setting(
        "require_cuda",
        bool,
        False,
        "Refuse to start (exit 3) unless CUDA works and shows a GPU: set it on GPU nodes, so a "
        "daemon that cannot see the GPUs fails at start, not at the first registration.",
    ),
    Setting(
        "copy_threads",
        int,
        2,
        "Threads of the copy executor (moves run concurrently).",
        low=1,
        high=256,
    ),
    Setting(
        "lease_s",
        float,
        10.0,
        "Worker lease: a worker silent for this long is dropped and its mappings released.",
        low=0.01,
        high=DAY,
    ),
    Setting(
        "drain_timeout_s",
        float,
        10.0,
        "On SIGTERM/SIGINT, how long in-flight moves may run before they are failed.",
        low=0.01,
        high=HOUR,
    ),
    Setting(
        "max_message_bytes",
        int,
        64 << 20,
        "Largest accepted request (all frames together); larger ones get a too_large error.",
        low=1024,
        high=1 << 32,
    ),
    Setting(
        "max_header_bytes",
        int,
        1 << 20,
        "Largest accepted request header frame (the msgpack part).",
        low=1024,
        high=1 << 30,
    ),
    Setting(
        "max_ids_per_command",
        int,
        1 << 20,
        "Most block ids one command may carry in one id frame.",
        low=1,
        high=1 << 28,
    ),
    Setting(
        "fd_wait_s",
        float,
        5.0,
        "How long a register waits for its fds to arrive on the fd channel.",
        low=0.01,
        high=HOUR,
    ),
    Setting("use_uvloop", bool, True, "Run the event loop on uvloop when it is installed."),
    Setting("log_level", str, "info", "Logging level: debug, info, warning, error."),
    # Node-to-node transfer, read by the peer service (kvsidecar/peer/).
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
        low=0.01,
        high=DAY,
    ),
    Setting(
        "peer_pull_timeout_s",
        float,
        30.0,
        "Bound on one pull (handshake and data); past it the request is failed.",
        low=0.01,
        high=DAY,
    ),
    Setting(
        "peer_handshake_timeout_s",
        float,
        5.0,
        "Bound on the handshake with a remote daemon (an unreachable peer fails this fast).",
        low=0.01,
        high=HOUR,
    ),
    Setting(
        "peer_max_in_flight",
        int,
        8,
        "Read chunks in flight per remote daemon on the ZMQ plane.",
        low=1,
        high=4096,
    ),
    Setting(
        "peer_chunk_bytes",
        int,
        4 << 20,
        "Bytes per read chunk on the ZMQ plane (one request/reply message).",
        low=4096,
        high=1 << 30,
    ),
    Setting(
        "peer_streams",
        int,
        2,
        "Data connections per remote daemon on the ZMQ plane, each received on its own thread "
        "(ZeroMQ I/O threads: as many); a pull's chunks are spread over them.",
        low=1,
        high=64,
    ),
    Setting(
        "peer_nixl_wakeup_ms",
        int,
        1,
        "How often NIXL's UCX progress thread wakes when no event woke it (ms; it sleeps on "
        "the UCX workers' event fds otherwise). 0: NIXL's own default, a busy poll of a core.",
        low=0,
        high=60_000,
    ),
    Setting(
        "peer_keep_freed_memory",
        bool,
        True,
        "Have glibc keep freed memory for reuse (raised mmap/trim thresholds), so that large "
        "ZeroMQ messages land in warm pages rather than fresh ones.",
    ),
    Setting(
        "peers",
        str,
        "",
        "Comma-separated peer endpoints (tcp://host:port) this daemon may pull from; a pull "
        "naming another is refused (forbidden). Empty: any endpoint that passes the peer "
        "endpoint rule (docs/operations.md).",
    ),
    Setting(
        "peer_max_links",
        int,
        64,
        "Connections to other daemons held at once, each with its data streams (the configured "
        "peers come on top); past it the least recently used idle one is closed, or, when all "
        "are busy, a pull to a new endpoint is refused (busy).",
        low=1,
        high=1024,
    ),
    Setting(
        "peer_link_idle_s",
        float,
        300.0,
        "A connection to another daemon that no pull used for this long is closed.",
        low=0.01,
        high=DAY,
    ),
    Setting(
        "peer_nixl_trusted",
        bool,
        False,
        "Allow the NIXL data plane. UCX (NIXL's transport) does not confine a peer to the "
        "blocks a daemon publishes: a daemon that holds another's NIXL metadata can read any of "
        "its memory (docs/reliability.md). Set it only where every daemon that can reach this "
        "one is trusted with all of its memory; unset, NIXL is refused (auto uses ZMQ).",
    ),
    # The metrics endpoint (kvsidecar/daemon/metrics/).
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
        low=-1,
        high=65535,
    ),
    Setting(
        "metrics_grace_s",
        float,
        30.0,
        "How long a departed engine's metric series stay (two scrape intervals or more).",
        low=0,
        high=DAY,
    ),
    # Who may connect (kvsidecar/node/auth.py), how many moves may queue
    # (kvsidecar/daemon/limits/admission.py), and how moves are checked.
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
        low=1,
        high=1 << 20,
    ),
    Setting(
        "max_moves_total",
        int,
        4096,
        "Moves and fixes queued or running on the daemon (one user's engines: an equal share per "
        "allowed uid); beyond it commands get a busy error.",
        low=1,
        high=1 << 24,
    ),
    Setting(
        "checksum",
        bool,
        False,
        "Verify every move end to end with a CRC32 at source and destination (a Move may ask "
        "for it on its own).",
    ),
    Setting(
        "short_move_fast_path",
        bool,
        True,
        "Answer short plain CPU moves (at most 16 ids, no layout fix or checksum) in one step "
        "on the event loop, with the same checks and bookkeeping as every move; false sends "
        "them through the general command path (docs/architecture.md).",
    ),
    # Limits on sizes from the wire and on what one user may hold.
    Setting(
        "max_layers",
        int,
        1024,
        "Most layers one registration may carry; more get a too_large error.",
        low=1,
        high=1 << 16,
    ),
    Setting(
        "max_host_blocks",
        int,
        1 << 22,
        "Most host blocks one engine may declare (host_blocks); more get a too_large error.",
        low=0,
        high=1 << 31,
    ),
    Setting(
        "host_pool_user_bytes",
        int,
        0,
        "Most host-pool bytes the host mirrors and cache namespaces of one user (uid, or CURVE "
        "key) may hold together; beyond it a registration or a new namespace gets "
        "pool_exhausted. 0: an equal share of the pool per allowed uid (the whole pool with one).",
        low=0,
        high=TIB_64,
    ),
    Setting(
        "max_reply_bytes",
        int,
        64 << 20,
        "Bytes of large replies (64 KiB and up) the daemon holds for clients that have not read "
        "them yet, all connections together (one user: an equal share per allowed uid); beyond "
        "it such requests get a busy error.",
        low=1 << 20,
        high=1 << 40,
    ),
    # Connection limits (kvsidecar/memory/fd_limits.py, kvsidecar/daemon/limits/connections.py).
    Setting(
        "max_connections",
        int,
        1024,
        "Connections in total on the control socket, and on the fd channel (each; also capped "
        "by the open-files limit; one user: an equal share per allowed uid).",
        low=1,
        high=1 << 20,
    ),
    Setting(
        "max_connections_per_peer",
        int,
        256,
        "Connections one process (uid, pid; an IP on tcp) may hold on the control socket, and on "
        "the fd channel; more are refused.",
        low=1,
        high=1 << 20,
    ),
    Setting(
        "fd_max_unclaimed",
        int,
        4096,
        "Fds received and not yet claimed by a registration, in total (a quarter per process, an "
        "equal share per allowed uid).",
        low=1,
        high=1 << 20,
    ),
    Setting(
        "fd_unclaimed_s",
        float,
        30.0,
        "How long received fds wait for their registration before they are closed.",
        low=0.01,
        high=HOUR,
    ),
    # The prefix cache (kvsidecar/daemon/cache/prefix.py).
    Setting(
        "cache_bytes",
        int,
        256 << 20,
        "Host-pool bytes the node's shared prefix cache may hold, all namespaces together "
        "(taken from the pool as engines store; one user's: an equal share per allowed uid; 0 "
        "disables the cache).",
        low=0,
        high=TIB_64,
    ),
    Setting(
        "cache_pin_s",
        float,
        30.0,
        "Longest a lookup's pin keeps blocks from eviction before the engine loads them.",
        low=0.01,
        high=DAY,
    ),
    # The prefix cache's disk tier (kvsidecar/daemon/cache/disk.py).
    Setting(
        "cache_dir",
        str,
        "",
        "Directory of the prefix cache's disk tier, below the host pool (created mode 0700, "
        "owned by the daemon's uid; never through a symbolic link). Empty: no disk tier.",
    ),
    Setting(
        "cache_disk_bytes",
        int,
        0,
        "Bytes the disk tier may take in cache_dir, all namespaces together (each namespace's "
        "file is allocated whole when it is made). Required with cache_dir.",
        low=0,
        high=1 << 50,
    ),
    Setting(
        "cache_disk_admit",
        str,
        "reuse",
        "Which blocks the disk tier writes: reuse (a block once it is used a second time, "
        "loaded or stored again: blocks evicted from memory before that never reach the "
        "device) or all (every block as it is stored).",
    ),
    Setting(
        "cache_disk_direct",
        bool,
        True,
        "Read and write the disk tier with O_DIRECT (no second copy of the blocks in the page "
        "cache); buffered I/O where the file system refuses it.",
    ),
    Setting(
        "cache_disk_threads",
        int,
        2,
        "Threads doing the disk tier's file I/O and checksums (never the event loop or the "
        "copy threads).",
        low=1,
        high=64,
    ),
)
"""Every setting of the daemon, in the order ``--help`` lists them."""
