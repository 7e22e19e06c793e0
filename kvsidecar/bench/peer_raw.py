"""The raw baselines of ``bench peer``, each in processes of its own, driven over stdin/stdout.

``python -m kvsidecar.bench.peer_raw zmq-recv <nbytes> <frame> <keep>``: a receiver. It binds
a PULL socket on loopback TCP, touches a destination buffer of ``nbytes``, starts its sender
(``zmq-send``) and prints ``ready``; then for each ``go`` line it has the sender stream
``nbytes`` in ``frame``-byte zero-copy frames, receives them into the buffer with ``recv_into``
and prints the seconds it took. ``keep`` 1: first apply the daemon's glibc settings
(`kvsidecar.wire.zmq_memory.keep_freed_memory`), so that the plane is compared with a raw
stream that has them too. The connection stays up between streams, as the plane's does.

``python -m kvsidecar.bench.peer_raw zmq-send <endpoint> <nbytes> <frame>``: the sender: one
preallocated, touched buffer; a stream per ``go`` line.

``python -m kvsidecar.bench.peer_raw nixl-target <nbytes>``: register a touched buffer with a
NIXL agent, print its metadata (hex) and address, then wait for EOF.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np


def zmq_send(endpoint: str, nbytes: int, frame: int) -> None:
    """Stream ``nbytes`` per ``go`` line on stdin; see the module docstring."""
    import zmq

    buf = np.ones(nbytes, dtype=np.uint8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        for off in range(0, nbytes, frame):
            sock.send(buf[off : off + frame].data, copy=False)
    sock.close(linger=1000)
    ctx.term()


def zmq_recv(nbytes: int, frame: int, keep: bool) -> None:
    """Receive a stream of ``nbytes`` per ``go`` line; see the module docstring."""
    if keep:
        from kvsidecar.wire.zmq_memory import keep_freed_memory

        keep_freed_memory()
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    dest = np.ones(nbytes, dtype=np.uint8)
    view = dest.data
    endpoint = f"tcp://127.0.0.1:{port}"
    sender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsidecar.bench.peer_raw",
            "zmq-send",
            endpoint,
            str(nbytes),
            str(frame),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if sender.stdin is None or sender.stdout is None:
            raise RuntimeError("no pipes to the raw sender")
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError("raw pyzmq sender did not start")
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            start = time.perf_counter()
            sender.stdin.write("go\n")
            sender.stdin.flush()
            for off in range(0, nbytes, frame):
                sock.recv_into(view[off : off + frame])
            print(time.perf_counter() - start, flush=True)
        sender.stdin.close()
        sender.wait(30)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(5)
        sock.close(linger=0)
        ctx.term()


def nixl_target(nbytes: int) -> None:
    """Expose a registered buffer to a NIXL reader until stdin closes."""
    import torch
    from nixl._api import nixl_agent_config

    from kvsidecar.peer.nixl_plane import new_agent

    buf = torch.ones(nbytes, dtype=torch.uint8)
    agent = new_agent("raw-target", nixl_agent_config(backends=["UCX"]))  # as the daemons'
    agent.register_memory(buf)
    print("META", bytes(agent.get_agent_metadata()).hex(), buf.data_ptr(), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "zmq-send":
        zmq_send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "zmq-recv":
        zmq_recv(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
    else:
        nixl_target(int(sys.argv[2]))
