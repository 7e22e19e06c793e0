"""The daemon's id: how its peers and its engines' connectors tell it from every other daemon.

Minted once per process by the daemon and handed to what speaks for it (the peer service's
handshakes, the NIXL agent's name, ``hello`` replies). Host, pid and a random suffix: unique
across nodes and across restarts that reuse a pid.
"""

from __future__ import annotations

import os
import socket
import uuid


def mint_daemon_id() -> str:
    """Return a fresh daemon id, ``<host>-<pid>-<8 hex digits>``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
