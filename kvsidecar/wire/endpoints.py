"""Where daemons listen: this user's daemon, and the peer endpoints of other daemons.

Where this user's daemon listens when nothing else is said is shared by the daemon and clients:
the daemon's `Config` fills its empty paths from here, and a client without an explicit endpoint
finds the daemon the same way, from the same ``KVSIDECAR_*`` variables, without loading the
daemon's settings. `canonical_peer_endpoint` is the rule an endpoint of another daemon must
pass before a daemon connects to it.
"""

from __future__ import annotations

import ipaddress
import os
import re
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


MAX_PEER_ENDPOINT = 256
"""Longest peer endpoint accepted (a DNS name is at most 253 characters)."""
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def canonical_peer_endpoint(endpoint: str) -> str:
    """Return ``endpoint`` as one spelling of ``tcp://host:port``, or raise `ValueError` saying why.

    The rule for an endpoint a daemon may connect to (a pull names it; the ``peers`` setting
    lists them): ``tcp://`` then an IPv4 address in dotted-quad form, an IPv6 address in brackets
    or a DNS name, then ``:`` and a port 1-65535. Nothing else libzmq would accept: no source
    address (``tcp://src:port;host:port``), no interface name, no wildcard, no unspecified
    address. The spelling returned is lower case, with the address in its standard form and the
    port without leading zeros, so that trivially different spellings are one endpoint.
    """
    if len(endpoint) > MAX_PEER_ENDPOINT:
        raise ValueError(f"longer than {MAX_PEER_ENDPOINT} characters")
    if not endpoint.startswith("tcp://"):
        raise ValueError("not tcp://host:port")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("no port 1-65535 after the host")
    if host.startswith("[") and host.endswith("]"):
        try:
            v6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host!r} is no IPv6 address") from None
        if v6.is_unspecified or v6.is_multicast:
            raise ValueError(f"{host!r} is no address of one host")
        return f"tcp://[{v6.compressed}]:{int(port)}"
    if host and all(part.isascii() and part.isdigit() for part in host.split(".")):
        try:
            v4 = ipaddress.IPv4Address(host)  # dotted quad only: "127.1" is refused
        except ValueError:
            raise ValueError(f"{host!r} is no IPv4 address in dotted-quad form") from None
        if v4.is_unspecified or v4.is_multicast or v4 == ipaddress.IPv4Address("255.255.255.255"):
            raise ValueError(f"{host!r} is no address of one host")
        return f"tcp://{v4}:{int(port)}"
    name = host.lower().removesuffix(".")
    if not 0 < len(name) <= 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"{host[:64]!r} is no IP address or DNS name")
    return f"tcp://{name}:{int(port)}"
