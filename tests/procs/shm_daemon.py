"""A stand-in daemon: receives fds on a Unix socket (blocking API), maps them, writes a marker.

    python tests/procs/shm_daemon.py CHANNEL_PATH

Prints "ready" once listening. Accepts one connection, receives one fd message, reads one JSON
line from stdin (the handles), maps them, writes 42 into byte 0 of every buffer, prints
"mapped TOKEN_HEX", then waits for stdin to close (or for SIGKILL).
"""

from __future__ import annotations

import os
import socket
import sys

import msgspec

from kvsidecar.memory import ShmHandle, open_shm_all, recv_fds


def main() -> None:
    path = sys.argv[1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    token, fds = recv_fds(conn)
    handles = msgspec.json.decode(sys.stdin.readline(), type=list[ShmHandle])
    buffers = open_shm_all(fds, handles)
    for b in buffers:
        b.flat[0] = 42
    print("mapped", token.hex(), len(os.listdir("/proc/self/fd")), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
