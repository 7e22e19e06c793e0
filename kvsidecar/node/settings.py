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
    Setting(
        "require_cuda",
        bool,
        False,
        "Refuse to start (exit 3) unless CUDA works and shows a GPU: set it on GPU nodes, so a "
        "daemon that cannot see the GPUs fails at start, not at the first registration.",
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
    Setting(
        "peer_streams",
        int,
        2,
        "Data connections per remote daemon on the ZMQ plane, each received on its own thread "
        "(ZeroMQ I/O threads: as many); a pull's chunks are spread over them.",
    ),
    Setting(
        "peer_nixl_wakeup_ms",
        int,
        1,
        "How often NIXL's UCX progress thread wakes when no event woke it (ms; it sleeps on "
        "the UCX workers' event fds otherwise). 0: NIXL's own default, a busy poll of a core.",
    ),
    Setting(
        "peer_keep_freed_memory",
        bool,
        True,
        "Have glibc keep freed memory for reuse (raised mmap/trim thresholds), so that large "
        "ZeroMQ messages land in warm pages rather than fresh ones.",
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
    ),
    Setting(
        "metrics_grace_s",
        float,
        30.0,
        "How long a departed engine's metric series stay (two scrape intervals or more).",
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
    ),
    Setting(
        "max_host_blocks",
        int,
        1 << 22,
        "Most host blocks one engine may declare (host_blocks); more get a too_large error.",
    ),
    Setting(
        "host_pool_user_bytes",
        int,
        0,
        "Most host-pool bytes the host mirrors of one user (uid, or CURVE key) may hold; beyond "
        "it a registration gets pool_exhausted. 0: the whole pool. Set it when allowed_uids "
        "admits other users.",
    ),
    Setting(
        "max_reply_bytes",
        int,
        64 << 20,
        "Bytes of large replies (64 KiB and up) the daemon holds for clients that have not read "
        "them yet, all connections together; beyond it such requests get a busy error.",
    ),
    # Connection limits (kvsidecar/memory/fd_limits.py, kvsidecar/daemon/limits/connections.py).
    Setting(
        "max_connections",
        int,
        1024,
        "Connections in total on the control socket, and on the fd channel (each; also capped "
        "by the open-files limit).",
    ),
    Setting(
        "max_connections_per_peer",
        int,
        256,
        "Connections one process (uid, pid; an IP on tcp) may hold on the control socket, and on "
        "the fd channel; more are refused.",
    ),
    Setting(
        "fd_max_unclaimed",
        int,
        4096,
        "Fds received and not yet claimed by a registration, in total (a quarter per process).",
    ),
    Setting(
        "fd_unclaimed_s",
        float,
        30.0,
        "How long received fds wait for their registration before they are closed.",
    ),
    # The prefix cache (kvsidecar/daemon/cache/prefix.py).
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
    ),
)
"""Every setting of the daemon, in the order ``--help`` lists them."""
