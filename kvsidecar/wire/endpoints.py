"""Where this user's daemon listens when nothing else is said: shared by the daemon and clients.

The daemon's `Config` fills its empty paths from here, and a client without an explicit endpoint
finds the daemon the same way, from the same ``KVSIDECAR_*`` variables, without loading the
daemon's settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """Return the per-user private directory the sockets live in when none is configured."""
    environ = os.environ if env is None else env
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvsidecar"
    return Path(f"/tmp/kvsidecar-{os.getuid()}")


def control_endpoint(runtime_dir: str | os.PathLike[str]) -> str:
    """Return the ipc control endpoint of a daemon whose runtime directory is ``runtime_dir``."""
    return f"ipc://{os.fspath(runtime_dir)}/control.sock"


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    """Return the endpoint a daemon started with this environment listens on.

    ``KVSIDECAR_ENDPOINT`` when set, else the control socket in ``KVSIDECAR_RUNTIME_DIR`` or the
    default runtime directory: the rule `kvsidecar.node.config.Config` applies.
    """
    environ = os.environ if env is None else env
    endpoint = environ.get("KVSIDECAR_ENDPOINT", "")
    if endpoint:
        return endpoint
    return control_endpoint(environ.get("KVSIDECAR_RUNTIME_DIR") or default_runtime_dir(environ))
