"""A client that drops to another uid before it touches the daemon (tests of the uid checks).

Run as root: ``python -m tests.procs.uid_client <uid> <control endpoint> <fd socket>``. It
imports everything first (the venv may not be readable by that uid), drops to ``uid`` (and its
gid), then tries the fd channel and a ZMQ hello, and prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import msgspec
import zmq

from kvsidecar.wire.protocol import PROTOCOL_VERSION, Hello, Reply


def main() -> None:
    uid, endpoint, fd_socket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    out: dict[str, object] = {"uid": os.getuid()}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(fd_socket)
        # A refused peer is closed by the daemon right after accept: EOF comes quickly.
        s.settimeout(1.0)
        try:
            out["fd"] = "closed" if s.recv(1) == b"" else "data"
        except TimeoutError:
            out["fd"] = "open"
    except OSError as exc:
        out["fd"] = type(exc).__name__
    finally:
        s.close()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(msgspec.msgpack.encode(Hello(id=1, protocol_version=PROTOCOL_VERSION)))
    t0 = time.monotonic()
    if sock.poll(2000, zmq.POLLIN):
        reply = msgspec.msgpack.decode(sock.recv(), type=Reply)
        out["zmq"] = type(reply).__name__
    else:
        out["zmq"] = "no reply"
    out["waited_s"] = round(time.monotonic() - t0, 3)
    sock.close()
    ctx.term()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
