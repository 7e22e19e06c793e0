"""TCP ports for test servers: one way to get one, and a way to tell when it was taken anyway.

A port found free and bound later by someone else can be taken in between (by a parallel test
run, or by the kernel for an outgoing connection). `reserve_port` makes that window all but
shut: the port it returns sits in TIME_WAIT, which keeps the kernel from handing it out for about
a minute, while a server that binds it with ``SO_REUSEADDR`` (libzmq, asyncio and uvloop,
Prometheus: all of them do) still can. What is left of the race is covered by retrying the start
with a fresh port when `is_port_clash` or `port_taken` says the bind failed
(`tests.support.daemons` does that for every daemon it starts).
"""

from __future__ import annotations

import errno
import socket

HOST = "127.0.0.1"


def reserve_port() -> int:
    """A loopback TCP port nobody listens on, kept out of the kernel's hands for about a minute.

    Also the address to use where a test needs one that refuses connections.
    """
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOST, 0))
        server.listen(1)
        port = int(server.getsockname()[1])
        with socket.create_connection((HOST, port)):
            accepted, _ = server.accept()
            # The side that closes first keeps the TIME_WAIT entry: here the server's port.
            accepted.close()
    return port


def tcp_endpoint() -> str:
    """A ZeroMQ ``tcp://`` endpoint on a reserved loopback port."""
    return f"tcp://{HOST}:{reserve_port()}"


def port_taken(port: int) -> bool:
    """Whether some socket listens on (or holds) ``port`` now, as a server's bind would find it."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def is_port_clash(error: BaseException | str) -> bool:
    """Whether a failed start (its exception, or a log) says its address was already in use."""
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return True
    if getattr(error, "errno", None) == errno.EADDRINUSE:  # zmq.ZMQError is no OSError
        return True
    return "address already in use" in str(error).lower()
